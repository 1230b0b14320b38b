"""Whether the board is thermally throttled, as one documented rule over plain sysfs files (read_throttling):
a thermal zone at or above its lowest passive trip point AND a clock (the GPU's devfreq, a CPU's cpufreq)
below its maximum. /health and /status show it beside the nvpmodel mode (telemetry.py's BoardTelemetry).

Separate from telemetry.py (the readings /status and /metrics show): this is a judgement over several
readings, and what it claims and does not claim is its own to change.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from edgellm.runtime.board.jetson_sysfs import (
    FAKE_ZONE_PREFIXES,
    TEGRA_ZONE_OFFLINE_MILLI_C,
    THERMAL_DIR,
    THERMAL_ZONE_NAME,
    children,
    find_gpu_devfreq,
    read_int,
    read_label,
)

CPU_DIR = "sys/devices/system/cpu"
CPU_NAME = re.compile(r"^cpu\d+$")
TRIP_TYPE_FILE = re.compile(r"^trip_point_(\d+)_type$")


def _passive_trip_milli_c(zone_dir: Path) -> int | None:
    """A zone's lowest "passive" trip point: where its governor starts lowering clocks (hot/critical come later)."""
    trips = []
    for entry in children(zone_dir):
        match = TRIP_TYPE_FILE.match(entry.name)
        if match and read_label(entry) == "passive":
            milli_c = read_int(zone_dir / f"trip_point_{match.group(1)}_temp")
            if milli_c is not None and milli_c > 0:
                trips.append(milli_c)
    return min(trips) if trips else None


def _hot_zones(root: Path) -> tuple[list[str], bool]:
    """(zones at or above their passive trip point, whether any zone has one to compare with)."""
    hot: list[str] = []
    any_trip = False
    for zone_dir in children(root / THERMAL_DIR):
        if not THERMAL_ZONE_NAME.match(zone_dir.name):
            continue
        zone_type = read_label(zone_dir / "type")
        if zone_type is None or zone_type.startswith(FAKE_ZONE_PREFIXES):
            continue
        trip = _passive_trip_milli_c(zone_dir)
        milli_c = read_int(zone_dir / "temp")
        if trip is None or milli_c is None or milli_c == TEGRA_ZONE_OFFLINE_MILLI_C:
            continue
        any_trip = True
        if milli_c >= trip:
            hot.append(zone_type)
    return hot, any_trip


def _clocks_below_max(root: Path) -> tuple[list[str], bool]:
    """(clocks running below their maximum, whether any clock could be compared): the GPU's devfreq
    cur_freq against its max_freq, each CPU's scaling_cur_freq against its hardware cpuinfo_max_freq
    (scaling_max_freq where that is missing)."""
    below: list[str] = []
    compared = False
    devfreq = find_gpu_devfreq(root)
    if devfreq is not None:
        cur, top = read_int(devfreq / "cur_freq"), read_int(devfreq / "max_freq")
        if cur is not None and top is not None and top > 0:
            compared = True
            if cur < top:
                below.append("gpu")
    for cpu_dir in children(root / CPU_DIR):
        if not CPU_NAME.match(cpu_dir.name):
            continue
        cpufreq = cpu_dir / "cpufreq"
        cur = read_int(cpufreq / "scaling_cur_freq")
        top = read_int(cpufreq / "cpuinfo_max_freq")
        top = top if top is not None else read_int(cpufreq / "scaling_max_freq")
        if cur is not None and top is not None and top > 0:
            compared = True
            if cur < top:
                below.append(cpu_dir.name)
    return below, compared


def read_throttling(root: Path) -> dict[str, Any]:
    """Whether the board is thermally throttled, as one documented rule over plain sysfs files.

    throttled = some thermal zone is at or above its lowest passive trip point (the temperature at which
    the thermal governor starts lowering clocks) AND some clock runs below its maximum (GPU devfreq
    cur_freq < max_freq, or a CPU's scaling_cur_freq < cpuinfo_max_freq).

    What it does not claim: a cool board whose clocks are low is not throttled (the DVFS governor lowers
    idle clocks, and nvpmodel's mode caps them by design; `power_mode` says which mode); and on a hot
    board a clock below its max may be low for want of load rather than because of the heat. Hot with
    every clock at its max is not throttled either. Returns {} (say nothing) when it cannot be decided:
    no zone exposes a passive trip point, or no clock can be compared with its max.

    {"throttled": bool, "hot_zones": [zone types], "below_max": ["gpu", "cpu0", ...]}
    """
    hot, any_trip = _hot_zones(root)
    below, compared = _clocks_below_max(root)
    if not any_trip or not compared:
        return {}
    return {"throttled": bool(hot and below), "hot_zones": hot, "below_max": below}

"""Jetson board telemetry read straight from sysfs: GPU load and clock, temperatures, power rails, nvpmodel mode.

Why not tegrastats: it is a long-running subprocess that prints a format NVIDIA changes between releases, while
every number it shows comes from plain files that any user can read. Reading those files costs a few hundred
microseconds and needs nothing installed.

Layouts covered (all paths are taken relative to `root`, so tests can point it at a fixture tree):

- model: /proc/device-tree/model (NUL-terminated, as every device-tree string property is).
- GPU load, per-mille: /sys/devices/platform/gpu.0/load (Orin), /sys/devices/gpu.0/load (Xavier, Nano), or the
  `device/load` of the GPU's devfreq node.
- GPU clock, Hz: the GPU's devfreq node, /sys/class/devfreq/17000000.ga10b (Orin, L4T R35), 17000000.gpu (Orin,
  L4T R36), 17000000.gv11b (Xavier), so the node is found by name rather than by a fixed path.
- temperatures, millidegrees C: /sys/devices/virtual/thermal/thermal_zone*/{type,temp}.
- power rails: the INA3221 monitors, through hwmon (driver ina3221, L4T R35+: in{N}_label, in{N}_input mV,
  curr{N}_input mA) or through the older IIO driver (ina3221x, L4T R32: rail_name_{N}, in_voltage{N}_input mV,
  in_current{N}_input mA, in_power{N}_input mW), under whichever I2C address the board uses (1-0040 and 1-0041 on
  AGX Orin, 7-0040 on Xavier NX).
- power mode: /var/lib/nvpmodel/status ("pmode:0000", written by nvpmodel itself), named by /etc/nvpmodel.conf.

What is absent is left out, never reported as zero: a dashboard that shows 0 W for a board with no power monitor
tells a lie that a missing series does not.
"""

from __future__ import annotations

import copy
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MODEL_FILE = "proc/device-tree/model"
GPU_LOAD_FILES = ("sys/devices/platform/gpu.0/load", "sys/devices/gpu.0/load")
DEVFREQ_DIR = "sys/class/devfreq"
# Devfreq node names of Jetson GPUs: "gpu" (17000000.gpu on L4T R36, 57000000.gpu on Nano) and the chip names.
GPU_DEVFREQ_MARKERS = ("gpu", "ga10b", "gv11b", "gp10b", "gm20b")
THERMAL_DIR = "sys/devices/virtual/thermal"
INA3221_DRIVER_DIRS = ("sys/bus/i2c/drivers/ina3221", "sys/bus/i2c/drivers/ina3221x")
NVPMODEL_STATUS_FILE = "var/lib/nvpmodel/status"
NVPMODEL_CONF_FILE = "etc/nvpmodel.conf"

# Orin's BPMP reports -256 C for zones whose sensor is fused off (cv0..cv2 on an Orin Nano, which has no DLA).
TEGRA_ZONE_OFFLINE_MILLI_C = -256000
ABSOLUTE_ZERO_MILLI_C = -273150
# The PMIC-Die zone on Xavier/Nano/TX boards is a trip-point stub that always reads 100 C, not a measurement.
FAKE_ZONE_PREFIXES = ("PMIC",)

I2C_DEVICE_NAME = re.compile(r"^\d+-[0-9a-fA-F]{4}$")  # "1-0040": bus 1, address 0x40
THERMAL_ZONE_NAME = re.compile(r"^thermal_zone(\d+)$")
PMODE = re.compile(r"pmode:\s*(\d+)")
POWER_MODEL_LINE = re.compile(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=([^\s>]+)")

Sample = tuple[str, str, dict[str, str], float]


def _read_text(path: Path) -> str | None:
    """A sysfs file's text, or None when it is missing, unreadable (EIO from a sleeping sensor) or not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def _read_label(path: Path) -> str | None:
    text = _read_text(path)
    label = text.replace("\x00", "").strip() if text is not None else ""
    return label or None


def _children(directory: Path) -> list[Path]:
    """Entries of a directory in name order (stable output), or none when it does not exist."""
    try:
        return sorted(directory.iterdir(), key=lambda path: path.name)
    except OSError:
        return []


def read_model(root: Path) -> str | None:
    return _read_label(root / MODEL_FILE)


def find_gpu_devfreq(root: Path) -> Path | None:
    """The GPU's devfreq node: its name differs by chip and by L4T release, so match on the name."""
    for node in _children(root / DEVFREQ_DIR):
        if any(marker in node.name.lower() for marker in GPU_DEVFREQ_MARKERS):
            return node
    return None


def read_gpu(root: Path) -> dict[str, float]:
    gpu: dict[str, float] = {}
    devfreq = find_gpu_devfreq(root)
    load_files = [root / name for name in GPU_LOAD_FILES]
    if devfreq is not None:
        load_files.append(devfreq / "device" / "load")
    for load_file in load_files:
        permille = _read_int(load_file)
        if permille is not None and 0 <= permille <= 1000:
            gpu["load_percent"] = permille / 10
            break
    if devfreq is not None:
        for key, file_name in (("freq_mhz", "cur_freq"), ("min_freq_mhz", "min_freq"), ("max_freq_mhz", "max_freq")):
            hz = _read_int(devfreq / file_name)
            if hz is not None and hz >= 0:
                gpu[key] = hz / 1_000_000
    return gpu


def read_temperatures(root: Path) -> dict[str, float]:
    """Zone type -> degrees C, in zone order; a type seen twice keeps its zone number so neither is lost."""
    zones = []
    for zone_dir in _children(root / THERMAL_DIR):
        match = THERMAL_ZONE_NAME.match(zone_dir.name)
        if match:
            zones.append((int(match.group(1)), zone_dir))
    temperatures: dict[str, float] = {}
    for number, zone_dir in sorted(zones):
        zone_type = _read_label(zone_dir / "type")
        milli_c = _read_int(zone_dir / "temp")
        if zone_type is None or milli_c is None or zone_type.startswith(FAKE_ZONE_PREFIXES):
            continue
        if milli_c == TEGRA_ZONE_OFFLINE_MILLI_C or milli_c < ABSOLUTE_ZERO_MILLI_C:
            continue
        key = zone_type if zone_type not in temperatures else f"{zone_type}_{number}"
        temperatures[key] = milli_c / 1000
    return temperatures


@dataclass(frozen=True)
class RailSource:
    """Where one INA3221 channel's reading lives: the driver's own power file (IIO), else voltage x current.

    Resolved once (`rail_sources`) so that a caller reading often (runtime/board/energy.py, ~10 times a second)
    reads two or three small files per sample instead of walking the driver tree each time.
    """

    label: str
    millivolts: Path | None = None
    milliamps: Path | None = None
    milliwatts: Path | None = None  # the ina3221x IIO driver computes the power itself

    def read_mw(self) -> float | None:
        if self.milliwatts is not None:
            milliwatts = _read_int(self.milliwatts)
            if milliwatts is not None:
                return float(milliwatts)
        if self.millivolts is None or self.milliamps is None:
            return None
        millivolts = _read_int(self.millivolts)
        milliamps = _read_int(self.milliamps)
        if millivolts is None or milliamps is None:
            return None
        return millivolts * milliamps / 1000


def _hwmon_sources(hwmon_dir: Path) -> Iterator[RailSource]:
    """The mainline ina3221 driver: channels 1..3, bus voltage in mV and current in mA."""
    for channel in (1, 2, 3):
        label = _read_label(hwmon_dir / f"in{channel}_label")
        # "NC": a channel wired to nothing (AGX Orin's second monitor).
        if label is None or label == "NC":
            continue
        yield RailSource(label, hwmon_dir / f"in{channel}_input", hwmon_dir / f"curr{channel}_input")


def _iio_sources(iio_dir: Path) -> Iterator[RailSource]:
    """NVIDIA's older ina3221x IIO driver: channels 0..2, with the power already computed by the driver."""
    for channel in (0, 1, 2):
        label = _read_label(iio_dir / f"rail_name_{channel}")
        if label is None:
            continue
        yield RailSource(
            label,
            iio_dir / f"in_voltage{channel}_input",
            iio_dir / f"in_current{channel}_input",
            iio_dir / f"in_power{channel}_input",
        )


def rail_sources(root: Path) -> list[RailSource]:
    """Every labelled INA3221 channel found, in driver, device and channel order (a label may repeat)."""
    sources: list[RailSource] = []
    for driver_dir in INA3221_DRIVER_DIRS:
        # The driver directory also holds bind/unbind/uevent and a module link: keep only I2C device folders.
        for device_dir in _children(root / driver_dir):
            if not I2C_DEVICE_NAME.match(device_dir.name):
                continue
            for hwmon_dir in _children(device_dir / "hwmon"):
                sources.extend(_hwmon_sources(hwmon_dir))
            for iio_dir in _children(device_dir):
                if iio_dir.name.startswith("iio:device"):
                    sources.extend(_iio_sources(iio_dir))
    return sources


def read_power_rails(root: Path) -> dict[str, float]:
    """Rail label -> mW from every INA3221 found; the first reading of a label wins."""
    rails: dict[str, float] = {}
    for source in rail_sources(root):
        if source.label not in rails and (milliwatts := source.read_mw()) is not None:
            rails[source.label] = milliwatts
    return rails


def read_power_mode(root: Path) -> dict[str, Any]:
    """{"id": 0, "name": "15W"}; the name only when nvpmodel.conf defines that id."""
    status = _read_text(root / NVPMODEL_STATUS_FILE)
    match = PMODE.search(status) if status is not None else None
    if match is None:
        return {}
    mode: dict[str, Any] = {"id": int(match.group(1))}
    conf = _read_text(root / NVPMODEL_CONF_FILE) or ""
    for line in conf.splitlines():
        definition = POWER_MODEL_LINE.search(line)
        if definition and not line.lstrip().startswith("#") and int(definition.group(1)) == mode["id"]:
            mode["name"] = definition.group(2)
            break
    return mode


CPU_DIR = "sys/devices/system/cpu"
CPU_NAME = re.compile(r"^cpu\d+$")
TRIP_TYPE_FILE = re.compile(r"^trip_point_(\d+)_type$")


def _passive_trip_milli_c(zone_dir: Path) -> int | None:
    """A zone's lowest "passive" trip point: where its governor starts lowering clocks (hot/critical come later)."""
    trips = []
    for entry in _children(zone_dir):
        match = TRIP_TYPE_FILE.match(entry.name)
        if match and _read_label(entry) == "passive":
            milli_c = _read_int(zone_dir / f"trip_point_{match.group(1)}_temp")
            if milli_c is not None and milli_c > 0:
                trips.append(milli_c)
    return min(trips) if trips else None


def _hot_zones(root: Path) -> tuple[list[str], bool]:
    """(zones at or above their passive trip point, whether any zone has one to compare with)."""
    hot: list[str] = []
    any_trip = False
    for zone_dir in _children(root / THERMAL_DIR):
        if not THERMAL_ZONE_NAME.match(zone_dir.name):
            continue
        zone_type = _read_label(zone_dir / "type")
        if zone_type is None or zone_type.startswith(FAKE_ZONE_PREFIXES):
            continue
        trip = _passive_trip_milli_c(zone_dir)
        milli_c = _read_int(zone_dir / "temp")
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
        cur, top = _read_int(devfreq / "cur_freq"), _read_int(devfreq / "max_freq")
        if cur is not None and top is not None and top > 0:
            compared = True
            if cur < top:
                below.append("gpu")
    for cpu_dir in _children(root / CPU_DIR):
        if not CPU_NAME.match(cpu_dir.name):
            continue
        cpufreq = cpu_dir / "cpufreq"
        cur = _read_int(cpufreq / "scaling_cur_freq")
        top = _read_int(cpufreq / "cpuinfo_max_freq")
        top = top if top is not None else _read_int(cpufreq / "scaling_max_freq")
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


SECTIONS: tuple[tuple[str, Callable[[Path], Any]], ...] = (
    ("model", read_model),
    ("gpu", read_gpu),
    ("temperatures_c", read_temperatures),
    ("power_mw", read_power_rails),
    ("power_mode", read_power_mode),
)


class BoardTelemetry:
    """Board readings, re-read from sysfs at most once per `min_interval_s` however often `read()` is called.

    The cache matters because a scrape, a /status call and a log line may all ask within the same second, and
    the INA3221 only refreshes its averages every few hundred milliseconds anyway.
    """

    def __init__(
        self,
        root: str | Path = "/",
        min_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = Path(root)
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._lock = threading.Lock()  # the metrics scrape and request handlers may read concurrently
        self._cached: dict[str, Any] | None = None
        self._read_at = 0.0
        self._health: dict[str, Any] | None = None
        self._health_at = 0.0

    def read(self) -> dict[str, Any]:
        """A JSON-friendly dict of what this board exposes; {} on a machine with none of it. Never raises."""
        with self._lock:
            now = self._clock()
            if self._cached is None or now - self._read_at >= self.min_interval_s:
                self._cached = self._collect()
                self._read_at = now
            # A copy, so a caller that edits its result (merging it into a payload) cannot edit the cache.
            return copy.deepcopy(self._cached)

    def samples(self) -> list[Sample]:
        """The /metrics gauges of the current reading."""
        return prometheus_samples(self.read())

    def health(self) -> dict[str, Any]:
        """What /health (and /status) say about how the board runs: the nvpmodel mode and the throttling
        flag (read_throttling); {} when neither is known. Cached like read(), on its own clock, so a
        /health poll does not pay for the whole reading."""
        with self._lock:
            now = self._clock()
            if self._health is None or now - self._health_at >= self.min_interval_s:
                self._health = self._collect_health()
                self._health_at = now
            return copy.deepcopy(self._health)

    def _collect_health(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for key, reader in (("power_mode", read_power_mode), ("throttle", read_throttling)):
            try:
                value = reader(self.root)
            except Exception:  # advisory, as in _collect
                log.debug("board telemetry: %s unreadable under %s", key, self.root, exc_info=True)
                continue
            if value and key == "throttle":
                data.update(value)  # "throttled", "hot_zones", "below_max" side by side with power_mode
            elif value:
                data[key] = value
        return data

    def _collect(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for key, reader in SECTIONS:
            try:
                value = reader(self.root)
            except Exception:  # telemetry is advisory: an unforeseen layout costs its section, never the caller
                log.debug("board telemetry: %s unreadable under %s", key, self.root, exc_info=True)
                continue
            if value:
                data[key] = value
        return data


def prometheus_samples(data: Mapping[str, Any]) -> list[Sample]:
    """Gauges (name, help, labels, value) for a `BoardTelemetry.read()` result; only for the fields it has."""
    samples: list[Sample] = []
    gpu = data.get("gpu") or {}
    if "load_percent" in gpu:
        samples.append(
            ("edgellm_board_gpu_load_percent", "Jetson GPU busy share, percent.", {}, float(gpu["load_percent"]))
        )
    if "freq_mhz" in gpu:
        samples.append(("edgellm_board_gpu_freq_mhz", "Jetson GPU clock, MHz.", {}, float(gpu["freq_mhz"])))
    for zone, celsius in (data.get("temperatures_c") or {}).items():
        samples.append(
            ("edgellm_board_temperature_celsius", "Thermal zone temperature.", {"zone": zone}, float(celsius))
        )
    for rail, milliwatts in (data.get("power_mw") or {}).items():
        samples.append(
            ("edgellm_board_power_milliwatts", "INA3221 power rail draw.", {"rail": rail}, float(milliwatts))
        )
    mode = data.get("power_mode") or {}
    if "id" in mode:
        # Every sample of a family carries the same label names, so an unnamed mode gets name="".
        samples.append(
            (
                "edgellm_board_power_mode",
                "nvpmodel power mode id (name in the label).",
                {"name": str(mode.get("name", ""))},
                float(mode["id"]),
            )
        )
    return samples


__all__ = ["BoardTelemetry", "RailSource", "prometheus_samples", "rail_sources", "read_throttling"]

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

The file readers and the zones' and devfreq's whereabouts are runtime/board/jetson_sysfs.py; whether the board
is throttling (for /health) is runtime/board/throttling.py's rule.
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

from edgellm.runtime.board.jetson_sysfs import (
    FAKE_ZONE_PREFIXES,
    TEGRA_ZONE_OFFLINE_MILLI_C,
    THERMAL_DIR,
    THERMAL_ZONE_NAME,
    children,
    find_gpu_devfreq,
    read_int,
    read_label,
    read_text,
)
from edgellm.runtime.board.throttling import read_throttling

log = logging.getLogger(__name__)

MODEL_FILE = "proc/device-tree/model"
GPU_LOAD_FILES = ("sys/devices/platform/gpu.0/load", "sys/devices/gpu.0/load")
INA3221_DRIVER_DIRS = ("sys/bus/i2c/drivers/ina3221", "sys/bus/i2c/drivers/ina3221x")
NVPMODEL_STATUS_FILE = "var/lib/nvpmodel/status"
NVPMODEL_CONF_FILE = "etc/nvpmodel.conf"

ABSOLUTE_ZERO_MILLI_C = -273150

I2C_DEVICE_NAME = re.compile(r"^\d+-[0-9a-fA-F]{4}$")  # "1-0040": bus 1, address 0x40
PMODE = re.compile(r"pmode:\s*(\d+)")
POWER_MODEL_LINE = re.compile(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=([^\s>]+)")

Sample = tuple[str, str, dict[str, str], float]


def read_model(root: Path) -> str | None:
    return read_label(root / MODEL_FILE)


def read_gpu(root: Path) -> dict[str, float]:
    gpu: dict[str, float] = {}
    devfreq = find_gpu_devfreq(root)
    load_files = [root / name for name in GPU_LOAD_FILES]
    if devfreq is not None:
        load_files.append(devfreq / "device" / "load")
    for load_file in load_files:
        permille = read_int(load_file)
        if permille is not None and 0 <= permille <= 1000:
            gpu["load_percent"] = permille / 10
            break
    if devfreq is not None:
        for key, file_name in (("freq_mhz", "cur_freq"), ("min_freq_mhz", "min_freq"), ("max_freq_mhz", "max_freq")):
            hz = read_int(devfreq / file_name)
            if hz is not None and hz >= 0:
                gpu[key] = hz / 1_000_000
    return gpu


def read_temperatures(root: Path) -> dict[str, float]:
    """Zone type -> degrees C, in zone order; a type seen twice keeps its zone number so neither is lost."""
    zones = []
    for zone_dir in children(root / THERMAL_DIR):
        match = THERMAL_ZONE_NAME.match(zone_dir.name)
        if match:
            zones.append((int(match.group(1)), zone_dir))
    temperatures: dict[str, float] = {}
    for number, zone_dir in sorted(zones):
        zone_type = read_label(zone_dir / "type")
        milli_c = read_int(zone_dir / "temp")
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
            milliwatts = read_int(self.milliwatts)
            if milliwatts is not None:
                return float(milliwatts)
        if self.millivolts is None or self.milliamps is None:
            return None
        millivolts = read_int(self.millivolts)
        milliamps = read_int(self.milliamps)
        if millivolts is None or milliamps is None:
            return None
        return millivolts * milliamps / 1000


def _hwmon_sources(hwmon_dir: Path) -> Iterator[RailSource]:
    """The mainline ina3221 driver: channels 1..3, bus voltage in mV and current in mA."""
    for channel in (1, 2, 3):
        label = read_label(hwmon_dir / f"in{channel}_label")
        # "NC": a channel wired to nothing (AGX Orin's second monitor).
        if label is None or label == "NC":
            continue
        yield RailSource(label, hwmon_dir / f"in{channel}_input", hwmon_dir / f"curr{channel}_input")


def _iio_sources(iio_dir: Path) -> Iterator[RailSource]:
    """NVIDIA's older ina3221x IIO driver: channels 0..2, with the power already computed by the driver."""
    for channel in (0, 1, 2):
        label = read_label(iio_dir / f"rail_name_{channel}")
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
        for device_dir in children(root / driver_dir):
            if not I2C_DEVICE_NAME.match(device_dir.name):
                continue
            for hwmon_dir in children(device_dir / "hwmon"):
                sources.extend(_hwmon_sources(hwmon_dir))
            for iio_dir in children(device_dir):
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
    status = read_text(root / NVPMODEL_STATUS_FILE)
    match = PMODE.search(status) if status is not None else None
    if match is None:
        return {}
    mode: dict[str, Any] = {"id": int(match.group(1))}
    conf = read_text(root / NVPMODEL_CONF_FILE) or ""
    for line in conf.splitlines():
        definition = POWER_MODEL_LINE.search(line)
        if definition and not line.lstrip().startswith("#") and int(definition.group(1)) == mode["id"]:
            mode["name"] = definition.group(2)
            break
    return mode


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


__all__ = ["BoardTelemetry", "RailSource", "prometheus_samples", "rail_sources"]

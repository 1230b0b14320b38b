"""The Jetson's sysfs as plain values, for telemetry.py and throttling.py alike: a file's text, integer or label
(absent, unreadable or garbled: None, never zero), a folder's entries in name order, the thermal zones'
folder and which zones are not real measurements, and the GPU's devfreq node, found by name (it differs
by chip and by L4T release). Every path is relative to a `root`, so tests point it at a fixture tree.

Separate from the readers: where the files are and how one is read are shared by readings that change
for reasons of their own (what /status shows; the throttling rule).
"""

from __future__ import annotations

import re
from pathlib import Path

DEVFREQ_DIR = "sys/class/devfreq"
# Devfreq node names of Jetson GPUs: "gpu" (17000000.gpu on L4T R36, 57000000.gpu on Nano) and the chip names.
GPU_DEVFREQ_MARKERS = ("gpu", "ga10b", "gv11b", "gp10b", "gm20b")
THERMAL_DIR = "sys/devices/virtual/thermal"
# Orin's BPMP reports -256 C for zones whose sensor is fused off (cv0..cv2 on an Orin Nano, which has no DLA).
TEGRA_ZONE_OFFLINE_MILLI_C = -256000
# The PMIC-Die zone on Xavier/Nano/TX boards is a trip-point stub that always reads 100 C, not a measurement.
FAKE_ZONE_PREFIXES = ("PMIC",)
THERMAL_ZONE_NAME = re.compile(r"^thermal_zone(\d+)$")


def read_text(path: Path) -> str | None:
    """A sysfs file's text, or None when it is missing, unreadable (EIO from a sleeping sensor) or not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None


def read_int(path: Path) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def read_label(path: Path) -> str | None:
    text = read_text(path)
    label = text.replace("\x00", "").strip() if text is not None else ""
    return label or None


def children(directory: Path) -> list[Path]:
    """Entries of a directory in name order (stable output), or none when it does not exist."""
    try:
        return sorted(directory.iterdir(), key=lambda path: path.name)
    except OSError:
        return []


def find_gpu_devfreq(root: Path) -> Path | None:
    """The GPU's devfreq node: its name differs by chip and by L4T release, so match on the name."""
    for node in children(root / DEVFREQ_DIR):
        if any(marker in node.name.lower() for marker in GPU_DEVFREQ_MARKERS):
            return node
    return None

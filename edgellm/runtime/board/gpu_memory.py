"""Free GPU (or unified) memory, where the platform exposes it; None where it does not.

Jetson: the GPU shares system RAM, so MemAvailable of /proc/meminfo is the GPU's free memory
(what tegrastats reports as RAM). Discrete NVIDIA GPUs: NVML through `nvidia-ml-py` when
installed, else `nvidia-smi`. Anything else: absent.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

TEGRA_RELEASE = Path("/etc/nv_tegra_release")


def _meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        out[key] = int(rest.split()[0]) if rest.split() else 0
    return out


def _jetson() -> dict[str, Any] | None:
    if not TEGRA_RELEASE.exists():
        return None
    info = _meminfo()
    return {
        "source": "jetson-unified-memory (/proc/meminfo)",
        "free_mb": info["MemAvailable"] // 1024,
        "total_mb": info["MemTotal"] // 1024,
    }


def _nvml() -> dict[str, Any] | None:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        return {"source": "nvml", "free_mb": mem.free // 2**20, "total_mb": mem.total // 2**20}
    except Exception:  # NVML errors mean "not available here", never a failed /status
        return None


def _nvidia_smi() -> dict[str, Any] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.splitlines()[0]
        free, total = (int(x.strip()) for x in out.split(","))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return {"source": "nvidia-smi", "free_mb": free, "total_mb": total}


def gpu_memory() -> dict[str, Any] | None:
    for probe in (_jetson, _nvml, _nvidia_smi):
        found = probe()
        if found is not None:
            return found
    return None

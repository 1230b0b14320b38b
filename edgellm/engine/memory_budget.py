"""The memory budget a plan is made against: a share of MemAvailable, or the operator's memory_budget
setting read as a size ("6GiB", "6.5G", a byte count).

Apart from the plan (memory_plan.py): this reads the host and the settings' words, the plan only numbers.
"""

from __future__ import annotations

import math
import re
from pathlib import Path


def default_budget_bytes(
    meminfo_path: str | Path = "/proc/meminfo", share: float = 0.75, meminfo_text: str | None = None
) -> int:
    """A share of MemAvailable: on a Jetson the GPU allocates from the same memory as the CPU, so this is
    the pool for weights, KV cache and buffers alike. The rest is left to the CUDA runtime, the OS and
    whatever else runs on the board. `meminfo_text`: a reading taken earlier (serve's, before its engine
    worker began allocating: that worker is planned for in memory_plan.DEFAULT_OVERHEAD_BYTES)."""
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    text = meminfo_text if meminfo_text is not None else Path(meminfo_path).read_text()
    match = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, re.MULTILINE)
    if match is None:
        raise ValueError(f"{meminfo_path}: no MemAvailable line (kernel older than 3.14?); set memory_budget")
    return int(int(match.group(1)) * 1024 * share)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_SIZE_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(value: str | int | float) -> int:
    """Bytes from a memory_budget setting: a byte count, or a number with a unit. KiB/MiB/GiB/TiB (or
    Ki/Mi/Gi/Ti) are powers of 1024; KB/MB/GB/TB powers of 1000; a bare K/M/G/T is binary too, as in
    `docker --memory 6g` or `java -Xmx6g`. "6GiB", "6.5G", "512MiB", "1500000000" all work."""
    if isinstance(value, bool):
        raise ValueError(f"memory_budget must be a size such as 6GiB, got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"memory_budget must be a positive size, got {value!r}")
        return int(value)
    text = str(value).strip()
    if text.startswith("-"):
        raise ValueError(f"memory_budget must be a positive size, got {value!r}")
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"memory_budget: cannot read {value!r} as a size; use e.g. 6GiB, 6.5G, 512MiB or a byte count")
    number, prefix, binary, byte = match.groups()
    prefix = prefix.lower()
    if binary and not prefix:
        raise ValueError(f"memory_budget: cannot read {value!r} as a size; 'i' needs a unit letter (KiB, MiB, GiB)")
    base = 1000 if prefix and byte and not binary else 1024  # "GB" is decimal; "G", "Gi", "GiB" binary
    size = int(float(number) * base ** _SIZE_POWER[prefix])
    if size <= 0:
        raise ValueError(f"memory_budget must be a positive size, got {value!r}")
    return size

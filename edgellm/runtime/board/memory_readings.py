"""The kernel's memory figures, read from plain files under `root` (tests point it at a fake tree): /proc/meminfo
(MemAvailable, MemTotal), the tightest cgroup limit over this process's cgroup and its ancestors (v2 or v1,
inactive page cache counted as free) and /proc/pressure/memory (PSI some/full avg10, avg60). What is absent
or unreadable is left out of the reading, never read as zero.

Separate from memory_pressure.py (the thresholds, the states and what they refuse or shed): where the
figures come from changes with kernels, cgroup layouts and containers, not with the node's policy.
"""

from __future__ import annotations

import re
from pathlib import Path

MEMINFO_FILE = "proc/meminfo"
PSI_MEMORY_FILE = "proc/pressure/memory"
PROC_SELF_CGROUP = "proc/self/cgroup"
CGROUP_MOUNT = "sys/fs/cgroup"
CGROUP_V1_UNLIMITED = 1 << 62  # v1 writes "no limit" as the largest page-aligned long, 9223372036854771712
MIB = 1024 * 1024
MEMINFO_LINE = re.compile(r"^(\w+):\s+(\d+)\s*kB", re.MULTILINE)
PSI_LINE = re.compile(r"^(some|full)\s+(.*)$", re.MULTILINE)
PSI_FIELD = re.compile(r"(avg10|avg60|avg300)=([0-9.]+)")


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None


def read_meminfo(root: Path) -> dict[str, float]:
    """{"mem_available_mib", "mem_total_mib"} from /proc/meminfo, each only when present."""
    text = _read_text(root / MEMINFO_FILE)
    if text is None:
        return {}
    fields = {name: int(kb) for name, kb in MEMINFO_LINE.findall(text)}
    found: dict[str, float] = {}
    for key, name in (("mem_available_mib", "MemAvailable"), ("mem_total_mib", "MemTotal")):
        if name in fields:
            found[key] = round(fields[name] / 1024, 1)
    return found


def read_psi(root: Path) -> dict[str, float]:
    """{"psi_some_avg10", "psi_full_avg10", ...avg60} from /proc/pressure/memory; {} without PSI."""
    text = _read_text(root / PSI_MEMORY_FILE)
    if text is None:
        return {}
    found: dict[str, float] = {}
    for kind, rest in PSI_LINE.findall(text):
        for name, value in PSI_FIELD.findall(rest):
            if name in ("avg10", "avg60"):
                try:
                    found[f"psi_{kind}_{name}"] = float(value)
                except ValueError:  # "1.2.3": a garbled line costs its field only
                    continue
    return found


def _cgroup_chain(mount: Path, path: str) -> list[Path]:
    """The process's cgroup folder under `mount` and its ancestors up to the mount itself. A path that is
    not there is a container's view without a cgroup namespace (cgroup v1 Docker): its own cgroup is what
    is mounted, so the mount alone is read."""
    leaf = mount / path.strip("/")
    if not leaf.is_dir():
        return [mount] if mount.is_dir() else []
    chain = [leaf]
    while chain[-1] != mount and mount in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain


def _stat_value(text: str | None, *names: str) -> int:
    """The first of `names` found in a memory.stat text (bytes), 0 when none is."""
    fields = dict(line.split(" ", 1) for line in (text or "").splitlines() if " " in line)
    for name in names:
        try:
            return int(fields[name])
        except (KeyError, ValueError):
            continue
    return 0


def _headroom(folder: Path, limit_file: str, usage_file: str, stat_names: tuple[str, ...]) -> tuple[int, int] | None:
    """(limit, bytes left under it) of one cgroup folder; None without a limit. Its inactive page cache
    counts as free, as MemAvailable counts the host's: the kernel reclaims it before the cgroup OOMs."""
    limit_text = _read_text(folder / limit_file)
    if limit_text is None or not limit_text.strip().isdigit():  # "max": no limit (v2)
        return None
    limit = int(limit_text.strip())
    usage = _read_int_file(folder / usage_file) if limit < CGROUP_V1_UNLIMITED else None
    if usage is None:
        return None
    reclaimable = _stat_value(_read_text(folder / "memory.stat"), *stat_names)
    return limit, max(0, limit - usage + reclaimable)


def _read_int_file(path: Path) -> int | None:
    text = _read_text(path)
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def read_cgroup(root: Path) -> dict[str, float]:
    """{"cgroup_limit_mib", "cgroup_available_mib"}: the tightest memory limit over this process's cgroup
    and its ancestors (systemd's MemoryMax= on the unit or its slice, `docker --memory`), cgroup v2 or v1;
    {} when no limit applies. The node's worker is its child, in the same cgroup: one limit covers both."""
    text = _read_text(root / PROC_SELF_CGROUP)
    if text is None:
        return {}
    limits: list[tuple[int, int]] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":  # v2 (unified; under /unified on a hybrid host)
            for mount in (root / CGROUP_MOUNT, root / CGROUP_MOUNT / "unified"):
                for folder in _cgroup_chain(mount, path):
                    found = _headroom(folder, "memory.max", "memory.current", ("inactive_file",))
                    limits += [found] if found else []
        elif "memory" in controllers.split(","):  # v1
            for folder in _cgroup_chain(root / CGROUP_MOUNT / "memory", path):
                found = _headroom(
                    folder, "memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "inactive_file")
                )
                limits += [found] if found else []
    if not limits:
        return {}
    limit, left = min(limits, key=lambda pair: pair[1])
    return {"cgroup_limit_mib": round(limit / MIB, 1), "cgroup_available_mib": round(left / MIB, 1)}


def read_memory(root: Path) -> dict[str, float]:
    return {**read_meminfo(root), **read_cgroup(root), **read_psi(root)}


def available_mib(reading: dict[str, float]) -> tuple[float | None, str]:
    """The tighter of the host's MemAvailable and the cgroup's headroom, and which it was."""
    host, cgroup = reading.get("mem_available_mib"), reading.get("cgroup_available_mib")
    if cgroup is not None and (host is None or cgroup < host):
        return cgroup, f"the cgroup's headroom (limit {reading['cgroup_limit_mib']:g} MiB)"
    return host, "MemAvailable"

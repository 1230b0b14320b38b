"""Resident memory of the node's processes (the API process and the engine worker), for /status."""

from __future__ import annotations

import os


def rss_mib(pid: int | None) -> float | None:
    """VmRSS of a process in MiB from /proc; None where it cannot be read (gone, not Linux)."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_memory(worker_pid: int | None) -> dict[str, float]:
    found = {"api_rss_mib": rss_mib(os.getpid()), "worker_rss_mib": rss_mib(worker_pid)}
    return {k: v for k, v in found.items() if v is not None}

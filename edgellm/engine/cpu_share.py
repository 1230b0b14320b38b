"""How many threads llama.cpp gets, following how much CPU the rest of the machine leaves it.

An edge CPU is shared with camera and sensor pipelines. llama.cpp splits each decode across its
threads and waits for all of them at every barrier: with 2 threads on 2 cores and one busy process
beside it, one of them is always descheduled and the node fell from 143 to 43 tok/s (measured here);
with 1 thread it kept 140. So once a second the governor reads the machine's busy time
(/proc/stat) minus this process's own (os.times), and sets the thread count to the cores the others
leave free (llama_set_n_threads is cheap and takes effect at the next decode). A change needs two
readings in a row that agree, so a short burst elsewhere does not flap it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

INTERVAL_S = 1.0


def threads_for(max_threads: int, cores: int, others_busy: float) -> int:
    """Threads to use when other processes keep `others_busy` cores busy (of `cores` we may run on)."""
    free = cores - others_busy
    # Rounded: a core the others use less than half of still counts as ours (the API process, a
    # logger); a busy loop beside us takes a whole one.
    return max(1, min(max_threads, int(free + 0.5)))


def _machine_busy_s() -> float | None:
    """Seconds of CPU time all processes have used (user + nice + system + irq + softirq + steal)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu" or len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    steal = int(fields[8]) if len(fields) > 8 else 0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_busy_s() -> float:
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """Calls `apply(n)` when the thread count should change; `tick()` is cheap between intervals."""

    def __init__(self, max_threads: int, apply: Callable[[int], None], *, cores: int | None = None):
        self.max_threads = max_threads
        self.cores = cores or affinity_cores()
        self.apply = apply
        self.current = max_threads
        self.switches = 0
        self._last = self._reading()
        self._pending: int | None = None
        self.enabled = self._last is not None and max_threads > 1

    @staticmethod
    def _reading() -> tuple[float, float, float] | None:
        machine = _machine_busy_s()
        return None if machine is None else (time.monotonic(), machine, _own_busy_s())

    def tick(self) -> None:
        if not self.enabled or time.monotonic() - self._last[0] < INTERVAL_S:
            return
        now = self._reading()
        if now is None:
            return
        wall = now[0] - self._last[0]
        others = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2])) / wall
        self._last = now
        target = threads_for(self.max_threads, self.cores, others)
        if target == self.current:
            self._pending = None
            return
        if self._pending != target:  # one reading is not enough: wait for the next to agree
            self._pending = target
            return
        log.info(
            "other processes use %.1f of %d cores: llama.cpp threads %d -> %d", others, self.cores, self.current, target
        )
        self.apply(target)
        self.current, self._pending = target, None
        self.switches += 1


def affinity_cores() -> int:
    """The cores this process may run on (its CPU affinity; the CPU count where there is none): the engine's
    default thread count and the governor's ceiling."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)

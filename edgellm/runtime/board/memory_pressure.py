"""Memory pressure, read before the OOM killer reads it: new work is refused while memory is short.

On a Jetson the GPU allocates from the same RAM as everything else (unified memory), and the camera
pipeline, the desktop and this node all draw on one pool; when it runs out, the kernel's OOM killer picks
the largest process, which is our engine worker, and every request in it is lost. Refusing new work a
little before that point keeps what is already running alive: a 503 with Retry-After tells the caller to
come back, and the requests in flight finish in the memory they already hold.

Three sources, read by runtime/board/memory_readings.py about once a second on this module's daemon thread (paths
relative to `root`, so tests point it at a fake tree, as runtime/board/telemetry.py does):

- /proc/meminfo `MemAvailable` (kB): the kernel's estimate of what can be allocated without swapping,
  page cache it can drop included. Below `min_available_mib`: refusing; below `critical_mib`: critical.
- the node's cgroup (/proc/self/cgroup, then /sys/fs/cgroup, v2 or v1): inside a systemd `MemoryMax=`
  or a `docker --memory` limit the OOM killer acts at that limit, whatever MemAvailable says, so the
  tighter of the two is what is judged.
- /proc/pressure/memory (PSI, Linux 4.20+ with CONFIG_PSI): `full avg10` is the share of the last 10 s in
  which every runnable task was stalled waiting for memory (reclaim, swap-in, zram decompression). It
  sees thrashing that MemAvailable hides on a board with zram swap (JetPack's default). Above
  `psi_full_avg10`: refusing; above `psi_critical_full_avg10`: critical.

A file that is absent or unreadable (no PSI on an old kernel, not Linux) is left out of the reading, never
read as zero: "no pressure data" must not look like "no pressure". A threshold set to 0 is off.

Leaving a state needs a margin (RECOVER_MARGIN): MemAvailable moves in bursts, and a node flapping between
accepting and refusing every second serves nobody well.

Critical calls the `on_critical` hooks once per entry into that state (on the reader thread), so whatever
can give memory back does: each hook returns a line saying what it shed, kept in the state.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from edgellm.errors import EdgeLLMError, EngineUnavailable
from edgellm.runtime.board.memory_readings import available_mib, read_memory
from edgellm.runtime.board.process_memory import rss_mib

log = logging.getLogger(__name__)

# Leave refusing only once MemAvailable is 10% above its threshold and PSI full avg10 is under 80% of its.
RECOVER_MARGIN = 0.10
PSI_RECOVER_FACTOR = 0.8
RETRY_AFTER_S = 5  # PSI's avg10 needs a few seconds to fall; a sooner retry would meet the same refusal

Sample = tuple[str, str, dict[str, str], float]
CriticalHook = Callable[[dict[str, Any]], "str | None"]


class PressureState(str, Enum):
    OK = "ok"
    REFUSING = "refusing"  # new work gets 503; in-flight work continues
    CRITICAL = "critical"  # refusing, and the on_critical hooks were asked to shed memory

    @property
    def level(self) -> int:
        return {"ok": 0, "refusing": 1, "critical": 2}[self.value]


@dataclass(frozen=True)
class Thresholds:
    """The settings' memory_pressure_* values; 0 turns a threshold off."""

    min_available_mib: float = 256.0
    critical_mib: float = 128.0
    psi_full_avg10: float = 10.0
    psi_critical_full_avg10: float = 40.0

    @property
    def enabled(self) -> bool:
        return any((self.min_available_mib, self.critical_mib, self.psi_full_avg10, self.psi_critical_full_avg10))


def judge(reading: dict[str, float], limits: Thresholds, previous: PressureState) -> tuple[PressureState, str | None]:
    """The state a reading puts the node in, and why (None when ok). `previous` decides the margins: a
    node already refusing stays so until the reading is clear of the thresholds by RECOVER_MARGIN."""
    available, source = available_mib(reading)
    full = reading.get("psi_full_avg10")
    held = previous is not PressureState.OK
    mem_margin = 1 + RECOVER_MARGIN if held else 1.0
    psi_factor = PSI_RECOVER_FACTOR if held else 1.0

    if available is not None and limits.critical_mib and available < limits.critical_mib * mem_margin:
        return PressureState.CRITICAL, (
            f"{source} {available:g} MiB is below memory_pressure_critical_mib ({limits.critical_mib:g} MiB)"
        )
    if full is not None and limits.psi_critical_full_avg10 and full > limits.psi_critical_full_avg10 * psi_factor:
        return PressureState.CRITICAL, (
            f"memory PSI full avg10 {full:g}% is above memory_pressure_psi_critical_full_avg10 "
            f"({limits.psi_critical_full_avg10:g}%)"
        )
    if available is not None and limits.min_available_mib and available < limits.min_available_mib * mem_margin:
        return PressureState.REFUSING, (
            f"{source} {available:g} MiB is below memory_pressure_min_available_mib ({limits.min_available_mib:g} MiB)"
        )
    if full is not None and limits.psi_full_avg10 and full > limits.psi_full_avg10 * psi_factor:
        return PressureState.REFUSING, (
            f"memory PSI full avg10 {full:g}% is above memory_pressure_psi_full_avg10 ({limits.psi_full_avg10:g}%)"
        )
    return PressureState.OK, None


class MemoryPressure:
    """The reader thread and the admission decision it feeds.

    `refusal()` and `state()` only look at the last reading (no file is read on a request's path), so
    /health and every POST pay a lock and a dict copy, nothing more.
    """

    def __init__(
        self,
        limits: Thresholds,
        root: str | Path = "/",
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.limits = limits
        self.root = Path(root)
        self.interval_s = interval_s
        self.on_critical: list[CriticalHook] = []  # called on entering CRITICAL, on the reader thread
        self._clock = clock
        self._lock = threading.Lock()  # the reader thread writes, request handlers and scrapes read
        self._state = PressureState.OK
        self._reason: str | None = None
        self._reading: dict[str, float] = {}
        self._since = clock()
        self._refused = 0
        self._critical_events = 0
        self._shed: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the reader ---------------------------------------------------------------------------
    def start(self) -> None:
        """Read once now (the first request is judged on a real reading), then every interval_s."""
        self.poll()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="memory-pressure", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # the reader must outlive a surprise; the last state stands meanwhile
                log.exception("memory pressure: reading %s failed", self.root)

    def poll(self) -> PressureState:
        """One reading and the state it leads to; the on_critical hooks run on entering CRITICAL."""
        reading = read_memory(self.root)
        with self._lock:
            before = self._state
            state, reason = judge(reading, self.limits, before)
            self._reading, self._reason = reading, reason
            if state is not before:
                self._state, self._since = state, self._clock()
            if state is PressureState.CRITICAL and before is not PressureState.CRITICAL:
                # Counted with the state change, so /health never shows critical without its event; the
                # hooks run after the lock is let go: refusing new work must not wait for them.
                self._critical_events += 1
                self._shed = []
        if state is not before:
            level = logging.INFO if state is PressureState.OK else logging.WARNING
            log.log(level, "memory pressure: %s -> %s%s", before.value, state.value, f": {reason}" if reason else "")
        if state is PressureState.CRITICAL and before is not PressureState.CRITICAL:
            self._shed_memory(reading)
        return state

    def _shed_memory(self, reading: dict[str, float]) -> None:
        shed: list[str] = []
        for hook in list(self.on_critical):
            try:
                what = hook(dict(reading))
            except Exception as exc:  # one hook failing must not keep the others from giving memory back
                log.exception("memory pressure: an on_critical hook failed")
                what = f"{getattr(hook, '__name__', 'hook')} failed: {exc!r}"
            if what:
                shed.append(what)
        with self._lock:
            self._shed = shed
        log.warning("memory pressure: critical; shed: %s", "; ".join(shed) or "nothing (no on_critical hook)")

    # -- what the node asks -------------------------------------------------------------------
    def refusal(self) -> EdgeLLMError | None:
        """The 503 for a new request while memory is short (counted), or None when it may go ahead."""
        with self._lock:
            if self._state is PressureState.OK:
                return None
            self._refused += 1
            reason = self._reason
        return EngineUnavailable(
            f"memory pressure: {reason}; new requests are refused until memory recovers (requests already "
            f"accepted go on); retry after {RETRY_AFTER_S} s",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    def state(self) -> dict[str, Any]:
        """The /health and /status block: state, the reading, why, since when, what was shed."""
        with self._lock:
            body: dict[str, Any] = {"state": self._state.value, **self._reading, "reason": self._reason}
            body["since"] = round(self._since, 3)
            body["refused"] = self._refused
            body["critical_events"] = self._critical_events
            if self._critical_events:
                body["shed"] = list(self._shed)  # [] until the hooks of the latest entry have run
            body["thresholds"] = {
                "min_available_mib": self.limits.min_available_mib,
                "critical_mib": self.limits.critical_mib,
                "psi_full_avg10": self.limits.psi_full_avg10,
                "psi_critical_full_avg10": self.limits.psi_critical_full_avg10,
            }
            return body

    def samples(self) -> list[Sample]:
        """Prometheus gauges of the last reading; a value the reading lacks has no series."""
        with self._lock:
            reading, state = dict(self._reading), self._state
        samples: list[Sample] = [
            (
                "edgellm_memory_pressure_state",
                "Memory pressure admission state: 0 ok, 1 refusing new work, 2 critical.",
                {},
                float(state.level),
            )
        ]
        if "mem_available_mib" in reading:
            samples.append(
                (
                    "edgellm_memory_available_bytes",
                    "MemAvailable from /proc/meminfo.",
                    {},
                    float(reading["mem_available_mib"]) * 1024 * 1024,
                )
            )
        if "cgroup_available_mib" in reading:
            samples.append(
                (
                    "edgellm_memory_cgroup_available_bytes",
                    "Bytes left under the node's cgroup memory limit (inactive page cache counted free).",
                    {},
                    float(reading["cgroup_available_mib"]) * 1024 * 1024,
                )
            )
        for kind in ("some", "full"):
            key = f"psi_{kind}_avg10"
            if key in reading:
                samples.append(
                    (
                        "edgellm_memory_psi_avg10",
                        "Memory pressure stall information, percent of the last 10 s.",
                        {"kind": kind},
                        float(reading[key]),
                    )
                )
        return samples


def trim_heap(reading: dict[str, float] | None = None) -> str | None:
    """An on_critical hook: gc, then glibc's malloc_trim(0), which hands the freed heap pages of this (the
    API) process back to the kernel. Returns what it gave back (RSS before -> after), None where
    malloc_trim is not there (musl, not Linux). Small next to a model, but real and immediate."""
    try:
        malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    before = rss_mib(os.getpid())
    gc.collect()
    malloc_trim(0)
    after = rss_mib(os.getpid())
    if before is None or after is None:
        return "API process heap trimmed"
    return f"API process heap trimmed: RSS {before:g} -> {after:g} MiB"


__all__ = ["MemoryPressure", "PressureState", "Thresholds", "judge", "trim_heap"]

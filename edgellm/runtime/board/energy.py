"""Energy of the board: its input power sampled on a daemon thread and integrated over time (joules).

Which power: the board's own input rail where its INA3221 has one (VDD_IN on Orin Nano/NX, Xavier NX and
TX2; POM_5V_IN on the Nano): everything the module draws, CPU, GPU, memory and SoC alike, which is what
an answer costs. Summing that rail with the others would count the CPU/GPU/SoC rails twice, since they
are inside it. A board without such a rail (AGX Orin: VDD_GPU_SOC, VDD_CPU_CV, VIN_SYS_5V0, VDDQ_VDD2_1V8AO)
gets the sum of every rail it has, as jtop sums them. `rail` says which one the meter uses.

Integration: the trapezoid rule between consecutive samples (~10 Hz by default), into a cumulative joules
counter that starts at 0 when the meter starts. `joules()` answers between samples too, by holding the
last sample's power since then; the answers never go down (see `joules`). A sample that cannot be read (a
rail's file unreadable for a moment) is skipped: the next good one is joined to the last by a straight
line, so the gap's energy is estimated rather than lost or zeroed.

No power monitor (every non-Jetson machine): `available` is False, no thread runs, and callers leave every
energy field out; a board without a monitor is never reported as drawing 0 W.

Framework-agnostic: the engine worker (per-request attribution, engine/step_energy.py) and the API process
(the board's total for /metrics) each run one; nothing here knows FastAPI or llama.cpp.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from edgellm.runtime.board.telemetry import RailSource, rail_sources

log = logging.getLogger(__name__)

# The board's input rail, by the names NVIDIA's device trees give it: the whole module's draw.
TOTAL_RAILS = ("VDD_IN", "POM_5V_IN")
# 10 Hz: a few samples even for a 0.3 s answer, at ~30 us a sample (two small sysfs reads): ~0.03% of a core.
DEFAULT_INTERVAL_S = 0.1


def power_sources(root: Path) -> tuple[str, list[RailSource]]:
    """(the rail's name, the channels whose sum is the board's power): the total rail alone where
    present, else every rail (first of each label), keeping only channels readable right now."""
    unique: dict[str, RailSource] = {}
    for source in rail_sources(root):
        if source.label not in unique and source.read_mw() is not None:
            unique[source.label] = source
    for label in TOTAL_RAILS:
        if label in unique:
            return label, [unique[label]]
    return "+".join(unique), list(unique.values())


class EnergyMeter:
    """Cumulative joules of the board's input power since `start()`; `available` False without a monitor."""

    def __init__(
        self,
        root: str | Path = "/",
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        history: int = 64,
    ) -> None:
        self.root = Path(root)
        self.interval_s = max(0.001, float(interval_s))
        self._clock = clock
        try:
            self.rail, self._sources = power_sources(self.root)
        except Exception:  # telemetry is advisory: an unforeseen layout means no meter, never a failed start
            log.debug("energy meter: no power rails under %s", self.root, exc_info=True)
            self.rail, self._sources = "", []
        self._lock = threading.Lock()  # the sampling thread writes; request threads and scrapes read
        self._joules = 0.0  # the trapezoid integral up to the last sample
        self._last: tuple[float, float] | None = None  # (clock, watts) of the last good sample
        self._floor = 0.0  # the highest value joules() has answered: answers never go down
        # The last samples (clock, watts), for tests and debugging: the integral is their trapezoid sum.
        self.history: deque[tuple[float, float]] = deque(maxlen=max(2, history))
        self.samples = 0  # good samples taken
        self.missed = 0  # samples that could not be read
        self.sample_s = 0.0  # wall time spent reading samples (their cost, /samples per sample)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        """Whether the board has a power monitor to integrate (decided once, at construction)."""
        return bool(self._sources)

    def read_watts(self) -> float | None:
        """The board's power now, or None when a channel of it cannot be read (a partial sum would be wrong)."""
        total_mw = 0.0
        for source in self._sources:
            milliwatts = source.read_mw()
            if milliwatts is None:
                return None
            total_mw += milliwatts
        return total_mw / 1000 if self._sources else None

    def sample(self) -> float | None:
        """Take one sample and integrate it; its watts (None: unreadable, skipped). The thread calls this;
        tests may call it directly with a clock of their own."""
        t0 = time.perf_counter()
        watts = self.read_watts()
        now = self._clock()
        cost = time.perf_counter() - t0
        with self._lock:
            self.sample_s += cost
            if watts is None:
                self.missed += 1
                return None
            if self._last is not None:
                last_t, last_w = self._last
                dt = now - last_t
                if dt > 0:
                    self._joules += (last_w + watts) / 2 * dt
            self._last = (now, watts)
            self.history.append((now, watts))
            self.samples += 1
        return watts

    def joules(self) -> float:
        """Joules since start, up to now: the integral to the last sample plus the last power held since.

        Holding the last power can run ahead of what the next sample's trapezoid gives (the power fell):
        the answer then stays where it was until the integral passes it, so a difference of two answers
        (a request's share, a Prometheus counter) is never negative. The lead is at most one interval's
        power change, and it is given back, not kept: over a request the error stays within one sample.
        """
        with self._lock:
            value = self._joules
            if self._last is not None:
                last_t, last_w = self._last
                value += last_w * max(0.0, self._clock() - last_t)
            self._floor = max(self._floor, value)
            return self._floor

    def watts(self) -> float | None:
        """The last sample's power (None before the first)."""
        with self._lock:
            return self._last[1] if self._last is not None else None

    def cost_per_sample_us(self) -> float | None:
        with self._lock:
            taken = self.samples + self.missed
            return 1e6 * self.sample_s / taken if taken else None

    # -- the thread --------------------------------------------------------------------------------
    def start(self) -> EnergyMeter:
        """Take the first sample now and keep sampling on a daemon thread; a no-op without a monitor."""
        if not self.available or self._thread is not None:
            return self
        self.sample()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="energy-meter", daemon=True)
        self._thread.start()
        log.info("energy meter: %s sampled every %.0f ms", self.rail, 1000 * self.interval_s)
        return self

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout=2 * self.interval_s + 1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # a sampling fault costs that sample, never the thread
                log.debug("energy meter: sample failed", exc_info=True)


__all__ = ["DEFAULT_INTERVAL_S", "TOTAL_RAILS", "EnergyMeter", "power_sources"]

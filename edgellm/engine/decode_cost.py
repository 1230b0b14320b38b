"""What a generation step costs on this device, by the number of tokens it decodes.

Speculative drafts pay only where verifying them costs less than the steps they save, and that
depends on the device: on this 2-core CPU a decode of 1 token takes ~6 ms, of 2 tokens ~13 ms (the
matmuls leave the one-row path), then ~2.4 ms more per token; on a GPU a few more rows are nearly
free. So the cost is measured, not assumed: a short probe at start (`probe`), then every pure
generation step's decode time (`observe`) keeps the table current as the thread count or the
machine's load changes. `ms(n)` interpolates between measured sizes.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

PROBE_SIZES = (1, 2, 4, 8, 16)
PROBE_REPEATS = 2
MAX_TOKENS = 64  # sizes above this are extrapolated from the largest two measured
EMA = 0.2  # weight of a new observation
# Before any measurement (a probe that failed): the 2-core CPU's figures, a pessimistic guess
# for a GPU (drafts start only once steps show they pay).
DEFAULT_MS = {1: 6.2, 2: 12.8, 4: 17.6, 8: 27.2, 16: 46.4}


class DecodeCost:
    def __init__(self) -> None:
        self._ms: dict[int, float] = dict(DEFAULT_MS)
        self._sizes = sorted(self._ms)  # the measured sizes, kept sorted: ms() runs per draft length per step
        self.measured = False

    def probe(self, decode: Callable[[int], None]) -> dict[int, float]:
        """Time `decode(n)` (a decode of n tokens with logits for every row, the shape of a step that
        verifies drafts) for each probe size; keeps the fastest of PROBE_REPEATS runs."""
        found: dict[int, float] = {}
        for n in PROBE_SIZES:
            best = float("inf")
            for _ in range(PROBE_REPEATS):
                t0 = time.perf_counter()
                decode(n)
                best = min(best, 1000 * (time.perf_counter() - t0))
            found[n] = best
        # A decode of more tokens never costs less: a size that measured dearer than a larger one was
        # slowed by something else (another process on the cores) and takes the larger one's time.
        sizes = sorted(found)
        for lo, hi in zip(reversed(sizes[:-1]), reversed(sizes[1:]), strict=True):
            found[lo] = min(found[lo], found[hi])
        self._take(found)
        return dict(found)

    def restore(self, table: object) -> bool:
        """Take a table an earlier start measured on this device (engine/start_record.py: the same build,
        CPU, model and settings) instead of probing; False, and nothing changed, unless it is one
        ({"n": ms} for every probe size, each a positive finite number)."""
        if not isinstance(table, dict):
            return False
        found: dict[int, float] = {}
        for n in PROBE_SIZES:
            ms = table.get(str(n))
            if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms < 1e6:
                return False
            found[n] = float(ms)
        self._take(found)
        return True

    def _take(self, measured: dict[int, float]) -> None:
        self._ms = measured
        self._sizes = sorted(measured)
        self.measured = True

    def observe(self, n_tokens: int, elapsed_s: float) -> None:
        """One generation step's decode time (steps with prompt chunks or media say nothing about
        the cost of verify rows, and are not passed here)."""
        if not 1 <= n_tokens <= MAX_TOKENS or elapsed_s <= 0:
            return
        ms = 1000 * elapsed_s
        old = self._ms.get(n_tokens)
        self._ms[n_tokens] = ms if old is None else (1 - EMA) * old + EMA * ms
        if old is None:
            self._sizes = sorted(self._ms)

    def ms(self, n: int) -> float:
        """Estimated decode time of n tokens."""
        if n <= 0:
            return 0.0
        known = self._ms.get(n)
        if known is not None:
            return known
        sizes = self._sizes
        i = bisect.bisect_left(sizes, n)  # sizes[i - 1] < n < sizes[i]
        if 0 < i < len(sizes):
            lo, hi = sizes[i - 1], sizes[i]
        elif i >= 2:
            lo, hi = sizes[-2], sizes[-1]  # past the largest: the last slope continues
        elif i == 0:
            return self._ms[sizes[0]] * n / sizes[0]
        else:
            return self._ms[sizes[-1]] * n / sizes[-1]
        slope = (self._ms[hi] - self._ms[lo]) / (hi - lo)
        return max(0.0, self._ms[lo] + slope * (n - lo))

    def table(self) -> dict[str, float]:
        """The current estimates at the probe sizes (for /status and the benchmarks)."""
        return {str(n): round(self.ms(n), 2) for n in PROBE_SIZES}

"""What a benchmark run measured, and how it is shown: percentiles, turns against an in-run baseline and
their ratios, and markdown tables (printed, and recorded in a JSON results file).

A number here is only ever compared with a baseline measured in the same run, on the same machine: a
2-core VM's speed drifts by 15% from one minute to the next, so a figure from another run says little.
Where the two sides cannot run at once they take turns (A-B-A, or A-B-A-B-A ...: `turns`), and each B
turn can be read against the A turns either side of it (`bracket_ratios`).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Literal, TypeVar

__all__ = ["Table", "Turn", "bracket_ratios", "percentile", "ratio", "times", "turns", "write_results"]

T = TypeVar("T")
Method = Literal["rank", "nearest", "linear"]


# -- percentiles ----------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float, method: Method = "rank") -> float | None:
    """The q-quantile (0 <= q <= 1) of `values`, None when there are none.

    Three readings, each kept because a benchmark's published numbers were made with it:
      rank     sorted[int(q * n)]: the value with q of the sample below it (p95 of 20 is the largest);
      nearest  sorted[round(q * (n - 1))]: the value nearest to the q point of the range of ranks;
      linear   interpolated between the two values either side of that point (statistics.quantiles'
               "inclusive" method; q a whole percent from 0.01 to 0.99).
    """
    if not values:
        return None
    ordered = sorted(values)
    last = len(ordered) - 1
    if method == "rank":
        return ordered[min(last, int(q * len(ordered)))]
    if method == "nearest":
        return ordered[min(last, round(q * last))]
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[round(100 * q) - 1]


# -- turns and ratios -----------------------------------------------------------------------------
def ratio(value: float, baseline: float) -> float:
    """value / baseline, NaN when there is no baseline to divide by (a side that did nothing)."""
    return value / baseline if baseline else math.nan


def times(value: float, baseline: float) -> str:
    """The ratio as a benchmark prints it: "1.23x"."""
    return f"{ratio(value, baseline):.2f}x"


@dataclass(frozen=True)
class Turn(Generic[T]):
    number: int  # 1, 2, 3 ... over the whole run
    side: T  # whose turn it is
    round: int  # 0, 1, 2 ...: how many turns this side had before


def turns(sides: Sequence[T], count: int) -> Iterator[Turn[T]]:
    """`count` turns taken by `sides` in order, over and over: A, B, A (count 3), A, B, A, B (count 4),
    A, B, C, A, B, C (count 6 of three sides). Interleaved so that drift on a noisy machine hits every
    side alike; the first side is the baseline."""
    for k in range(count):
        yield Turn(k + 1, sides[k % len(sides)], k // len(sides))


def bracket_ratios(a_turns: Sequence[float], b_turns: Sequence[float]) -> list[float]:
    """Each B turn against the mean of the A turns either side of it (A-B-A-B-A: len(a) = len(b) + 1): a
    machine whose speed drifts over minutes moves both sides of a bracket alike, so these are steadier
    than the ratio of the means. A B turn that measured nothing gives none."""
    return [
        statistics.fmean([a_turns[k], a_turns[k + 1]]) / b for k, b in enumerate(b_turns) if b and k + 1 < len(a_turns)
    ]


# -- tables ---------------------------------------------------------------------------------------
class Table:
    """A markdown table: the one way a benchmark prints what it measured.

    Cells are given already formatted (each benchmark chooses its precision). With `stream`, the header
    is printed at the first row and each row as it is added, so a long run shows its progress as it goes;
    otherwise print() (or str()) gives the whole table at the end.
    """

    def __init__(self, *header: str, stream: bool = False):
        self.header = list(header)
        self.rows: list[list[str]] = []
        self.stream = stream

    def add(self, *cells: object) -> None:
        if len(cells) != len(self.header):
            raise ValueError(f"{len(cells)} cells for {len(self.header)} columns: {cells!r}")
        row = [str(c) for c in cells]
        if self.stream:
            if not self.rows:
                print("\n".join(self._head()), flush=True)
            print(self._line(row), flush=True)
        self.rows.append(row)

    @staticmethod
    def _line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    def _head(self) -> list[str]:
        return [self._line(self.header), "|" + "---|" * len(self.header)]

    def __str__(self) -> str:
        return "\n".join([*self._head(), *(self._line(r) for r in self.rows)])

    def print(self) -> None:
        """The whole table (a streamed one has been printed already)."""
        if not self.stream:
            print(self, flush=True)

    def records(self) -> list[dict[str, str]]:
        """The rows keyed by the header, for a results file."""
        return [dict(zip(self.header, row, strict=True)) for row in self.rows]


def write_results(results: dict, report: str, out: str | None) -> None:
    """Print the report (its tables and notes); with `out`, write the results, the report in them, there as
    JSON."""
    print("\n" + report, flush=True)
    results["table"] = report
    if out:
        Path(out).write_text(json.dumps(results, indent=1, default=str))
        print(f"results: {out}")

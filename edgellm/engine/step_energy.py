"""Energy per answer: each busy step's energy shared among the slots it decoded for.

Where the board has a power monitor (runtime/board/energy.EnergyMeter), the energy since the last charge (the
previous step's decode, while busy without a break: its sampling, this step's admission and decode) is shared
among this step's slots by the tokens each fed: prompt chunks and generated tokens alike (prefix-cache hits are
not fed, so cost nothing), an image or audio chunk by the embeddings it decodes. A finished request's timings
carry its share (engine/final_output.py: energy_j, joules_per_token). Apart from the scheduler: this changes
with how energy is attributed, the step with what is decoded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from edgellm.engine.slot import Slot
from edgellm.engine.step_plan import StepPlan


class StepEnergy:
    """The board's cumulative joules (`meter`: runtime/board/energy.EnergyMeter.joules, set by whoever has a
    power monitor; None: no energy fields) and the reading the current busy stretch was last charged at."""

    def __init__(self) -> None:
        self.meter: Callable[[], float] | None = None
        self._mark: float | None = None  # joules when the current busy stretch was last charged

    def idle(self) -> None:
        """An empty step: what the board draws until the next busy one is no request's."""
        self._mark = None

    def busy(self) -> None:
        """A step decodes: a busy stretch starts here unless one is under way."""
        if self.meter is not None and self._mark is None:
            self._mark = self.meter()

    def charge(self, plan: StepPlan, slots: list[Slot]) -> None:
        """The energy since the last charge shared among the step's slots (energy_shares: a Counter over the
        step's seq_ids, counted in C, then one addition per slot; no Python loop per token)."""
        if self.meter is None:
            return
        now = self.meter()
        spent, self._mark = now - self._mark, now
        for seq_id, joules in energy_shares(spent, plan).items():
            slots[seq_id].energy_j += joules


def energy_shares(spent: float, plan: StepPlan) -> dict[int, float]:
    """`spent` joules shared among a step's sequences by the tokens each fed (its seq_ids entries, plus
    the embeddings of a media chunk decoded in it); {} when nothing was spent or fed."""
    fed = Counter(plan.seq_ids)
    if plan.media is not None:
        slot, span = plan.media
        fed[slot.seq_id] += span.n_tokens
    total = sum(fed.values())
    if spent <= 0 or total <= 0:
        return {}
    return {seq_id: spent * n / total for seq_id, n in fed.items()}

"""A request between its arrival and its slot: the prompt being prepared off the step loop.

Apart from slot.py so that samples.py (n > 1 requests share one PreparedRequest) needs nothing of
the slot: the scheduler hands a sample group the live slots it asks about.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from edgellm.engine.guide_llguidance import Guide
from edgellm.engine.projector import MediaSpan
from edgellm.engine.types import EngineRequest


@dataclass
class Prompt:
    """A prepared prompt: token ids, where media chunks sit as runs of negative stand-ins."""

    tokens: list[int]
    media: list[MediaSpan] = field(default_factory=list)
    thinking_open: bool = False  # the prompt ends inside a reasoning block (engine/thinking.py)


@dataclass
class PreparedRequest:
    """A request waiting for a slot; `future` (prompt, a compiled guide per sample) resolves off the step loop."""

    request: EngineRequest
    future: Future[tuple[Prompt, list[Guide | None]]]
    queued_at: float = field(default_factory=time.monotonic)
    prompt: list[int] = field(default_factory=list)  # set from the future at admission
    media: list[MediaSpan] = field(default_factory=list)
    thinking_open: bool = False

    @property
    def ready(self) -> bool:
        return self.future.done()

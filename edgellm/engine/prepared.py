"""A request between its arrival and its slot: the prompt being prepared off the step loop.

Apart from slot.py so that samples.py (n > 1 requests share one PreparedRequest) needs nothing of
the slot: the scheduler hands a sample group the live slots it asks about.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from edgellm.engine.guide_matcher import Guide
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
    deadline_checked: bool = False  # its deadline_ms was weighed against the work ahead (engine/deadline.py)

    @property
    def ready(self) -> bool:
        return self.future.done()


class PrepareExecutor(ThreadPoolExecutor):
    """The prepare pool, telling `wake()` (when set) each time a job ends.

    The engine worker sleeps on its pipe while the only work left is being prepared; with `wake` it
    is woken the moment a prompt is ready instead of at its next poll (which cost up to 5 ms of
    every request's time to first token). `wake` runs on the pool's thread: it must be quick.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str):
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self.wake: Callable[[], None] | None = None

    def submit(self, fn, /, *args, **kwargs) -> Future:  # type: ignore[override]
        future = super().submit(fn, *args, **kwargs)
        future.add_done_callback(self._done)
        return future

    def _done(self, _future: Future) -> None:
        wake = self.wake
        if wake is not None:
            wake()

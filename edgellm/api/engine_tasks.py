"""Engine tasks that take no slot and keep no record: embeddings, tokenize, detokenize, render.

A task is sent to the engine like a request and counted against max_queued like one, but never
registered: its final output resolves a future here and the answer is all there is of it. Apart from
the Service's requests (registered, stored, answered through api/answers.py) because a task has
none of that: no record, no waiter state, no stream, only a future and a caller that may hang up.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from edgellm.api.request_state import RequestTable
from edgellm.engine.interface import EngineClient
from edgellm.engine.types import EngineOutput, EngineRequest, FinishReason
from edgellm.errors import Cancelled, WaitTimeout, error_from

TASK_WATCH_S = 0.5  # how often a waiting engine task (an embedding request) looks whether its caller is gone


class EngineTasks:
    """The engine tasks in flight, each a future its final output resolves (on the event loop)."""

    def __init__(self, requests: RequestTable) -> None:
        self.requests = requests
        self.futures: dict[str, asyncio.Future] = {}

    def take(self, outs: list[EngineOutput], post: Callable[[Callable[[Any], None], Any], None]) -> list[EngineOutput]:
        """The outputs that are not tasks'; each task's final output is `post`ed to resolve its future."""
        if not self.futures:
            return outs
        for out in [o for o in outs if o.finished and o.request_id in self.futures]:
            post(self._resolve, out)
        return [o for o in outs if o.request_id not in self.futures]

    def _resolve(self, out: EngineOutput) -> None:
        fut = self.futures.get(out.request_id)
        if fut is not None and not fut.done():
            fut.set_result(out)

    async def run(
        self,
        engine: EngineClient,
        request: EngineRequest,
        timeout_s: float,
        disconnected: Callable[[], Awaitable[bool]] | None,
        *,
        admit: Callable[[], None],
        abort: Callable[[str], None],
    ) -> EngineOutput:
        """Send `request` (an EngineTask other than generation) and return its final output; its error,
        when it failed, as the EdgeLLMError its type stands for. `admit`: the max_queued check, made with
        the request table's lock held; `abort`: the engine's, for a task past its time or whose caller left."""
        key = f"task-{uuid.uuid4().hex}"
        request.request_id = key
        request.deadline = time.time() + timeout_s
        fut = asyncio.get_running_loop().create_future()
        try:
            with self.requests.registering_one(admit):
                self.futures[key] = fut
                await asyncio.to_thread(engine.submit, request)
            out = await self._answer(key, fut, timeout_s + 5.0, disconnected, abort)
            if out is None:
                abort(key)
                raise WaitTimeout(f"the {request.task} request did not finish within {timeout_s:g} s") from None
        finally:
            self.futures.pop(key, None)
        if out.finish_reason is FinishReason.TIMEOUT:
            raise WaitTimeout(f"the {request.task} request did not finish within {timeout_s:g} s")
        if out.error is not None:
            raise error_from(out.error_type, out.error)
        return out

    async def _answer(
        self,
        key: str,
        fut: asyncio.Future[EngineOutput],
        wait_s: float,
        disconnected: Callable[[], Awaitable[bool]] | None,
        abort: Callable[[str], None],
    ) -> EngineOutput | None:
        """The task's final output; None after `wait_s`. Looks at the caller every TASK_WATCH_S: one that
        hung up has the task aborted (the engine frees it at its next step) and gets Cancelled."""
        give_up = time.monotonic() + wait_s
        while (left := give_up - time.monotonic()) > 0:
            done, _ = await asyncio.wait({fut}, timeout=min(left, TASK_WATCH_S) if disconnected else left)
            if done:
                return fut.result()
            if disconnected is not None and await disconnected():
                abort(key)
                raise Cancelled(f"the {key} task's caller disconnected")
        return None

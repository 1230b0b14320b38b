"""How `edgellm batch-run` sends: the `Transport` protocol run_batch drives, and the HTTP one (a thread
pool over http_client.Sender). The local one, on the in-process engine, is batch/local.py."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Protocol

from edgellm.batch.http_client import Sender

if TYPE_CHECKING:
    from edgellm.batch.inputs import BatchOptions


Deliver = Callable[[int, dict[str, Any]], None]  # (index in the batch, its result line)


class Transport(Protocol):
    """Turns the pending requests of a batch into result lines; run_batch does everything else."""

    def run(self, todo: list[tuple[int, dict[str, Any]]], deliver: Deliver) -> None:
        """Calls deliver(index, line) once per request, as each finishes (any order), in this thread.

        An exception out of here (a bug, deliver failing on a full disk, Ctrl-C) stops the run."""
        ...

    def close(self, *, abandon: bool) -> None:
        """Release what run() used; `abandon`: the run stopped, do not wait for work in flight."""
        ...


class HttpTransport:
    """POSTs to the endpoint from a pool of `concurrency` threads, with Sender's retries."""

    def __init__(self, opts: BatchOptions):
        self.sender = Sender(opts)
        self.pool = ThreadPoolExecutor(max_workers=max(1, opts.concurrency), thread_name_prefix="batch")

    def run(self, todo: list[tuple[int, dict[str, Any]]], deliver: Deliver) -> None:
        futures: dict[Future, int] = {self.pool.submit(self.sender.send, req): i for i, req in todo}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            bug = next((f.exception() for f in done if f.exception() is not None), None)
            for fut in done:
                if fut.exception() is None:  # every good result of this round is delivered before a bug stops the run
                    deliver(futures[fut], fut.result())
            if bug is not None:
                raise bug

    def close(self, *, abandon: bool) -> None:
        if abandon:
            self.pool.shutdown(wait=False, cancel_futures=True)
        else:
            self.pool.shutdown(wait=True)

"""Requests that arrive while the plugin rebuilds its app (a pipeline update that changes the engine).

Pure Python (no naeural_core). Each request gets a future at once (the plugin polls it as a postponed
request, so the node's loop never blocks); when the new app is up, `release(runner)` hands every held
request to it in arrival order and chains each reply into its future. A request that comes after the
release goes straight to the new app, so none falls between the two.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

from extensions.business.edgellm.asgi_bridge import AsgiAppRunner, HttpReply, HttpRequest


class HeldRequests:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[tuple[HttpRequest, concurrent.futures.Future[HttpReply]]] = []
        self._runner: AsgiAppRunner | None = None  # set by release(): the app to send to from then on
        self._refused: Callable[[HttpRequest], HttpReply] | None = None  # set by refuse(): the reply for each

    def hold(self, request: HttpRequest) -> concurrent.futures.Future[HttpReply]:
        with self._lock:
            if self._refused is not None:
                done: concurrent.futures.Future[HttpReply] = concurrent.futures.Future()
                done.set_result(self._refused(request))
                return done
            if self._runner is None:
                future: concurrent.futures.Future[HttpReply] = concurrent.futures.Future()
                self._held.append((request, future))
                return future
            runner = self._runner
        return runner.submit(request)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def release(self, runner: AsgiAppRunner) -> int:
        """Send what was held to `runner` (and everything from now on); returns how many were held."""
        with self._lock:
            held, self._held, self._runner = self._held, [], runner
        for request, future in held:
            _chain(runner.submit(request), future)
        return len(held)

    def refuse(self, error_reply) -> int:
        """No app to send to (the rebuild failed before one started): answer each held request with
        `error_reply(exc, request)`; later ones too."""
        why = RuntimeError("the engine restart for a config update failed; see the node log")

        def reply(request: HttpRequest) -> HttpReply:
            return error_reply(why, request)

        with self._lock:
            held, self._held, self._refused = self._held, [], reply
        for request, future in held:
            future.set_result(reply(request))
        return len(held)


def _chain(source: concurrent.futures.Future[HttpReply], target: concurrent.futures.Future[HttpReply]) -> None:
    # AsgiAppRunner.submit()'s futures always end with a reply (an error reply included), never an exception.
    source.add_done_callback(lambda done: target.set_result(done.result()))

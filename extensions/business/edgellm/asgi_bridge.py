"""Run an ASGI app (edgellm's FastAPI app) on an event loop thread of its own, and feed it HTTP
requests handed over from another thread (the Ratio1 plugin's loop), one reply per request.

Pure Python (no naeural_core). The node's uvicorn forwards every request verbatim (method, path,
query, headers, body, client) to the plugin; the plugin calls `AsgiAppRunner.submit()` and polls the
returned future from its own loop (a postponed request), so the plugin thread never blocks.

The app's lifespan runs through the ASGI lifespan protocol: startup before the first request is
served, shutdown on `stop()`. A response is buffered whole (the node's IPC carries one reply per
request), so an SSE stream arrives at once when it ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]

# Marks a reply built here, so the node side (main.py) can tell it from the framework's own answers.
REPLY_MARK = "__edgellm_http__"


@dataclass
class HttpRequest:
    method: str
    path: str
    query: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None

    @classmethod
    def from_wire(cls, method: str, path: str, query: str, headers: list, body: str, client: Any) -> HttpRequest:
        """The arguments main.py sends: the body as a latin-1 string (bytes survive it exactly)."""
        return cls(
            method=str(method).upper(),
            path=str(path) or "/",
            query=str(query or ""),
            headers=[(str(k), str(v)) for k, v in (headers or [])],
            body=(body or "").encode("latin-1"),
            client=(str(client[0]), int(client[1])) if client else None,
        )


@dataclass
class HttpReply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def to_wire(self) -> dict[str, Any]:
        """What the plugin returns through the node's IPC (pickled); main.py turns it back into a Response."""
        return {
            REPLY_MARK: True,
            "status": self.status,
            "headers": [[k, v] for k, v in self.headers],
            "body": self.body.decode("latin-1"),
        }


class LifespanFailed(RuntimeError):
    pass


class AsgiAppRunner:
    """Owns the event loop thread, the app's lifespan and the calls into the app.

    `error_reply` builds the reply for a request the app cannot take (its startup failed or the
    runner is stopping) as `error_reply(exc, request)`; the caller supplies it so the body has the
    app's own error shape (see `edgellm_error_reply`).
    """

    def __init__(
        self,
        app_factory: Callable[[], ASGIApp],
        *,
        server: tuple[str, int] = ("127.0.0.1", 0),
        error_reply: Callable[[Exception, HttpRequest], HttpReply],
        name: str = "edgellm-asgi",
    ):
        self._factory = app_factory
        self._server = server
        self._error_reply = error_reply
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=name, daemon=True)
        self._app: ASGIApp | None = None
        self._started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._shutdown: asyncio.Event | None = None
        self._lifespan_done: asyncio.Event | None = None
        self._stopping = False
        self._pending: dict[concurrent.futures.Future[HttpReply], HttpRequest] = {}
        self._pending_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop thread and the app's lifespan startup (returns at once; see `started`)."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._startup(), self._loop)

    @property
    def started(self) -> concurrent.futures.Future[None]:
        """Done when the app's startup completed (or failed: then it holds the exception)."""
        return self._started

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _startup(self) -> None:
        self._shutdown = asyncio.Event()
        self._lifespan_done = asyncio.Event()
        started = self._loop.create_future()
        try:
            self._app = self._factory()
        except Exception as exc:  # the app could not be built (bad settings, unreadable state dir)
            self._started.set_exception(exc)
            self._lifespan_done.set()
            return
        sent_startup = False

        async def receive() -> dict:
            nonlocal sent_startup
            if not sent_startup:
                sent_startup = True
                return {"type": "lifespan.startup"}
            await self._shutdown.wait()
            return {"type": "lifespan.shutdown"}

        async def send(message: dict) -> None:
            kind = message["type"]
            if kind == "lifespan.startup.complete" and not started.done():
                started.set_result(None)
            elif kind == "lifespan.startup.failed" and not started.done():
                started.set_exception(LifespanFailed(message.get("message") or "startup failed"))
            elif kind in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                if kind.endswith("failed"):
                    log.error("ASGI app shutdown failed: %s", message.get("message"))
                self._lifespan_done.set()

        async def lifespan() -> None:
            scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
            try:
                await self._app(scope, receive, send)
            except Exception as exc:
                if not started.done():
                    started.set_exception(exc)
                log.exception("ASGI app lifespan raised")
            finally:
                self._lifespan_done.set()

        self._loop.create_task(lifespan())
        try:
            await started
        except Exception as exc:
            self._started.set_exception(exc)
        else:
            self._started.set_result(None)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Run the app's shutdown (in-flight requests end first as the app decides), then end the loop."""
        if not self._thread.is_alive():
            return
        self._stopping = True

        async def _shutdown() -> None:
            if self._shutdown is not None:
                self._shutdown.set()
            if self._lifespan_done is not None:
                await self._lifespan_done.wait()

        try:
            asyncio.run_coroutine_threadsafe(_shutdown(), self._loop).result(timeout_s)
        except Exception as exc:  # a timeout or a failing shutdown: the loop still ends
            log.error("ASGI app shutdown did not complete: %r", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        with self._pending_lock:  # what the app left unanswered gets the stopping reply, not silence
            left, self._pending = self._pending, {}
        for future, request in left.items():
            future.set_result(self._error_reply(RuntimeError("the plugin is stopping"), request))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
        """Run `fn(app)` on the loop thread (where the app's state lives), once the app has started."""

        async def _run() -> Any:
            await asyncio.wrap_future(self._started)
            return fn(self._app)

        return asyncio.run_coroutine_threadsafe(_run(), self._loop)

    # -- requests --------------------------------------------------------------------------
    def submit(self, request: HttpRequest) -> concurrent.futures.Future[HttpReply]:
        """Hand a request to the app; the future resolves with its whole reply (never with an exception)."""
        if self._stopping or not self._thread.is_alive():
            done: concurrent.futures.Future[HttpReply] = concurrent.futures.Future()
            done.set_result(self._error_reply(RuntimeError("the plugin is stopping"), request))
            return done
        inner = asyncio.run_coroutine_threadsafe(self._call(request), self._loop)
        # Its own future, so that stop() can answer a request the app did not finish (its loop ends).
        outer: concurrent.futures.Future[HttpReply] = concurrent.futures.Future()
        with self._pending_lock:
            self._pending[outer] = request

        def settle(done: concurrent.futures.Future[HttpReply]) -> None:
            with self._pending_lock:
                if self._pending.pop(outer, None) is None:
                    return  # stop() answered it already
            try:
                outer.set_result(done.result())
            except Exception as exc:  # cancelled with the loop: still one reply
                outer.set_result(self._error_reply(exc, request))

        inner.add_done_callback(settle)
        return outer

    async def _call(self, request: HttpRequest) -> HttpReply:
        try:
            await asyncio.wrap_future(self._started)
        except Exception as exc:
            return self._error_reply(exc, request)
        try:
            return await self._call_app(request)
        except Exception as exc:  # the app raised past its own error handlers (it should not)
            log.exception("ASGI app failed on %s %s", request.method, request.path)
            return self._error_reply(exc, request)

    async def _call_app(self, request: HttpRequest) -> HttpReply:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.path.encode("utf-8", "surrogateescape"),
            "query_string": request.query.encode("latin-1", "replace"),
            "root_path": "",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
            "client": request.client,
            "server": self._server,
            "state": {},
        }
        status = 500
        headers: list[tuple[str, str]] = []
        chunks: list[bytes] = []
        body_sent = False
        closing = self._shutdown

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            # The node's uvicorn owns the client connection; this side learns of nothing but shutdown.
            if closing is not None:
                await closing.wait()
            else:
                await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            nonlocal status, headers
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self._app(scope, receive, send)
        return HttpReply(status, headers, b"".join(chunks))


def edgellm_error_reply(exc: Exception, path: str, mode: Any, node: Any) -> HttpReply:
    """A request the edgellm app could not take, answered in edgellm's own shapes: the node envelope
    (WRAPPED/RAW, `mode`) on the seed routes, OpenAI's error object under /v1/. A client-side error
    keeps its status; anything else (startup failed, bad config, stopping) is a 503."""
    from edgellm.api.dialects.openai_chat import error_body
    from edgellm.api.envelope import ResponseMode, envelope
    from edgellm.errors import EdgeLLMError, EngineUnavailable

    if not (isinstance(exc, EdgeLLMError) and exc.http_status < 500):
        message = exc.message if isinstance(exc, EdgeLLMError) else str(exc) or type(exc).__name__
        exc = EngineUnavailable(f"the inference API is not available: {message}")
    if path.startswith("/v1/"):
        body = error_body(exc)
    else:
        body = envelope(exc.to_body(), ResponseMode(str(getattr(mode, "value", mode))), node)
    headers = [("content-type", "application/json"), *((k.lower(), v) for k, v in exc.headers.items())]
    return HttpReply(exc.http_status, headers, json.dumps(body).encode())

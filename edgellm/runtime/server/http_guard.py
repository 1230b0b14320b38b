"""The HTTP boundary, before any route runs (pure ASGI middleware + a uvicorn protocol).

What it refuses, and why:
- a Host that is not this loopback node's (DNS rebinding: a web page whose name resolves to
  127.0.0.1 would otherwise read our answers) -> 421;
- a POST/PUT/PATCH body that is not `application/json` (a browser sends text/plain, form and
  multipart bodies cross-origin without a CORS preflight; JSON needs one, granted only to the
  origins in `cors_origins`, none by default: runtime/server/cors.py) -> 415;
- a declared or streamed body over `max_body_bytes` -> 413, reading stops there;
- a body that does not arrive within `body_timeout_s` -> 408; headers that do not arrive within
  `header_timeout_s` -> 408 and the connection closes (slowloris).
On SIGTERM (`Drain`), requests that have not started their answer by the end of the grace
period get a JSON 503 naming their request id, instead of uvicorn's bare text 500.
CORS headers are sent only to the origins listed in `cors_origins` (runtime/server/cors.py, outside this
guard so its refusals carry them too); by default none: the node is not meant to be called from web
pages. `CountResponses`, outermost, counts every response by route template and status code.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.routing import Match
from uvicorn.protocols.http.h11_impl import H11Protocol

from edgellm.errors import (
    EdgeLLMError,
    EngineUnavailable,
    MisdirectedRequest,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
)
from edgellm.wire import body_too_large

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
# Renders an error for a path: the seed routes wrap it in the node envelope, /v1 uses OpenAI's shape.
ErrorResponder = Callable[[str, EdgeLLMError], ASGIApp]

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
LOOPBACK_NAMES = frozenset({"localhost"})
EXCHANGE_KEY = "edgellm.exchange"


@dataclass(frozen=True)
class GuardConfig:
    max_body_bytes: int
    body_timeout_s: float
    loopback_only: bool  # bound to a loopback address: only loopback Host values (and allowed_hosts)
    allowed_hosts: tuple[str, ...] = ()


@dataclass
class Exchange:
    """What the guard knows about one request, shared with the route through the scope."""

    body_pending: bool
    deadline: float
    received: int = 0
    started: bool = False  # the response has begun: it can no longer be replaced
    request_id: str | None = None


def remember_request_id(scope: Scope, request_id: str) -> None:
    """Routes call this once a request is registered, so a shutdown 503 can name it."""
    exchange = scope.get(EXCHANGE_KEY)
    if isinstance(exchange, Exchange):
        exchange.request_id = request_id


class Drain:
    """The shutdown grace period: when it ends, requests still waiting are answered 503."""

    def __init__(self) -> None:
        self.expired = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: set[asyncio.Task] = set()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def start(self, grace_s: float) -> None:
        """Called from the SIGTERM handler; thread- and signal-safe."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.call_later, grace_s, self.expire)

    def expire(self) -> None:
        self.expired = True
        for task in list(self._waiting):
            task.cancel("shutdown grace period over")

    def add(self, task: asyncio.Task) -> None:
        self._waiting.add(task)

    def discard(self, task: asyncio.Task | None) -> None:
        self._waiting.discard(task)


def host_allowed(host_header: str | None, allowed: Iterable[str]) -> bool:
    """Loopback names/addresses with any port, or an allow-listed name ("*" allows any)."""
    if host_header is None:  # HTTP/1.0 without Host: no browser sends that, so no rebinding risk
        return True
    host = host_header.strip().lower()
    if host.startswith("["):  # [v6]:port
        name, _, rest = host[1:].partition("]")
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return False
    else:
        name, _, port = host.partition(":")
        if port and not port.isdigit():
            return False
    allowed = {a.strip().lower() for a in allowed}
    if "*" in allowed or name in allowed or host in allowed or name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_json_media_type(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"


class HttpGuard:
    """Pure ASGI middleware (no BaseHTTPMiddleware: that would buffer streaming responses)."""

    def __init__(self, app: ASGIApp, *, config: GuardConfig, drain: Drain, error_response: ErrorResponder):
        self.app = app
        self.config = config
        self.drain = drain
        self.error_response = error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        declared = headers.get("content-length")
        exchange = Exchange(
            body_pending=bool(declared and declared != "0") or "transfer-encoding" in headers,
            deadline=asyncio.get_running_loop().time() + self.config.body_timeout_s,
        )
        scope[EXCHANGE_KEY] = exchange

        async def guarded_receive() -> Message:
            if not exchange.body_pending:
                return await receive()
            remaining = exchange.deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(remaining, 0.001))
            except asyncio.TimeoutError:  # builtin TimeoutError only from 3.11
                raise RequestTimeout(
                    f"the request body did not arrive within {self.config.body_timeout_s:g} s"
                ) from None
            if message["type"] == "http.request":
                exchange.received += len(message.get("body", b""))
                if exchange.received > self.config.max_body_bytes:
                    raise PayloadTooLarge(
                        f"request body is larger than the limit of {self.config.max_body_bytes} bytes"
                    )
                exchange.body_pending = bool(message.get("more_body", False))
            else:  # http.disconnect
                exchange.body_pending = False
            return message

        task = asyncio.current_task()

        async def guarded_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.started = True
                self.drain.discard(task)
                if exchange.body_pending:
                    # Unread body bytes would be taken for the next request: end the connection.
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await self.error_response(scope["path"], refusal)(scope, guarded_receive, guarded_send)
            return
        if self.drain.expired:
            await self._shutdown_response(scope, guarded_receive, guarded_send, exchange)
            return
        self.drain.add(task)
        try:
            await self.app(scope, guarded_receive, guarded_send)
        except asyncio.CancelledError:
            # Our own cancellation at the end of the grace period (not uvicorn's, which comes later
            # and finds the response started): answer instead of letting uvicorn send a text 500.
            if not self.drain.expired or exchange.started or task is None:
                raise
            if hasattr(task, "uncancel"):  # 3.11+ counts cancellations; 3.10 forgets one once it is caught
                task.uncancel()
            await self._shutdown_response(scope, guarded_receive, guarded_send, exchange)
        finally:
            self.drain.discard(task)

    async def _shutdown_response(self, scope: Scope, receive: Receive, send: Send, exchange: Exchange) -> None:
        rid = exchange.request_id
        # A synchronous request is not run again after the restart (service.recover fails it: its caller
        # is gone), so the answer says so instead of sending the caller to poll for a result.
        exc = EngineUnavailable(
            "the node is shutting down before this request finished; it will not be run again (its record "
            "reads failed after the restart): submit it again once the node is back",
            request_id=rid,
        )
        await self.error_response(scope["path"], exc)(scope, receive, send)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> EdgeLLMError | None:
        if self.config.loopback_only and not host_allowed(headers.get("host"), self.config.allowed_hosts):
            return MisdirectedRequest(
                "this node answers only to a loopback Host (localhost, 127.0.0.1, [::1]); add the name to "
                "allowed_hosts (EDGELLM_ALLOWED_HOSTS) to serve it"
            )
        if scope["method"] in BODY_METHODS and not is_json_media_type(headers.get("content-type")):
            return UnsupportedMediaType("request body must be sent with 'Content-Type: application/json'")
        declared = headers.get("content-length")
        if declared and declared.isdigit():
            return body_too_large(int(declared), self.config.max_body_bytes)
        return None


OTHER_ROUTE = "other"  # the route label of a path no route serves: label cardinality stays bounded


def route_template(routes: Iterable[Any], scope: Scope) -> str:
    """The path template of the route that serves this path ("/console/assets/{name}"), whatever the
    method (a 405 or a preflight counts under its route too), else OTHER_ROUTE."""
    for route in routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            return getattr(route, "path", None) or OTHER_ROUTE
    return OTHER_ROUTE


class CountResponses:
    """Pure ASGI middleware, outermost: each HTTP response counted as `count(route, status code)`.

    `routes`: the app's route list (read at each request: routes added after this is built count).
    A request that ends with no response started counts as 500 (the server error middleware answers
    it), or 499 when the client went away first.
    """

    def __init__(self, app: ASGIApp, *, routes: Iterable[Any], count: Callable[[str, int], None]):
        self.app = app
        self.routes = routes
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_template(self.routes, scope)
        status: int | None = None

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except asyncio.CancelledError:
            status = status or 499
            raise
        except BaseException:
            status = status or 500
            raise
        finally:
            self.count(route, status or 500)


def _headers(scope: Scope) -> dict[str, str]:
    # latin-1 is how ASGI header bytes map to str losslessly; a repeated header keeps its last value.
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


@dataclass
class _Timer:
    handle: asyncio.TimerHandle | None = field(default=None)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers.

    uvicorn times out idle keep-alive connections but not a connection that has started a request
    and trickles its headers (slowloris): each would hold a socket forever. The deadline starts
    when the connection opens and again when a response completes (the next request's headers).
    """

    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer = _Timer()
        super().connection_made(transport)
        self._arm_header_timer()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a new request's headers are complete: its body has its own deadline
            self._header_timer.cancel()

    def on_response_complete(self) -> None:
        self._arm_header_timer()  # before super(): it may parse a pipelined request and disarm it
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._header_timer.cancel()
        self._header_timer.handle = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _headers_timed_out(self) -> None:
        self._header_timer.handle = None
        if self.transport.is_closing():
            return
        body = json.dumps(
            RequestTimeout(f"request headers did not arrive within {self.header_timeout_s:g} s").to_body()
        ).encode()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        self.transport.close()


def h11_protocol(header_timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with this header deadline."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": header_timeout_s})

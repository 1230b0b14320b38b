"""The service object every adapter calls: submit / wait / request_status / health / status / metrics.

It validates, authenticates and registers each request (SQLite first, then the engine), and turns
engine outputs into stored results. It is framework-agnostic: FastAPI and the naeural plugin both
call it and map `EdgeLLMError` to a response with one function.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from edgellm.api.auth import Authenticator
from edgellm.api.registry import Registry, RequestRecord, RequestStatus
from edgellm.api.results import build_result, status_of
from edgellm.api.validation import ChatRequest, parse_chat_request
from edgellm.engine.guide_llguidance import grammar_for
from edgellm.engine.interface import EngineClient
from edgellm.engine.types import EngineOutput, EngineRequest
from edgellm.errors import (
    EdgeLLMError,
    EngineError,
    EngineUnavailable,
    GenerationFailed,
    InvalidRequest,
    QueueFull,
    UnknownRequest,
    WaitTimeout,
)

log = logging.getLogger(__name__)

_ERROR_CLASSES: dict[str, type[EdgeLLMError]] = {
    "invalid_request": InvalidRequest,
    "invalid_guide": InvalidRequest,
    "rate_limited": QueueFull,
    "generation_failed": GenerationFailed,
}


@dataclass(frozen=True)
class ServiceConfig:
    model_name: str
    default_timeout_s: float = 600.0
    max_timeout_s: float = 3600.0
    max_queued: int = 64


class Service:
    def __init__(self, config: ServiceConfig, registry: Registry, auth: Authenticator):
        self.config = config
        self.registry = registry
        self.auth = auth
        self.engine: EngineClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: dict[str, list[asyncio.Future]] = {}
        self._streams: dict[str, asyncio.Queue] = {}
        self._active: set[str] = set()
        self._lock = threading.Lock()
        self.started_at = time.time()
        self.draining = False  # set on shutdown: no new work, in-flight work finishes or stays pending
        self.counters = {"submitted": 0, "completed": 0, "failed": 0, "timeout": 0, "rejected": 0}
        self.latency_ms: list[float] = []  # last 1000 completed requests

    # -- wiring ------------------------------------------------------------------------------
    def bind(self, engine: EngineClient, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self._loop = engine, loop

    def recover(self) -> int:
        """After a restart: re-dispatch pending async requests; fail pending sync ones (caller is gone)."""
        n = 0
        for rec in self.registry.pending():
            if rec.mode != "async":
                self.registry.finish(
                    rec.request_id,
                    RequestStatus.FAILED,
                    None,
                    "the node restarted before this synchronous request finished",
                    "engine_error",
                )
                continue
            self.registry.bump_attempts(rec.request_id)
            request = ChatRequest.from_params(rec.params, rec.metadata)
            self._dispatch(rec.request_id, request, rec.seed, stream=False, created_at=rec.created_at)
            n += 1
        if n:
            log.info("re-dispatched %d pending async request(s) after restart", n)
        return n

    @property
    def model_name(self) -> str:
        return self.config.model_name

    # -- submit ------------------------------------------------------------------------------
    def parse(self, body: Any) -> ChatRequest:
        request = parse_chat_request(
            body, default_timeout=self.config.default_timeout_s, max_timeout=self.config.max_timeout_s
        )
        self.check_engine_limits(request)
        return request

    def check_engine_limits(self, request: ChatRequest) -> None:
        """What only the engine knows: the guide compiles (cached), bias token ids are in the vocabulary.

        A bad schema/regex/grammar is a 400 now, not a failure mid-run.
        """
        if request.guide is not None:
            grammar_for(request.guide)
        n_vocab = (self.engine.info or {}).get("n_vocab") if self.engine else None
        if n_vocab and request.logit_bias:
            bad = [t for t in request.logit_bias if t >= n_vocab]
            if bad:
                raise InvalidRequest(
                    f"logit_bias token id {bad[0]} is outside the vocabulary [0, {n_vocab - 1}]", param="logit_bias"
                )

    def submit(self, request: ChatRequest, *, mode: str, stream: bool = False) -> str:
        """Register and dispatch; returns the request id. Raises 429/503/400 errors."""
        self._require_engine()
        with self._lock:
            if len(self._active) >= self.config.max_queued:
                self.counters["rejected"] += 1
                raise QueueFull(
                    f"too many requests in flight ({self.config.max_queued}); retry shortly", retry_after_s=2
                )
            request_id = request.request_id or uuid.uuid4().hex
            self._active.add(request_id)
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        try:
            if not self.registry.insert(request_id, mode, request.params_dict(), request.metadata, seed):
                raise InvalidRequest(f"request_id {request_id!r} already exists", param="request_id")
        except BaseException:
            with self._lock:
                self._active.discard(request_id)
            raise
        self.counters["submitted"] += 1
        self._dispatch(request_id, request, seed, stream=stream, created_at=time.time())
        return request_id

    def _dispatch(self, request_id: str, request: ChatRequest, seed: int, *, stream: bool, created_at: float) -> None:
        with self._lock:
            self._active.add(request_id)
        if stream and self._loop is not None:
            self._streams[request_id] = asyncio.Queue()
        self.engine.submit(
            EngineRequest(
                request_id=request_id,
                messages=request.messages,
                sampling=request.sampling(seed),
                guide=request.guide,
                deadline=created_at + request.timeout,
                stream=stream,
            )
        )

    def _require_engine(self) -> None:
        if self.draining:
            raise EngineUnavailable("the node is shutting down; retry when it is back")
        health = self.engine.health() if self.engine is not None else {"state": "starting"}
        # While the worker restarts, requests queue and are sent once it is back; otherwise 503.
        if health["state"] not in ("ready", "restarting"):
            reason = f": {health['last_error']}" if health.get("last_error") else ""
            raise EngineUnavailable(f"engine is {health['state']}{reason}")

    def abort(self, request_id: str) -> None:
        if self.engine is not None:
            self.engine.abort(request_id)

    # -- engine outputs (called from the engine's reader thread) --------------------------------
    def on_engine_output(self, out: EngineOutput) -> None:
        if not out.finished:
            self._post(self._push_delta, out)
            return
        status, error, error_type = status_of(out)
        result = build_result(out.request_id, self.model_name, out)
        try:
            self.registry.finish(out.request_id, status, result, error, error_type)
        except EdgeLLMError:
            log.exception("could not store the result of request %s", out.request_id)
        with self._lock:
            self._active.discard(out.request_id)
        self.counters[status.value if status.value in self.counters else "failed"] += 1
        if status is RequestStatus.COMPLETED and "ttft_ms" in out.timings:
            self.latency_ms = [*self.latency_ms[-999:], out.timings.get("ttft_ms", 0) + out.timings.get("decode_ms", 0)]
        self._post(self._resolve, out)

    def _post(self, fn, out: EngineOutput) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, out)

    def _resolve(self, out: EngineOutput) -> None:
        for fut in self._waiters.pop(out.request_id, []):
            if not fut.done():
                fut.set_result(out)
        if out.request_id in self._streams:
            self._streams[out.request_id].put_nowait(out)

    def _push_delta(self, out: EngineOutput) -> None:
        queue = self._streams.get(out.request_id)
        if queue is not None:
            queue.put_nowait(out)

    # -- waiting -----------------------------------------------------------------------------
    async def wait(self, request_id: str, timeout_s: float) -> dict[str, Any]:
        """Block until the request ends; its result, or the error it ended with."""
        rec = self.registry.get(request_id)
        if rec is None:
            raise UnknownRequest(f"unknown request_id {request_id!r}", request_id=request_id)
        if rec.status is RequestStatus.PENDING:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(request_id, []).append(fut)
            try:
                # A little grace past the engine's own deadline, which normally ends the request first.
                await asyncio.wait_for(asyncio.shield(fut), timeout_s + 5.0)
            except TimeoutError:
                raise WaitTimeout(
                    f"request {request_id} did not finish within {timeout_s:g} s; poll "
                    f"/request_status?request_id={request_id}",
                    request_id=request_id,
                ) from None
            finally:
                waiters = self._waiters.get(request_id, [])
                if fut in waiters:
                    waiters.remove(fut)
            rec = self.registry.get(request_id)
        return self.result_or_raise(rec)

    def result_or_raise(self, rec: RequestRecord) -> dict[str, Any]:
        if rec.status is RequestStatus.COMPLETED:
            return rec.result
        if rec.status is RequestStatus.TIMEOUT:
            raise WaitTimeout(f"request {rec.request_id} timed out: {rec.error}", request_id=rec.request_id)
        cls = _ERROR_CLASSES.get(rec.error_type or "", EngineError)
        raise cls(rec.error or "request failed", request_id=rec.request_id)

    async def stream(self, request_id: str) -> AsyncIterator[EngineOutput]:
        """Deltas, then the final output, of a request submitted with stream=True."""
        queue = self._streams[request_id]
        try:
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    return
        finally:
            self._streams.pop(request_id, None)

    # -- queries -----------------------------------------------------------------------------
    def request_status(self, request_id: str, *, return_full: bool) -> dict[str, Any]:
        rec = self.registry.get(request_id)
        if rec is None:
            raise UnknownRequest(
                f"unknown request_id {request_id!r} (never submitted, or expired)", request_id=request_id
            )
        body: dict[str, Any] = {"request_id": rec.request_id, "status": rec.status.value}
        if rec.status is RequestStatus.COMPLETED:
            body["result"] = rec.result
        elif rec.status.is_finished:
            body["error"] = rec.error
            body["error_type"] = rec.error_type
        if return_full:
            body.update(
                {
                    "mode": rec.mode,
                    "params": rec.params,
                    "seed": rec.seed,
                    "metadata": rec.metadata,
                    "attempts": rec.attempts,
                    "created_at": rec.created_at,
                    "finished_at": rec.finished_at,
                    "expires_at": rec.expires_at,
                }
            )
            if rec.result is not None:
                body["result"] = rec.result
        return body

    def health(self) -> tuple[bool, dict[str, Any]]:
        engine = self.engine.health() if self.engine else {"state": "starting"}
        info = self.engine.info if self.engine else {}
        ready = engine.get("state") == "ready"
        return ready, {
            "status": "ok" if ready else engine.get("state", "starting"),
            "model": self.model_name,
            "engine": engine,
            "offload": info.get("offload"),
        }

    def status(self) -> dict[str, Any]:
        ready, health = self.health()
        info = self.engine.info if self.engine else {}
        return {
            **health,
            "uptime_s": round(time.time() - self.started_at, 1),
            "engine_info": info,
            "load": {
                k: v
                for k, v in (self.engine.stats if self.engine else {}).items()
                if k in ("slots_total", "slots_busy", "waiting")
            },
            "in_flight": len(self._active),
            "max_queued": self.config.max_queued,
            "registry": self.registry.counts(),
            "auth_required": self.auth.required,
        }

    def metrics(self) -> dict[str, Any]:
        lat = sorted(self.latency_ms)

        def pct(p: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))], 1) if lat else None

        return {
            "requests": dict(self.counters),
            "in_flight": len(self._active),
            "latency_ms": {"p50": pct(0.5), "p95": pct(0.95), "count": len(lat)},
            "engine": self.engine.stats if self.engine else {},
            "engine_restarts": (self.engine.health().get("restarts", 0) if self.engine else 0),
        }

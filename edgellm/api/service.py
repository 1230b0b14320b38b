"""The service object every adapter calls: submit / wait / request_status / health / status / metrics.

It validates, authenticates and registers each request (SQLite first, then the engine), and turns
engine outputs into stored results. It is framework-agnostic: FastAPI and the naeural plugin both
call it and map `EdgeLLMError` to a response with one function.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from edgellm.api.auth import Authenticator
from edgellm.api.metrics import ServiceMetrics, live_state
from edgellm.api.openai_compat import OpenAIOptions, parse_openai_request
from edgellm.api.output_processor import OutputProcessor, RequestOutput
from edgellm.api.registry import Registry, RegistryFull, RequestRecord, RequestStatus
from edgellm.api.results import build_result, status_of
from edgellm.api.validation import (
    MAX_COMPLETION_TOKENS,
    MAX_MESSAGES,
    MAX_PROMPT_BYTES,
    MIN_COMPLETION_TOKENS,
    TEMPERATURE_MAX,
    TEMPERATURE_MIN,
    ChatRequest,
    parse_chat_request,
)
from edgellm.engine.guide_llguidance import grammar_for
from edgellm.engine.interface import EngineClient
from edgellm.engine.types import EngineOutput, EngineRequest
from edgellm.errors import (
    ContextLengthExceeded,
    EdgeLLMError,
    EngineError,
    EngineUnavailable,
    GenerationFailed,
    InvalidRequest,
    QueueFull,
    UnknownRequest,
    WaitTimeout,
)
from edgellm.media.limits import MediaLimits, MediaSources
from edgellm.media.loading import load_content
from edgellm.media.types import MediaCaps

log = logging.getLogger(__name__)

_ERROR_CLASSES: dict[str, type[EdgeLLMError]] = {
    "invalid_request": InvalidRequest,
    "invalid_guide": InvalidRequest,
    "context_length_exceeded": ContextLengthExceeded,
    "rate_limited": QueueFull,
    "generation_failed": GenerationFailed,
}


class BoardSource(Protocol):
    def read(self) -> dict[str, Any]: ...

    def samples(self) -> list[tuple[str, str, dict[str, str], float]]: ...


@dataclass(frozen=True)
class ServiceConfig:
    model_name: str
    default_timeout_s: float = 600.0
    max_timeout_s: float = 3600.0
    max_queued: int = 64
    max_messages: int = MAX_MESSAGES
    max_prompt_bytes: int = MAX_PROMPT_BYTES
    temperature_min: float = TEMPERATURE_MIN
    temperature_max: float = TEMPERATURE_MAX
    min_completion_tokens: int = MIN_COMPLETION_TOKENS  # the seed endpoints' floor; OpenAI's is 1
    max_completion_tokens: int = MAX_COMPLETION_TOKENS
    media_sources: MediaSources = MediaSources()  # where image/audio references may point
    media_limits: MediaLimits = MediaLimits()

    def limits(self) -> dict[str, Any]:
        """The keyword arguments of parse_chat_request / parse_openai_request for this node."""
        return {
            "default_timeout": self.default_timeout_s,
            "max_timeout": self.max_timeout_s,
            "max_messages": self.max_messages,
            "max_prompt_bytes": self.max_prompt_bytes,
            "min_temperature": self.temperature_min,
            "max_temperature": self.temperature_max,
            "min_max_tokens": self.min_completion_tokens,
            "max_max_tokens": self.max_completion_tokens,
        }


@dataclass(frozen=True)
class Outcome:
    """How a request ended, as delivered by the engine or read back from the registry."""

    request_id: str
    status: RequestStatus
    result: dict[str, Any] | None
    error: str | None
    error_type: str | None

    @classmethod
    def of_record(cls, rec: RequestRecord) -> Outcome:
        return cls(rec.request_id, rec.status, rec.result, rec.error, rec.error_type)

    def result_or_raise(self) -> dict[str, Any]:
        if self.status is RequestStatus.COMPLETED:
            return self.result
        if self.status is RequestStatus.TIMEOUT:
            raise WaitTimeout(f"request {self.request_id} timed out: {self.error}", request_id=self.request_id)
        cls = _ERROR_CLASSES.get(self.error_type or "", EngineError)
        raise cls(self.error or "request failed", request_id=self.request_id)


def outcome_of(out: RequestOutput, model_name: str) -> Outcome:
    """How a final engine output ends its request: the stored result (seed 003 shape) or the error."""
    status, error, error_type = status_of(out)
    result = build_result(out.request_id, model_name, out) if status is RequestStatus.COMPLETED else None
    return Outcome(out.request_id, status, result, error, error_type)


def check_vocabulary(request: ChatRequest, n_vocab: int | None) -> None:
    """logit_bias token ids must be in the model's vocabulary (when it is known): a 400, not a failure mid-run."""
    if n_vocab and request.logit_bias:
        bad = [t for t in request.logit_bias if t >= n_vocab]
        if bad:
            raise InvalidRequest(
                f"logit_bias token id {bad[0]} is outside the vocabulary [0, {n_vocab - 1}]", param="logit_bias"
            )


def parse_openai_now(body: Any, config: ServiceConfig, n_vocab: int | None) -> tuple[ChatRequest, OpenAIOptions]:
    """`Service.parse_openai` without a service or an event loop (`edgellm batch-run --local`): the same
    rules in the same order (body, then the guide compiles, then the vocabulary), the same errors."""
    request, opts = parse_openai_request(body, config.model_name, **config.limits())
    if request.guide is not None:
        grammar_for(request.guide)
    check_vocabulary(request, n_vocab)
    return request, opts


def load_media(request: ChatRequest, config: ServiceConfig, caps: MediaCaps | None) -> ChatRequest:
    """Fetch and decode the request's images/audio (blocking I/O and decoding: run it off the event loop).
    Raises MediaError (400/413) for anything wrong with them."""
    if request.has_media:
        messages, media = load_content(request.messages, caps, config.media_sources, config.media_limits)
        request.with_media(messages, media)
    return request


def engine_request(
    request_id: str, request: ChatRequest, seed: int, *, created_at: float, stream: bool = False
) -> EngineRequest:
    """What the engine is sent for a validated request; its deadline counts from `created_at`."""
    messages, media = request.engine_messages()
    return EngineRequest(
        request_id=request_id,
        messages=messages,
        media=media,
        sampling=request.sampling(seed),
        guide=request.guide,
        deadline=created_at + request.timeout,
        stream=stream,
        speculative=not request.disable_spec_decode,
        cut_structure_ok=request.cut_structure_ok,
        n=request.n,
    )


FINISH_WRITE_RETRIES = (0.05, 0.2, 0.5)  # seconds between attempts to store a result


class Service:
    """Registers, dispatches and answers requests.

    What is in flight has one book of record: the registry says what is pending (and, by boot id,
    what a restart must recover), the engine client (supervisor) owns delivery and retries, and the
    service keeps only the waiters of this process's callers.
    """

    def __init__(self, config: ServiceConfig, registry: Registry, auth: Authenticator):
        self.config = config
        self.registry = registry
        self.auth = auth
        self.engine: EngineClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: dict[str, asyncio.Future[Outcome]] = {}
        self._streams: dict[str, asyncio.Queue] = {}
        self._registering = 0  # accepted, being written to the registry, not yet with the engine
        self._unsaved: dict[str, Outcome] = {}  # finished, but the registry could not be written
        self.outputs = OutputProcessor()  # engine byte deltas -> text, stop strings, stream deltas
        self._lock = threading.Lock()
        self.started_at = time.time()
        self.draining = False  # set on shutdown: no new work, in-flight work finishes or stays pending
        # Prometheus counters and histograms in a registry of this service's own (api/metrics.py);
        # the gauges are read at scrape time. /metrics (JSON and Prometheus text) comes from here.
        self.instruments = ServiceMetrics(
            live=lambda: {
                **live_state(self.engine, self.in_flight(), self.config.max_queued),
                "board": self.board.samples() if self.board is not None else [],
            }
        )
        # Board telemetry (runtime/board.py on a Jetson): read() -> dict for /status, samples() ->
        # (name, help, labels, value) gauges for /metrics. None: nothing to report.
        self.board: BoardSource | None = None
        self.memory_plan: dict[str, Any] | None = None  # the engine's memory plan, for /status

    # -- wiring ------------------------------------------------------------------------------
    def bind(self, engine: EngineClient, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self._loop = engine, loop

    def recover(self) -> int:
        """At start, before the engine admits anything: the pending rows of earlier boots.

        Async ones are handed to the engine client (it sends them first once the worker is ready);
        sync ones fail, their caller is gone. Rows of this boot are never touched, so requests that
        arrive while this runs cannot be failed or dispatched twice.
        """
        n = 0
        for rec in self.registry.pending_from_earlier_boots():
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
            try:
                load_media(request, self.config, None)  # from the stored sources, as at submission
            except EdgeLLMError as exc:
                self.registry.finish(rec.request_id, RequestStatus.FAILED, None, exc.message, exc.error_type)
                continue
            self._dispatch(rec.request_id, request, rec.seed, stream=False, created_at=rec.created_at)
            n += 1
        if n:
            log.info("re-dispatching %d pending async request(s) from before the restart", n)
        return n

    @property
    def model_name(self) -> str:
        return self.config.model_name

    # -- submit ------------------------------------------------------------------------------
    async def parse(self, body: Any) -> ChatRequest:
        """A seed-endpoint body -> a validated request, with the node's prompt caps and engine limits."""
        request = parse_chat_request(body, **self.config.limits())
        await self.check_engine_limits(request)
        return await self._load_media(request)

    async def parse_openai(self, body: Any) -> tuple[ChatRequest, OpenAIOptions]:
        """An OpenAI chat-completions body -> a validated request and the response options."""
        request, opts = parse_openai_request(body, self.model_name, **self.config.limits())
        await self.check_engine_limits(request)
        return await self._load_media(request), opts

    async def _load_media(self, request: ChatRequest) -> ChatRequest:
        if not request.has_media:
            return request
        self._refuse_when_full()  # before decoding: pixels are memory
        return await asyncio.to_thread(load_media, request, self.config, self.media_caps())

    def _refuse_when_full(self) -> None:
        """429 when max_queued requests are in flight (counted as rejected)."""
        if self.in_flight() >= self.config.max_queued:
            self.instruments.count("rejected")
            raise QueueFull(f"too many requests in flight ({self.config.max_queued}); retry shortly", retry_after_s=2)

    def media_info(self) -> dict[str, Any]:
        """What the engine's projector takes ({} while the engine has not reported)."""
        return (self.engine.info or {}).get("media") or {} if self.engine else {}

    def media_caps(self) -> MediaCaps | None:
        info = self.media_info()
        return MediaCaps.from_dict(info) if info else None

    async def check_engine_limits(self, request: ChatRequest) -> None:
        """What only the engine knows: the guide compiles (cached), bias token ids are in the vocabulary.

        A bad schema/regex/grammar is a 400 now, not a failure mid-run. The first check of a new
        guide can take a few hundred ms, so it runs off the event loop.
        """
        if request.guide is not None:
            await asyncio.to_thread(grammar_for, request.guide)
        check_vocabulary(request, (self.engine.info or {}).get("n_vocab") if self.engine else None)

    def in_flight(self) -> int:
        return (self.engine.in_flight() if self.engine is not None else 0) + self._registering

    async def submit(self, request: ChatRequest, *, mode: str, stream: bool = False, owner: str | None = None) -> str:
        """Register (durably, off the event loop), then dispatch; returns the request id.

        Raises 429 (too much in flight), 503 (engine not ready), 400 (duplicate id), 507 (disk full).
        """
        self._require_engine()
        if self._unsaved:
            raise RegistryFull(
                f"{len(self._unsaved)} finished result(s) could not be written to the request registry (disk "
                "full?); new requests are refused until they are stored"
            )
        with self._lock:
            self._refuse_when_full()
            self._registering += 1
        try:
            request_id = request.request_id or uuid.uuid4().hex
            seed = request.seed if request.seed is not None else secrets.randbits(64)
            inserted = await asyncio.to_thread(
                self.registry.insert, request_id, mode, request.params_dict(), request.metadata, seed, owner=owner
            )
            if not inserted:
                raise InvalidRequest(f"request_id {request_id!r} already exists", param="request_id")
            self.instruments.count("submitted")
            if mode == "sync":
                self._waiters[request_id] = asyncio.get_running_loop().create_future()
            if stream:
                self._streams[request_id] = asyncio.Queue()
            # The pipe send can block while the worker is mid-step: keep it off the event loop.
            await asyncio.to_thread(self._dispatch, request_id, request, seed, stream=stream, created_at=time.time())
        finally:
            with self._lock:
                self._registering -= 1
        return request_id

    def _dispatch(self, request_id: str, request: ChatRequest, seed: int, *, stream: bool, created_at: float) -> None:
        self.outputs.add_request(request_id, request.stop)
        self.engine.submit(engine_request(request_id, request, seed, created_at=created_at, stream=stream))

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
    def on_engine_outputs(self, outs: list[EngineOutput]) -> None:
        """One engine message: deltas go to their streams; finals are stored in one transaction, then
        their waiters are resolved with the delivered outcome (no re-read of SQLite)."""
        finals: list[Outcome] = []
        processed = [self.outputs.process(out) for out in outs]
        for out in processed:
            if not out.finished:
                self._post(self._push_delta, out)
                continue
            outcome = outcome_of(out, self.model_name)
            finals.append(outcome)
            self.instruments.finished(
                outcome.status.value,
                prompt_tokens=out.prompt_tokens,
                completion_tokens=out.completion_tokens,
                timings=out.timings,
            )
        if finals:
            self._store(finals)
        for out in processed:
            if out.finished:
                self._post(self._push_delta, out)
        for outcome in finals:
            self._post(self._resolve, outcome)

    def _store(self, finals: list[Outcome]) -> None:
        """Write results, retrying briefly; what cannot be written (disk full) is kept in memory and
        answered from there, and written by `flush_unsaved()` once space is back."""
        rows = [(o.request_id, o.status, o.result, o.error, o.error_type) for o in finals]
        for delay in (*FINISH_WRITE_RETRIES, None):
            try:
                self.registry.finish_many(rows)
                return
            except EdgeLLMError as exc:
                if delay is None:
                    log.error("could not store %d result(s), keeping them in memory: %s", len(rows), exc.message)
                    with self._lock:
                        self._unsaved.update({o.request_id: o for o in finals})
                    return
                time.sleep(delay)

    def flush_unsaved(self) -> int:
        """Write results kept in memory while the registry was full; returns how many were written."""
        with self._lock:
            pending = list(self._unsaved.values())
        if not pending:
            return 0
        try:
            self.registry.finish_many([(o.request_id, o.status, o.result, o.error, o.error_type) for o in pending])
        except EdgeLLMError:
            return 0
        with self._lock:
            for o in pending:
                self._unsaved.pop(o.request_id, None)
        log.info("stored %d result(s) kept in memory while the registry was full", len(pending))
        return len(pending)

    def _post(self, fn, arg) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, arg)

    def _resolve(self, outcome: Outcome) -> None:
        fut = self._waiters.get(outcome.request_id)
        if fut is not None and not fut.done():
            fut.set_result(outcome)

    def _push_delta(self, out: RequestOutput) -> None:
        queue = self._streams.get(out.request_id)
        if queue is not None:
            queue.put_nowait(out)

    # -- waiting -----------------------------------------------------------------------------
    async def wait(self, request_id: str, timeout_s: float) -> dict[str, Any]:
        """Block until a request submitted by this process (mode sync) ends; its result or its error."""
        fut = self._waiters.get(request_id)
        if fut is None:
            raise UnknownRequest(f"request {request_id!r} has no waiter in this process", request_id=request_id)
        try:
            # A little grace past the engine's own deadline, which normally ends the request first.
            outcome = await asyncio.wait_for(asyncio.shield(fut), timeout_s + 5.0)
        except asyncio.TimeoutError:  # builtin TimeoutError only from 3.11
            raise WaitTimeout(
                f"request {request_id} did not finish within {timeout_s:g} s; poll "
                f"/request_status?request_id={request_id}",
                request_id=request_id,
            ) from None
        finally:
            self._waiters.pop(request_id, None)
        return outcome.result_or_raise()

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
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
            self._waiters.pop(request_id, None)

    # -- queries -----------------------------------------------------------------------------
    async def request_status(self, request_id: str, *, return_full: bool, owner: str | None = None) -> dict[str, Any]:
        """A record as its owner sees it; another token's request is as unknown as a missing one."""
        rec = await asyncio.to_thread(self.registry.get, request_id)
        if rec is None or (rec.owner is not None and rec.owner != owner):
            raise UnknownRequest(
                f"unknown request_id {request_id!r} (never submitted, or expired)", request_id=request_id
            )
        unsaved = self._unsaved.get(request_id)
        if unsaved is not None and rec.status is RequestStatus.PENDING:
            rec = dataclasses.replace(
                rec, status=unsaved.status, result=unsaved.result, error=unsaved.error, error_type=unsaved.error_type
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

    async def live_check(self) -> bool:
        """The watchdog's question: is the engine up (or restarting) and the registry readable?

        Awaited on the event loop, so a wedged loop fails it by never answering.
        """
        if self.engine is None or self.engine.health().get("state") not in ("ready", "restarting"):
            return False
        try:
            await asyncio.to_thread(self.registry.counts)
        except EdgeLLMError as exc:
            log.error("watchdog: the request registry is not readable: %s", exc.message)
            return False
        return True

    def health(self) -> tuple[bool, dict[str, Any]]:
        engine = self.engine.health() if self.engine else {"state": "starting"}
        info = self.engine.info if self.engine else {}
        ready = engine.get("state") == "ready"
        return ready, {
            "status": "ok" if ready else engine.get("state", "starting"),
            "model": self.model_name,
            "engine": engine,
            "offload": info.get("offload"),
            "media": info.get("media"),
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
                if k in ("slots_total", "slots_busy", "waiting", "n_threads", "thread_switches")
            },
            "in_flight": self.in_flight(),
            "max_queued": self.config.max_queued,
            "registry": {
                **self.registry.counts(),
                "unsaved_results": len(self._unsaved),
                "reset_reason": self.registry.reset_reason,
            },
            "auth_required": self.auth.required,
            **({"memory_plan": self.memory_plan} if self.memory_plan else {}),
            **({"board": board} if (board := self.board.read() if self.board is not None else {}) else {}),
        }

    def metrics(self) -> dict[str, Any]:
        """The JSON view of the Prometheus instruments (p50/p95 are histogram-bucket estimates)."""
        return self.instruments.as_dict()

"""The service object every adapter calls: submit / wait / request_status / health / status / metrics.

It validates, authenticates and registers each request (SQLite first, then the engine), and turns
engine outputs into stored results. It is framework-agnostic: FastAPI and the naeural plugin both
call it and map `EdgeLLMError` to a response with one function. A request's live state (text
assembly, waiter or stream, an outcome not yet stored, its delivery) is its RequestState in
`self.requests` (api/request_state.py); the registry is its durable record.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from edgellm.api import model_routes
from edgellm.api.auth import Authenticator
from edgellm.api.dialects.openai_chat import OpenAIOptions, parse_openai_request
from edgellm.api.guide_pool import request_checks, shared_pool
from edgellm.api.lanes import Pause, lanes_body, paused_lanes, thermal_refusal
from edgellm.api.metrics import ServiceMetrics, live_state
from edgellm.api.output_processor import OutputProcessor
from edgellm.api.registry import Registry, RegistryFull, RequestRecord, RequestStatus
from edgellm.api.request_ids import public_id, request_key
from edgellm.api.request_state import RequestTable
from edgellm.api.results import Outcome, outcome_of
from edgellm.api.submission import (
    ServiceConfig,
    check_vocabulary,
    engine_request,
    load_media,
    parse_openai_now,
)
from edgellm.api.text_state import RequestOutput
from edgellm.api.validation import ChatRequest, parse_chat_request
from edgellm.engine.chat_format import ChatFormat
from edgellm.engine.info import EngineInfo
from edgellm.engine.interface import EngineClient, EngineHealth, EngineState
from edgellm.engine.types import EngineOutput, EngineRequest, EngineTask, FinishReason, Priority
from edgellm.errors import (
    Cancelled,
    EdgeLLMError,
    EngineUnavailable,
    ErrorType,
    InvalidRequest,
    QueueFull,
    UnknownRequest,
    WaitTimeout,
    error_from,
)
from edgellm.media.types import MediaCaps

log = logging.getLogger(__name__)

# Re-exported: adapters and `batch-run --local` import them from here (submission.py holds them).
__all__ = [
    "Outcome",
    "Service",
    "ServiceConfig",
    "check_vocabulary",
    "engine_request",
    "load_media",
    "outcome_of",
    "parse_openai_now",
]


class BoardSource(Protocol):
    def read(self) -> dict[str, Any]: ...

    def samples(self) -> list[tuple[str, str, dict[str, str], float]]: ...

    def health(self) -> dict[str, Any]: ...  # nvpmodel mode and the throttling flag, for /health


class EnergySource(Protocol):
    """The board's cumulative input energy (runtime/energy.EnergyMeter), for /metrics."""

    rail: str

    def joules(self) -> float: ...


class AdmissionGate(Protocol):
    """What may refuse new work for a reason of the host's (runtime/board/memory_pressure.py: memory is short)."""

    def refusal(self) -> EdgeLLMError | None: ...

    def state(self) -> dict[str, Any]: ...

    def samples(self) -> list[tuple[str, str, dict[str, str], float]]: ...


class Delegator(Protocol):
    """Request balancing (fleet/balancer.py): may hand a registered request to a peer node instead of
    this node's engine, and adds where each request ran to its result."""

    def delegate(self, key: str, request: ChatRequest, seed: int, mode: str) -> bool: ...

    def result_fields(self, key: str) -> dict[str, Any]: ...

    def state(self) -> dict[str, Any]: ...


FINISH_WRITE_RETRIES = (0.05, 0.2, 0.5)  # seconds between attempts to store a result
# The engine's load as /status shows it (engine/info.py EngineLoad, StepStats).
STATUS_LOAD = (
    "slots_total",
    "slots_busy",
    "waiting",
    "n_threads",
    "thread_switches",
    "paused",
    "preemptions",
    "embedding_jobs",
    "embedded_inputs",
)
TASK_WATCH_S = 0.5  # how often a waiting engine task (an embedding request) looks whether its caller is gone


class Service:
    """Registers, dispatches and answers requests.

    Two places hold a request, each for its own purpose: the registry is the durable record (what is
    pending, by boot id what a restart must recover, how each request ended), and `self.requests`
    holds one RequestState per live request of this process, which the service, the output processor
    and the engine client (its deliveries and retries) all read.
    """

    def __init__(self, config: ServiceConfig, registry: Registry, auth: Authenticator):
        self.config = config
        self.registry = registry
        self.auth = auth
        self.engine: EngineClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.requests = RequestTable()  # one RequestState per live request of this process
        self.requests.on_retry = registry.bump_attempts  # a delivery's attempts, kept durably
        self.guides = shared_pool()  # guide compiles and checks, off the event loop, under a budget
        self.outputs = OutputProcessor(self.requests)  # engine byte deltas -> text, stop strings, stream deltas
        self.started_at = time.time()
        self.draining = False  # set on shutdown: no new work, in-flight work finishes or stays pending
        # Prometheus counters and histograms in a registry of this service's own (api/metrics.py);
        # the gauges are read at scrape time. /metrics (JSON and Prometheus text) comes from here.
        self.instruments = ServiceMetrics(
            live=lambda: {
                **live_state(self.engine, self.in_flight(), self.config.max_queued),
                "board": self.board.samples() if self.board is not None else [],
                "memory_pressure": self.pressure.samples() if self.pressure is not None else [],
                **({"energy_joules": self.energy.joules()} if self.energy is not None else {}),
            }
        )
        # The board's input energy since start (None: no power monitor, no energy series at all).
        self.energy: EnergySource | None = None
        # Board telemetry (runtime/board/telemetry.py on a Jetson): read() -> dict for /status, samples() ->
        # (name, help, labels, value) gauges for /metrics. None: nothing to report.
        self.board: BoardSource | None = None
        self.memory_plan: dict[str, Any] | None = None  # the engine's memory plan, for /status
        # Refuses new work (503 + Retry-After) while the host is short of memory; its state is in /health.
        self.pressure: AdmissionGate | None = None
        # Engine tasks that take no slot and keep no record (embeddings, tokenizer, template): their
        # final output resolves the future (run_task), nothing else reads it.
        self._tasks: dict[str, asyncio.Future] = {}
        self._outputs_lock = threading.RLock()  # on_engine_outputs: one reader thread a model
        self._models: dict[str, str] = {}  # request key -> the model it named (not the default), until its end
        # Request balancing between nodes (fleet/balancer.py), set by a Ratio1 plugin in a balancing group.
        self.delegator: Delegator | None = None

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
                    ErrorType.ENGINE_ERROR,
                )
                continue
            self.registry.bump_attempts(rec.request_id)
            request = ChatRequest.from_params(rec.params, rec.metadata)
            if request.model is not None and all(r.id != request.model for r in self.config.routes()):
                self.registry.finish(
                    rec.request_id,
                    RequestStatus.FAILED,
                    None,
                    f"the node no longer serves model {request.model!r}",
                    ErrorType.MODEL_NOT_FOUND,
                )
                continue
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
    async def parse(
        self, body: Any, disconnected: Callable[[], Awaitable[bool]] | None = None, *, owner: str | None = None
    ) -> ChatRequest:
        """A seed-endpoint body -> a validated request, with the node's prompt caps and engine limits.
        `disconnected`: the client's state, for dropping a guide check nobody waits for; `owner`: the
        caller, whose token's lane the request runs in (api/auth.py)."""
        request = parse_chat_request(body, **self.config.limits())
        request = model_routes.route(request, self.config.routes(), strict=False)
        await self.check_engine_limits(request, disconnected)
        return await self._load_media(self._in_lane(request, owner))

    async def parse_openai(
        self, body: Any, disconnected: Callable[[], Awaitable[bool]] | None = None, *, owner: str | None = None
    ) -> tuple[ChatRequest, OpenAIOptions]:
        """An OpenAI chat-completions body -> a validated request and the response options."""
        request, opts = parse_openai_request(body, self.config.model_ids(), **self.config.limits())
        request = model_routes.route(request, self.config.routes(), strict=True)
        await self.check_engine_limits(request, disconnected)
        return await self._load_media(self._in_lane(request, owner)), opts

    def _in_lane(self, request: ChatRequest, owner: str | None) -> ChatRequest:
        """The request in the lane its caller may have: the one it asked for, never above its token's."""
        return request.model_copy(update={"priority": self.auth.lane(owner, request.priority)})

    async def _load_media(self, request: ChatRequest) -> ChatRequest:
        if not request.has_media:
            return request
        self._refuse_when_full()  # before decoding: pixels are memory
        self._refuse_under_pressure(Priority(request.priority or Priority.INTERACTIVE))  # a paused lane's too
        return await asyncio.to_thread(load_media, request, self.config, self.media_caps())

    def _refuse_when_full(self) -> None:
        """429 when max_queued requests are in flight (counted as rejected). Called with the table's lock
        held where the check and the count that follows must be one step."""
        if self.in_flight() >= self.config.max_queued:
            self.instruments.count("rejected")
            raise QueueFull(f"too many requests in flight ({self.config.max_queued}); retry shortly", retry_after_s=2)

    def media_info(self) -> dict[str, Any]:
        """What the engine's projector takes ({} while the engine has not reported)."""
        info = self._active_info()
        return info.media if info is not None else {}

    def media_caps(self) -> MediaCaps | None:
        info = self.media_info()
        return MediaCaps.from_dict(info) if info else None

    async def check_engine_limits(
        self, request: ChatRequest, disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> None:
        """What only the engine knows: the guides compile and can be completed, bias token ids are in the
        vocabulary. A bad schema/regex/grammar (the request's own or a tool's) is a 400 now, not a failure
        mid-run.

        The guides are checked after the body's own checks and after admission (a full node refuses
        before compiling anything), in the guide pool's child processes under the request's CPU and
        memory budget (api/guide_pool.py), and the check is dropped when `disconnected()` says the client
        is gone: a hostile schema holds neither the event loop nor the API's memory.
        """
        checks = request_checks(request)
        if checks:
            self._refuse_when_full()
            await self.guides.check(checks, disconnected)
        check_vocabulary(request, self._n_vocab(request.model))

    def check_engine_limits_now(self, request: ChatRequest) -> None:
        """check_engine_limits, blocking (a thread's caller: a peer's delegated request, fleet/balancer.py)."""
        self.guides.check_now(request_checks(request))
        check_vocabulary(request, self._n_vocab(request.model))

    def _n_vocab(self, model: str | None) -> int | None:
        info = self.engine_info(model)
        return info.n_vocab if info is not None else None

    def named_model(self, body: Any) -> str | None:
        """The non-default model a raw body's `model` names (None: the default, or an id it does not serve,
        which its parser then refuses): whose limits a route checks before the request is parsed."""
        name = body.get("model") if isinstance(body, dict) else None
        return name if isinstance(name, str) and any(r.id == name for r in self.config.routes()[1:]) else None

    def model_states(self) -> list[dict[str, Any]] | None:
        """Each model's state (loaded, loading, unloaded, failed) when the node serves several; else None."""
        return self.engine.model_states() if self.engine is not None else None

    def engine_info(self, model: str | None = None) -> EngineInfo | None:
        """The EngineInfo of `model` (None: the default), as of its last load; None before it ever loaded
        (its limits are then checked by the engine when it runs the request)."""
        return self.engine.model_info(model) if self.engine is not None else None

    def _active_info(self) -> EngineInfo | None:
        """The EngineInfo of the model now active (with several models, not always the default's)."""
        return self.engine.info if self.engine is not None else None

    def engine_health(self) -> EngineHealth:
        return self.engine.health() if self.engine is not None else EngineHealth.starting()

    def in_flight(self) -> int:
        return (self.engine.in_flight() if self.engine is not None else 0) + self.requests.registering

    async def submit(self, request: ChatRequest, *, mode: str, stream: bool = False, owner: str | None = None) -> str:
        """Register (durably, off the event loop), then dispatch; returns the request id.

        The returned key is what `wait`, `stream` and `abort` take; `public_id(key)` is the id the
        caller sees. A caller's own `request_id` is unique for its owner only (request_state.request_key):
        another token's use of the same id neither blocks it nor shows through a "duplicate" answer.

        Raises 429 (too much in flight), 503 (engine not ready), 400 (duplicate id), 507 (disk full).
        """
        # Its token's lane at most (api/auth.py), stored with it (a restart re-admits it in the same lane).
        request = self._in_lane(request, owner)
        self._require_engine(lane=Priority(request.priority))
        if unsaved := len(self.requests.unsaved()):
            raise RegistryFull(
                f"{unsaved} finished result(s) could not be written to the request registry (disk "
                "full?); new requests are refused until they are stored"
            )
        with self.requests.registering_one(self._refuse_when_full):  # max_queued holds under races
            key = request_key(request.request_id, owner) if request.request_id else uuid.uuid4().hex
            seed = request.seed if request.seed is not None else secrets.randbits(64)
            inserted = await asyncio.to_thread(
                self.registry.insert, key, mode, request.params_dict(), request.metadata, seed, owner=owner
            )
            if not inserted:
                raise InvalidRequest(f"request_id {request.request_id!r} already exists", param="request_id")
            self.instruments.count("submitted")
            state = self.requests.open(key)
            if mode == "sync":
                state.waiter = asyncio.get_running_loop().create_future()
            if stream:
                state.stream = asyncio.Queue()
            # The pipe send can block while the worker is mid-step: keep it off the event loop.
            await asyncio.to_thread(self._hand_over, key, request, seed, mode=mode, stream=stream)
        return key

    def _hand_over(self, key: str, request: ChatRequest, seed: int, *, mode: str, stream: bool) -> None:
        """To this node's engine, or (a balancing group, the local queue past its limit) to a peer."""
        # A request with a deadline_ms stays here: a peer would count it from its own arrival.
        if not stream and self.delegator is not None and request.deadline_ms is None:
            try:
                if self.delegator.delegate(key, request, seed, mode):
                    return
            except Exception:  # balancing is an option: a fault in it must not cost this request
                log.exception("request balancing failed for %s; running it here", key)
                self.registry.set_delegation(key, None)
        self._dispatch(key, request, seed, stream=stream, created_at=time.time())

    # -- request balancing (fleet/balancer.py calls these from its own thread) --------------------
    def accept_delegated(
        self, key: str, request: ChatRequest, seed: int, delegation: dict[str, Any], *, owner: str | None = None
    ) -> bool:
        """Run a request a peer node delegated here, as an async request under `key` (its delegation id);
        False when that key was already taken (a replayed envelope: it never runs twice). Raises what
        submit would (engine not ready, 429 when max_queued are in flight). `owner`: who may read its record
        (the balancer's "fleet:<origin>", which no token hashes to: this node's callers cannot)."""
        self._require_engine(lane=Priority(request.priority or Priority.INTERACTIVE))
        with self.requests.registering_one(self._refuse_when_full):
            if not self.registry.insert(
                key, "async", request.params_dict(), request.metadata, seed, owner=owner, delegation=delegation
            ):
                return False
            self.instruments.count("submitted")
            self.requests.open(key)
            self._dispatch(key, request, seed, stream=False, created_at=time.time())
        return True

    def run_locally(self, key: str) -> bool:
        """Run a request this node had delegated (its peer is gone) on this node's engine, from its
        record; False when it has finished meanwhile."""
        rec = self.registry.get(key)
        if rec is None or rec.status.is_finished:
            return False
        self.registry.bump_attempts(key)
        request = ChatRequest.from_params(rec.params, rec.metadata)
        self.requests.open(key)
        self._dispatch(key, request, rec.seed, stream=False, created_at=rec.created_at)
        return True

    def finish_delegated(
        self, key: str, status: RequestStatus, result: dict | None, error: str | None, error_type: str | None
    ) -> bool:
        """A delegated request's end, as its peer reported it (or as the balancer decided): stored and
        answered like an engine's final output. False when the record had finished already."""
        rec = self.registry.get(key)
        if rec is None or rec.status.is_finished:
            return False
        outcome = Outcome(key, status, result, error, error_type)
        self.instruments.finished(status.value)  # its tokens were generated, and are counted, on the peer
        self._store([outcome])
        self._post(self._resolve_and_settle, outcome)
        return True

    def _resolve_and_settle(self, outcome: Outcome) -> None:
        self._resolve(outcome)
        self.requests.settle(outcome.request_id)  # an async one: nothing waits on it here

    def slots_total(self) -> int:
        stats = self.engine.stats if self.engine is not None else None
        if stats is not None and stats.load.slots_total:
            return stats.load.slots_total
        info = self.engine_info()
        return info.n_slots if info is not None and info.n_slots else 1

    def _dispatch(self, request_id: str, request: ChatRequest, seed: int, *, stream: bool, created_at: float) -> None:
        def build() -> EngineRequest:
            # Built when it is sent: with several models, once its model is loaded, so its prompt is
            # rendered with that model's chat format.
            sent = engine_request(
                request_id, request, seed, created_at=created_at, stream=stream, chat_format=self.chat_format()
            )
            served = model_routes.lora_of(request.model, self.config.routes())
            if request.model is not None or served.lora_path is not None:
                sent = dataclasses.replace(
                    sent, model=request.model, lora_path=served.lora_path, lora_scale=served.lora_scale
                )
            self.outputs.add_request(request_id, request.stop, sent.reply)
            return sent

        if request.model is not None:
            self._models[request_id] = request.model  # the result names the model that made it
        self.engine.dispatch(request.model, request_id, build)  # type: ignore[union-attr]

    async def run_task(
        self,
        request: EngineRequest,
        timeout_s: float,
        disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> EngineOutput:
        """Run an engine task other than generation (EngineTask) and return its final output; its error,
        when it failed, as the EdgeLLMError its type stands for. Counted against max_queued like any
        request, never registered: the answer is all there is of it. `disconnected`: the caller's state,
        watched while it waits; once it is gone the task is aborted and Cancelled raised."""
        self._require_engine(new_work=request.task is EngineTask.EMBED, lane=request.priority)
        key = f"task-{uuid.uuid4().hex}"
        request.request_id = key
        request.deadline = time.time() + timeout_s
        fut = asyncio.get_running_loop().create_future()
        try:
            with self.requests.registering_one(self._refuse_when_full):
                self._tasks[key] = fut
                await asyncio.to_thread(self.engine.submit, request)
            out = await self._task_answer(key, fut, timeout_s + 5.0, disconnected)
            if out is None:
                self.abort(key)
                raise WaitTimeout(f"the {request.task} request did not finish within {timeout_s:g} s") from None
        finally:
            self._tasks.pop(key, None)
        if out.finish_reason is FinishReason.TIMEOUT:
            raise WaitTimeout(f"the {request.task} request did not finish within {timeout_s:g} s")
        if out.error is not None:
            raise error_from(out.error_type, out.error)
        return out

    async def _task_answer(
        self,
        key: str,
        fut: asyncio.Future[EngineOutput],
        wait_s: float,
        disconnected: Callable[[], Awaitable[bool]] | None,
    ) -> EngineOutput | None:
        """The task's final output; None after `wait_s`. Looks at the caller every TASK_WATCH_S: one that
        hung up has the task aborted (the engine frees it at its next step) and gets Cancelled."""
        give_up = time.monotonic() + wait_s
        while (left := give_up - time.monotonic()) > 0:
            done, _ = await asyncio.wait({fut}, timeout=min(left, TASK_WATCH_S) if disconnected else left)
            if done:
                return fut.result()
            if disconnected is not None and await disconnected():
                self.abort(key)
                raise Cancelled(f"the {key} task's caller disconnected")
        return None

    async def count_prompt_tokens(self, chat: ChatRequest) -> int:
        """The prompt tokens `chat` would run with: its messages through the model's chat template (tools
        and template kwargs included), tokenized as generation tokenizes them."""
        return int((await self.render(chat)).result["n_tokens"])

    async def render(self, chat: ChatRequest) -> EngineOutput:
        """The prompt text and token count of a validated request (RENDER: /apply-template, counting)."""
        sent = engine_request("", chat, 0, created_at=time.time(), chat_format=self.chat_format())
        sent.task = EngineTask.RENDER
        return await self.run_task(sent, min(chat.timeout, 60.0))

    async def detokenize(self, tokens: list[int]) -> str:
        out = await self.run_task(EngineRequest("", [], task=EngineTask.DETOKENIZE, payload={"tokens": tokens}), 60.0)
        return out.result["content"]

    def chat_format(self) -> ChatFormat:
        """The model's (EngineInfo's); the generic one until the engine has reported."""
        info = self._active_info()
        return ChatFormat.from_dict(info.chat_format if info is not None else None)

    def paused_lanes(self) -> dict[Priority, Pause]:
        """The lanes that take no new work now, and why (api/lanes.py: heat, then memory)."""
        memory = self.pressure.state() if self.pressure is not None else None
        return paused_lanes(memory, self.board.health() if self.board is not None else None)

    def _refuse_under_pressure(self, lane: Priority | None) -> None:
        """503 when `lane` is paused (None: a request whose lane is not known yet, refused only once every
        lane is)."""
        lane = lane or Priority.REALTIME
        pause = self.paused_lanes().get(lane)
        if pause is None:
            return
        refusal = self.pressure.refusal() if pause.memory and self.pressure is not None else None
        raise refusal or thermal_refusal(lane, pause)

    def _require_engine(self, *, new_work: bool = True, lane: Priority | None = None) -> None:
        """503 unless the engine takes requests; `new_work`: also while `lane` is paused (api/lanes.py:
        generation and embeddings allocate; the tokenizer and template tasks do not, so they go on)."""
        if self.draining:
            raise EngineUnavailable("the node is shutting down; retry when it is back")
        health = self.engine_health()
        # While the worker restarts, requests queue and are sent once it is back; otherwise 503.
        if not health.state.takes_requests:
            reason = f": {health.last_error}" if health.last_error else ""
            raise EngineUnavailable(f"engine is {health.state.value}{reason}")
        if new_work:
            self._refuse_under_pressure(lane)

    def abort(self, request_id: str) -> None:
        if self.engine is not None:
            self.engine.abort(request_id)

    # -- engine outputs (called from the engine's reader thread) --------------------------------
    def on_engine_outputs(self, outs: list[EngineOutput]) -> None:
        """One engine message: deltas go to their streams; finals are stored in one transaction, then
        their waiters are resolved with the delivered outcome (no re-read of SQLite). Each loaded model's
        worker has a reader thread that calls this: one message at a time, as the output processor's
        per-request state (text so far, stop matching) is not made for two threads."""
        with self._outputs_lock:
            self._on_engine_outputs(outs)

    def _on_engine_outputs(self, outs: list[EngineOutput]) -> None:
        finals: list[Outcome] = []
        if self._tasks:
            for out in [o for o in outs if o.finished and o.request_id in self._tasks]:
                self._post(self._resolve_task, out)
            outs = [o for o in outs if o.request_id not in self._tasks]
        processed = [self.outputs.process(out) for out in outs]
        for out in processed:
            if not out.finished:
                self._post(self._push_delta, out)
                continue
            outcome = outcome_of(out, self._models.pop(out.request_id, self.model_name), public_id(out.request_id))
            if self.delegator is not None:
                ran = self.delegator.result_fields(out.request_id)  # where it ran (asked even for a failure)
                if outcome.result is not None:
                    outcome.result.update(ran)
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
                    self.requests.keep_unsaved(finals)
                    return
                time.sleep(delay)

    def flush_unsaved(self) -> int:
        """Write results kept in memory while the registry was full; returns how many were written."""
        pending = self.requests.unsaved()
        if not pending:
            return 0
        try:
            self.registry.finish_many([(o.request_id, o.status, o.result, o.error, o.error_type) for o in pending])
        except EdgeLLMError:
            return 0
        self.requests.stored(pending)
        log.info("stored %d result(s) kept in memory while the registry was full", len(pending))
        return len(pending)

    def _post(self, fn, arg) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, arg)

    def _resolve_task(self, out: EngineOutput) -> None:
        fut = self._tasks.get(out.request_id)
        if fut is not None and not fut.done():
            fut.set_result(out)

    def _resolve(self, outcome: Outcome) -> None:
        state = self.requests.get(outcome.request_id)
        if state is not None and state.waiter is not None and not state.waiter.done():
            state.waiter.set_result(outcome)

    def _push_delta(self, out: RequestOutput) -> None:
        state = self.requests.get(out.request_id)
        if state is not None and state.stream is not None:
            state.stream.put_nowait(out)

    def _let_go(self, key: str, *, stream: bool = False) -> None:
        """The caller stopped waiting (answered, timed out or gone): its waiter (and stream) go."""
        state = self.requests.get(key)
        if state is not None:
            state.waiter = None
            if stream:
                state.stream = None
            self.requests.settle(key)

    # -- waiting -----------------------------------------------------------------------------
    async def wait(self, request_id: str, timeout_s: float) -> dict[str, Any]:
        """Block until a request submitted by this process (mode sync) ends; its result or its error.
        `request_id`: the key `submit` returned."""
        state = self.requests.get(request_id)
        fut = state.waiter if state is not None else None
        shown = public_id(request_id)
        if fut is None:
            raise UnknownRequest(f"request {shown!r} has no waiter in this process", request_id=shown)
        try:
            # A little grace past the engine's own deadline, which normally ends the request first.
            outcome = await asyncio.wait_for(asyncio.shield(fut), timeout_s + 5.0)
        except asyncio.TimeoutError:  # builtin TimeoutError only from 3.11
            raise WaitTimeout(
                f"request {shown} did not finish within {timeout_s:g} s; poll /request_status?request_id={shown}",
                request_id=shown,
            ) from None
        finally:
            self._let_go(request_id)
        return outcome.result_or_raise(shown)

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Deltas, then the final output, of a request submitted with stream=True (`request_id`: its key)."""
        queue = self.requests.get(request_id).stream
        try:
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    return
        finally:
            self._let_go(request_id, stream=True)

    # -- queries -----------------------------------------------------------------------------
    async def request_status(self, request_id: str, *, return_full: bool, owner: str | None = None) -> dict[str, Any]:
        """A record as its owner sees it; another token's request is as unknown as a missing one.

        The caller's own id first (its key), then the id itself: a generated id, an anonymous caller's
        (readable by every caller, as before), or one registered before ids were scoped by owner."""
        rec = await asyncio.to_thread(self._record, request_id, owner)
        if rec is None:
            raise UnknownRequest(
                f"unknown request_id {request_id!r} (never submitted, or expired)", request_id=request_id
            )
        unsaved = self.requests.unsaved_of(rec.request_id)
        if unsaved is not None and rec.status is RequestStatus.PENDING:
            rec = dataclasses.replace(
                rec, status=unsaved.status, result=unsaved.result, error=unsaved.error, error_type=unsaved.error_type
            )
        body: dict[str, Any] = {"request_id": public_id(rec.request_id), "status": rec.status.value}
        if rec.status is RequestStatus.COMPLETED:
            body["result"] = rec.result
        elif rec.status.is_finished:
            body["error"] = rec.error
            body["error_type"] = str(rec.error_type) if rec.error_type is not None else None
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
            if rec.delegation is not None:
                body["delegation"] = rec.delegation
            if rec.result is not None:
                body["result"] = rec.result
        return body

    async def stored_record(self, request_id: str, owner: str | None) -> RequestRecord | None:
        """The record of `request_id` as `owner` may read it (as request_status decides: its own, or an
        anonymous one), with a result still held in memory (disk full) laid over a pending row; None
        when it is unknown, expired, deleted or another token's."""
        rec = await asyncio.to_thread(self._record, request_id, owner)
        if rec is None:
            return None
        unsaved = self.requests.unsaved_of(rec.request_id)
        if unsaved is not None and rec.status is RequestStatus.PENDING:
            rec = dataclasses.replace(
                rec, status=unsaved.status, result=unsaved.result, error=unsaved.error, error_type=unsaved.error_type
            )
        return rec

    async def delete_record(self, key: str) -> bool:
        """Remove the record under `key` (a key `stored_record` returned); False when it is already gone."""
        return await asyncio.to_thread(self.registry.delete, key)

    def _record(self, request_id: str, owner: str | None) -> RequestRecord | None:
        keys = dict.fromkeys((request_key(request_id, owner), request_id))
        for key in keys:
            rec = self.registry.get(key)
            if rec is not None and (rec.owner is None or rec.owner == owner):
                return rec
        return None

    async def live_check(self) -> bool:
        """The watchdog's question: is the engine up (or restarting) and the registry readable?

        Awaited on the event loop, so a wedged loop fails it by never answering.
        """
        if not self.engine_health().state.takes_requests:
            return False
        try:
            await asyncio.to_thread(self.registry.counts)
        except EdgeLLMError as exc:
            log.error("watchdog: the request registry is not readable: %s", exc.message)
            return False
        return True

    def health(self) -> tuple[bool, dict[str, Any]]:
        engine = self.engine_health()
        info = self._active_info()
        ready = engine.state is EngineState.READY
        return ready, {
            "status": "ok" if ready else engine.state.value,
            "model": self.model_name,
            "engine": engine.as_dict(),
            "offload": info.offload if info is not None else None,
            "media": info.media if info is not None else None,
            **({"memory_pressure": self.pressure.state()} if self.pressure is not None else {}),
            "lanes": lanes_body(self.paused_lanes()),  # which lanes take new work (api/lanes.py)
            # nvpmodel mode and throttled (runtime/board.read_throttling), only what the board exposes
            **({"board": board} if (board := self.board.health() if self.board is not None else {}) else {}),
        }

    def status(self) -> dict[str, Any]:
        ready, health = self.health()
        info = self._active_info()
        report = self.engine.stats if self.engine is not None else None  # the engine's last report
        stats = report.as_dict() if report is not None else {}
        return {
            **health,
            "uptime_s": round(time.time() - self.started_at, 1),
            "engine_info": info.as_dict() if info is not None else {},
            "load": {k: v for k, v in stats.items() if k in STATUS_LOAD},
            "kv_pool": _kv_pool(stats),
            "in_flight": self.in_flight(),
            "max_queued": self.config.max_queued,
            "registry": {
                **self.registry.counts(),
                "unsaved_results": len(self.requests.unsaved()),
                "reset_reason": self.registry.reset_reason,
            },
            "auth_required": self.auth.required,
            **({"memory_plan": self.memory_plan} if self.memory_plan else {}),
            **({"balancing": self.delegator.state()} if self.delegator is not None else {}),
            **(
                {"board": board}
                if (board := {**(self.board.read() if self.board is not None else {}), **health.get("board", {})})
                else {}
            ),
        }

    def metrics(self) -> dict[str, Any]:
        """The JSON view of the Prometheus instruments (p50/p95 are histogram-bucket estimates)."""
        return self.instruments.as_dict()


def _kv_pool(stats: dict[str, Any]) -> dict[str, Any]:
    """The engine's one KV pool for /status: its cells, those in use and free, those more than one
    sequence holds (a shared prefix stored once); {} before the engine's first report."""
    cells = stats.get("kv_cells")
    if not cells:
        return {}
    used = int(stats.get("kv_used") or 0)
    return {"cells": cells, "used": used, "free": cells - used, "shared": int(stats.get("kv_shared") or 0)}

"""The service object every adapter calls: parse / submit / wait / request_status / health / status / metrics.

It validates, authenticates and registers each request (SQLite first, then the engine) and hands it to
this node's engine or, in a balancing group, to a peer. It is framework-agnostic: FastAPI and the naeural
plugin both call it and map `EdgeLLMError` to a response with one function. A request's live state (text
assembly, waiter or stream, an outcome not yet stored, its delivery) is its RequestState in
`self.requests` (api/request_state.py); the registry is its durable record.

Its parts live apart: the rules that refuse new work in api/admission.py, restart recovery in
api/recovery.py, the way back (engine outputs -> stored outcomes -> waiters and streams) in
`self.answers` (api/answers.py), engine tasks that keep no record in `self.tasks` (api/engine_tasks.py),
reading records back in api/record_reads.py, the /health and /status bodies in api/node_report.py.
The way in stays here whole: parsing, admission, registration and dispatch read the same live state
(the config and auth a reload replaces, the engine bound at start, the host's gates, the delegator),
their order (refuse, register, then hand over) is the invariant, and its public methods are the one
facade every adapter calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from edgellm.api import model_routes
from edgellm.api.admission import (
    AdmissionGate,
    refuse_unless_serving,
    refuse_when_full,
    refuse_when_paused,
    refuse_while_unsaved,
)
from edgellm.api.answers import Answers
from edgellm.api.auth import Authenticator
from edgellm.api.chat_request import ChatRequest
from edgellm.api.dialects.openai_chat import OpenAIOptions, parse_openai_request
from edgellm.api.engine_tasks import EngineTasks
from edgellm.api.guide_pool import request_checks, shared_pool
from edgellm.api.lanes import Pause, paused_lanes
from edgellm.api.metrics import ServiceMetrics, live_state
from edgellm.api.node_report import BoardSource, EnergySource, health_body, status_body
from edgellm.api.output_processor import OutputProcessor
from edgellm.api.record_reads import find_record, with_unsaved
from edgellm.api.record_reads import status_body as record_status_body
from edgellm.api.recovery import recover
from edgellm.api.registry import Registry, RequestRecord, RequestStatus
from edgellm.api.request_ids import request_key
from edgellm.api.request_state import RequestTable
from edgellm.api.results import Outcome
from edgellm.api.submission import ServiceConfig, check_vocabulary, engine_request, load_media
from edgellm.api.text_state import RequestOutput
from edgellm.api.validation import parse_chat_request
from edgellm.engine.chat_format import ChatFormat
from edgellm.engine.info import EngineInfo
from edgellm.engine.interface import EngineClient, EngineHealth
from edgellm.engine.types import EngineOutput, EngineRequest, EngineTask, Priority
from edgellm.errors import EdgeLLMError, InvalidRequest, UnknownRequest
from edgellm.media.types import MediaCaps

log = logging.getLogger(__name__)


class Delegator(Protocol):
    """Request balancing (fleet/balancer.py): may hand a registered request to a peer node instead of
    this node's engine, and adds where each request ran to its result."""

    def delegate(self, key: str, request: ChatRequest, seed: int, mode: str) -> bool: ...

    def result_fields(self, key: str) -> dict[str, Any]: ...

    def state(self) -> dict[str, Any]: ...


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
        # Engine tasks that take no slot and keep no record (embeddings, tokenizer, template).
        self.tasks = EngineTasks(self.requests)
        # The way back: engine outputs -> stored outcomes -> waiters, streams and task futures.
        self.answers = Answers(registry, self.requests, self.outputs, self.instruments, self.tasks)
        # Request balancing between nodes (fleet/balancer.py), set by a Ratio1 plugin in a balancing group.
        self.delegator: Delegator | None = None

    # -- wiring ------------------------------------------------------------------------------
    def bind(self, engine: EngineClient, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.answers.loop = engine, loop

    def recover(self) -> int:
        """At start, before the engine admits anything: the pending rows of earlier boots, failed (sync)
        or sent again (async) by api/recovery.py; how many were sent."""
        return recover(self.registry, self.config, self._send_recovered)

    def _send_recovered(self, key: str, request: ChatRequest, seed: int, created_at: float) -> None:
        self._dispatch(key, request, seed, stream=False, created_at=created_at)

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
        request = parse_chat_request(self.config.served_body(body), **self.config.limits())
        request = model_routes.route(request, self.config.routes(), strict=False)
        await self.check_engine_limits(request, disconnected)
        return await self._load_media(self._in_lane(request, owner))

    async def parse_openai(
        self, body: Any, disconnected: Callable[[], Awaitable[bool]] | None = None, *, owner: str | None = None
    ) -> tuple[ChatRequest, OpenAIOptions]:
        """An OpenAI chat-completions body -> a validated request and the response options."""
        request, opts = parse_openai_request(
            self.config.served_body(body), self.config.model_ids(), **self.config.limits()
        )
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
        """429 when max_queued requests are in flight. Called with the table's lock held where the check
        and the count that follows must be one step."""
        refuse_when_full(self.in_flight(), self.config.max_queued, self.instruments)

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

    def keep_alive(self, model: str | None, seconds: float | None) -> bool:
        """How long `model` stays loaded once idle (Ollama's keep_alive: -1 never unloaded, 0 unloaded once
        idle, None the node's idle_unload_s); False where the node keeps its one model loaded anyway."""
        return self.engine.keep_alive(model, seconds) if self.engine is not None else False

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
        refuse_while_unsaved(len(self.requests.unsaved()))
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
        self.answers.finish(outcome)
        return True

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
            self.answers.models[request_id] = request.model  # the result names the model that made it
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
        return await self.tasks.run(
            self.engine, request, timeout_s, disconnected, admit=self._refuse_when_full, abort=self.abort
        )

    async def count_prompt_tokens(self, chat: ChatRequest) -> int:
        """The prompt tokens `chat` would run with: its messages through the model's chat template (tools
        and template kwargs included), tokenized as generation tokenizes them."""
        return int((await self.render(chat)).result["n_tokens"])

    async def render(self, chat: ChatRequest, *, add_generation_prompt: bool = True) -> EngineOutput:
        """The prompt text and token count of a validated request (RENDER: /apply-template, counting)."""
        sent = engine_request("", chat, 0, created_at=time.time(), chat_format=self.chat_format())
        sent.task = EngineTask.RENDER
        sent.add_generation_prompt = add_generation_prompt
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
        refuse_when_paused(lane, self.paused_lanes(), self.pressure)

    def _require_engine(self, *, new_work: bool = True, lane: Priority | None = None) -> None:
        """503 unless the engine takes requests; `new_work`: also while `lane` is paused (api/lanes.py:
        generation and embeddings allocate; the tokenizer and template tasks do not, so they go on)."""
        refuse_unless_serving(self.draining, self.engine_health())
        if new_work:
            self._refuse_under_pressure(lane)

    def abort(self, request_id: str) -> None:
        if self.engine is not None:
            self.engine.abort(request_id)

    # -- the way back (api/answers.py) ---------------------------------------------------------
    def on_engine_outputs(self, outs: list[EngineOutput]) -> None:
        """One engine message (from a model's reader thread): deltas to their streams, finals stored and
        their waiters resolved; a result names the model that made it and, in a balancing group, where it ran."""
        ran = self.delegator.result_fields if self.delegator is not None else None
        self.answers.on_engine_outputs(outs, self.model_name, ran)

    def flush_unsaved(self) -> int:
        """Write results kept in memory while the registry was full; returns how many were written."""
        return self.answers.flush_unsaved()

    async def wait(self, request_id: str, timeout_s: float) -> dict[str, Any]:
        """Block until a request submitted by this process (mode sync) ends; its result or its error.
        `request_id`: the key `submit` returned."""
        return await self.answers.wait(request_id, timeout_s)

    def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Deltas, then the final output, of a request submitted with stream=True (`request_id`: its key)."""
        return self.answers.stream(request_id)

    # -- queries -----------------------------------------------------------------------------
    async def request_status(self, request_id: str, *, return_full: bool, owner: str | None = None) -> dict[str, Any]:
        """A record as its owner sees it; another token's request is as unknown as a missing one.

        The caller's own id first (its key), then the id itself: a generated id, an anonymous caller's
        (readable by every caller, as before), or one registered before ids were scoped by owner."""
        rec = await self.stored_record(request_id, owner)
        if rec is None:
            raise UnknownRequest(
                f"unknown request_id {request_id!r} (never submitted, or expired)", request_id=request_id
            )
        return record_status_body(rec, return_full=return_full)

    async def stored_record(self, request_id: str, owner: str | None) -> RequestRecord | None:
        """The record of `request_id` as `owner` may read it (as request_status decides: its own, or an
        anonymous one), with a result still held in memory (disk full) laid over a pending row; None
        when it is unknown, expired, deleted or another token's."""
        rec = await asyncio.to_thread(find_record, self.registry, request_id, owner)
        return with_unsaved(rec, self.requests) if rec is not None else None

    async def delete_record(self, key: str) -> bool:
        """Remove the record under `key` (a key `stored_record` returned); False when it is already gone."""
        return await asyncio.to_thread(self.registry.delete, key)

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
        return health_body(
            self.model_name, self.engine_health(), self._active_info(), self.pressure, self.board, self.paused_lanes()
        )

    def status(self) -> dict[str, Any]:
        _, health = self.health()
        report = self.engine.stats if self.engine is not None else None  # the engine's last report
        return status_body(
            health,
            self._active_info(),
            report.as_dict() if report is not None else {},
            uptime_s=time.time() - self.started_at,
            in_flight=self.in_flight(),
            max_queued=self.config.max_queued,
            registry={
                **self.registry.counts(),
                "unsaved_results": len(self.requests.unsaved()),
                "reset_reason": self.registry.reset_reason,
            },
            auth_required=self.auth.required,
            memory_plan=self.memory_plan,
            balancing=self.delegator.state() if self.delegator is not None else None,
            board=self.board.read() if self.board is not None else {},
        )

    def metrics(self) -> dict[str, Any]:
        """The JSON view of the Prometheus instruments (p50/p95 are histogram-bucket estimates)."""
        return self.instruments.as_dict()

"""`edgellm batch-run --local`: the batch on the in-process engine, each request answered as the node's
`POST /v1/chat/completions` would answer it, so results.jsonl reads the same as against the node.

Per request, the node's own code, in the node's order: the body is the bytes the HTTP transport
would POST (runner.wire_body), refused over `max_body_bytes` (413, wire.body_too_large) and
parsed as the route parses it (400s of wire.parse_body), then validated by
submission.parse_openai_now (the rules of Service.parse_openai: the served model name, limits from
the same settings, the guide compiles, logit_bias ids in the vocabulary). What passes becomes the
EngineRequest Service._dispatch would send (submission.engine_request). All of them go to one
OfflineEngine (edgellm/offline.py: the node's Scheduler and OutputProcessor), which batches them
continuously; each final output is mapped as the node maps it (results.outcome_of, then
Outcome.result_or_raise: timeouts 504, guide dead ends 422, engine failures 500) and answered with
the route's bodies (dialects/openai_chat.completion_body / error_body), rendered by the route's
SafeJSONResponse (wire.render) and read back like an HTTP answer (runner.answer_outcome).

A `"url": "/v1/embeddings"` line is answered as the node's embeddings route answers it: the same
body-size check, parse_embeddings (the served model name, the engine's embedding width,
max_prompt_bytes), the EMBED task on the same engine (its failures, a token id outside the vocabulary
or an input too long for the embedding context, are that line's error, as Service.run_task maps
them), and embeddings_body. EMBED answers are plain data the OutputProcessor knows nothing of, so
they run through the engine core's loop before the generation requests, each final EngineOutput
taken as it is; their latency_ms is the engine's embed time.

latency_ms: from when the engine queued the request to its final output, by the engine's own
clock (timings queue + ttft + decode); a request refused before it reached the engine: the time
its validation took. A request's `timeout` (default: request_timeout of the settings) counts from
the same moment, as the node's counts from the request's arrival: requests still waiting for
their turn in a large file do not time out.

Not reproduced, because there is no HTTP exchange: authentication (no token is checked), the
in-flight cap (429: the engine is fed as it has room), shutdown (503). A line with `"stream": true` never gets here:
load_requests refuses it up front (batch/inputs.py); a caller handing one over directly gets the line
batch-run would write for an SSE answer (an error line with http_code 200), without generating.

Run by `edgellm batch-run --local` in a crash-guarded child (edgellm/runtime/supervision/crash_guard.py): `on_phase`
is told when the model loads and which requests the engine decodes ("decoding request 3 of 10 (id
"r2")"; the crash point "decoding:N" with N the request's 1-based place in the requests file;
"closing" when the engine is torn down), so the parent can say where a native crash happened; the
journal already holds what finished.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from edgellm.api.chat_request import ChatRequest
from edgellm.api.dialects.completions import MAX_PROMPTS, CompletionOptions, parse_completion_request, prompt_text
from edgellm.api.dialects.completions_bodies import completion_response
from edgellm.api.dialects.embeddings import EmbeddingsCall, embeddings_body, parse_embeddings
from edgellm.api.dialects.openai_chat import OpenAIOptions, completion_body, error_body
from edgellm.api.guide_pool import request_checks, shared_pool
from edgellm.api.model_names import ModelNames
from edgellm.api.results import outcome_of
from edgellm.api.submission import ServiceConfig, check_vocabulary, engine_request, load_media, parse_openai_now
from edgellm.api.text_state import RequestOutput
from edgellm.batch.http_client import answer_outcome, wire_body
from edgellm.batch.inputs import COMPLETIONS_URL, EMBEDDINGS_URL, url_of
from edgellm.batch.transport import Deliver
from edgellm.engine.config import ModelConfig
from edgellm.engine.types import EngineOutput, EngineRequest, FinishReason, Priority
from edgellm.errors import EdgeLLMError, WaitTimeout, error_from
from edgellm.media.types import MediaCaps
from edgellm.phases import CLOSING, decoding_reporter
from edgellm.wire import body_too_large, parse_body, render

# What batch-run reads from the node for a stream (text/event-stream, "data: {...}"): not JSON.
SSE_PREFIX = b"data: "


def _batch_priority(body: Any) -> Any:
    """A chat or completions body (parsed, after its size was checked as the node checks it) without a
    priority runs as `batch` (engine/types.Priority): a file job yields to whatever else the engine serves."""
    return {**body, "priority": "batch"} if isinstance(body, dict) and body.get("priority") is None else body


def _rendered(body: dict[str, Any]) -> bytes:
    """The bytes the route sends for `body` (its response class renders with wire.render: NaN -> null,
    lone surrogates escaped)."""
    return render(body)


class LocalTransport:
    """batch-run's transport for --local: one OfflineEngine. The CLI hands over what the node's settings
    say (the model, the service's limits, the body limit): this layer does not read the runtime's settings."""

    def __init__(
        self,
        model: ModelConfig,
        config: ServiceConfig,
        max_body_bytes: int,
        *,
        override_model: bool = False,
        strict_model: bool = False,
        on_phase: Callable[[str, str | None], None] | None = None,
        total: int = 0,
    ):
        from edgellm.offline import OfflineEngine

        self.on_phase = on_phase
        self.total = total  # requests in the file, resumed ones included: "decoding request N of total"
        self._decoding_started: set[int] = set()
        self.config = config
        self.max_body_bytes = max_body_bytes
        # --model PATH: every request runs on that file, as --model NAME sends every request to that model.
        self.model_override = self.config.model_name if override_model else None
        # A line's model this engine does not serve runs on it all the same (its line says `served_by`), as
        # a file written for another endpoint names that endpoint's model; --strict-model: the node's 404.
        own = tuple(pair for pair in config.model_aliases if pair[1] == config.model_name)
        self.names = ModelNames((config.model_name,), own, "reject" if strict_model else "default")
        self.config = replace(config, unknown_model="reject")  # model_for decided: the rules then see an id
        self._said_foreign = False
        # The engine is fed as its slots free up: n_slots prepared requests waiting is enough to keep
        # every slot busy, and keeps the time a request waits inside the engine short.
        if on_phase is not None:
            on_phase(f"loading the model {model.path}", "loading")
        self.engine = OfflineEngine(model, max_waiting=model.n_slots)
        self.media_caps = MediaCaps.from_dict(self.engine.scheduler.media_caps())

    def model_for(self, req: dict[str, Any]) -> str | None:
        """The model a line's body names when sent: --model's, or the served id an alias or (without
        --strict-model) a model this engine does not serve stands for; None: as the line names it."""
        if self.model_override:
            return self.model_override
        name = req.get("model")
        if not isinstance(name, str) or not name or name == self.config.model_name:
            return None
        return self.names.served_id(name)

    def _served_by(self, todo: list[tuple[int, dict[str, Any]]]) -> dict[int, str]:
        """The lines that run on a model they do not name (the one this engine serves), said once on stderr."""
        served = {i: m for i, req in todo if not self.model_override and (m := self.model_for(req)) is not None}
        aliases = {name for name, _ in self.names.aliases}
        foreign = sorted({str(req.get("model")) for i, req in todo if i in served and req.get("model") not in aliases})
        if foreign and not self._said_foreign:
            self._said_foreign = True
            named = ", ".join(repr(m[:80]) for m in foreign[:3]) + (
                f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
            )
            print(
                f"edgellm batch-run: requests name {named}, which this engine does not serve: they run on "
                f'{self.config.model_name!r} (each such line says "served_by"; --strict-model refuses them)',
                file=sys.stderr,
            )
        return served

    def validate(self, req: dict[str, Any]) -> tuple[ChatRequest, OpenAIOptions]:
        """A batch request as the node's route validates its body; raises the EdgeLLMError it would answer."""
        raw = wire_body(req, self.model_for(req))
        refusal = body_too_large(len(raw), self.max_body_bytes)
        if refusal is not None:
            raise refusal
        request, opts = parse_openai_now(_batch_priority(parse_body(raw)), self.config, self.engine.model.n_vocab)
        return load_media(request, self.config, self.media_caps), opts

    def validate_completions(self, req: dict[str, Any]) -> tuple[list[ChatRequest], CompletionOptions, list[str]]:
        """A `"url": "/v1/completions"` request as the node's completions route validates it (one request
        per prompt, the prompts' text for `echo`); raises the EdgeLLMError it would answer."""
        raw = wire_body(req, self.model_for(req))
        refusal = body_too_large(len(raw), self.max_body_bytes)
        if refusal is not None:
            raise refusal
        model = self.engine.model
        chats, opts = parse_completion_request(
            _batch_priority(parse_body(raw)),
            self.config.model_name,
            n_vocab=model.n_vocab,
            infill=model.fim_tokens() is not None,
            max_prompts=max(1, min(MAX_PROMPTS, self.config.max_queued)),
            **self.config.limits(),
        )
        shared_pool().check_now(request_checks(chats[0]))
        check_vocabulary(chats[0], model.n_vocab)
        echoes = []
        if opts.echo:  # token prompts: their text as the engine's DETOKENIZE task gives it
            for chat in chats:
                text = prompt_text(chat)
                if text is None:
                    text = b"".join(model.piece(t, special=True) for t in chat.prompt_tokens or []).decode(
                        "utf-8", "replace"
                    )
                echoes.append(text)
        return chats, opts, echoes

    def validate_embeddings(self, req: dict[str, Any]) -> EmbeddingsCall:
        """A `"url": "/v1/embeddings"` request as the node's embeddings route validates it; raises the
        EdgeLLMError it would answer. The EMBED request it holds gets its id and time budget here."""
        raw = wire_body(req, self.model_for(req))
        refusal = body_too_large(len(raw), self.max_body_bytes)
        if refusal is not None:
            raise refusal
        call = parse_embeddings(
            parse_body(raw),
            self.config.model_name,
            n_embd=self.engine.scheduler.tasks.n_embd,
            max_bytes=self.config.max_prompt_bytes,
        )
        # The route's budget is the node's default timeout, from arrival; here from when the engine queues it.
        call.request.request_id = f"task-{uuid.uuid4().hex}"
        call.request.timeout_s = self.config.default_timeout_s
        call.request.priority = Priority(call.priority or Priority.BATCH)  # a file job's lane, as its chat lines
        return call

    def _embedding_line(self, rid: Any, call: EmbeddingsCall, out: EngineOutput) -> dict[str, Any]:
        """The route's answer to an EMBED output: its body, or the error Service.run_task raises."""
        try:
            if out.finish_reason is FinishReason.TIMEOUT:
                raise WaitTimeout(
                    f"the {call.request.task} request did not finish within {self.config.default_timeout_s:g} s"
                )
            if out.error is not None:
                raise error_from(out.error_type, out.error)
            code = 200
            body = embeddings_body(out.result["embeddings"], call, self.config.model_name, out.prompt_tokens)
        except EdgeLLMError as exc:
            code, body = exc.http_status, error_body(exc)
        return {"id": rid, "latency_ms": _latency_ms(out, call.request), **answer_outcome(code, _rendered(body))}

    def _engine_request(self, chat: ChatRequest) -> tuple[str, EngineRequest]:
        request_id = uuid.uuid4().hex  # as Service.submit: the response id is chatcmpl-<it> (cmpl-<it>)
        seed = chat.seed if chat.seed is not None else secrets.randbits(64)
        # The node's deadline counts from a request's arrival; here every request is handed over at
        # once, so its budget counts from when the engine queues it. A deadline_ms has no meaning for a
        # line that waits for the file's earlier lines: it is not applied.
        request = replace(
            engine_request(request_id, chat, seed, created_at=0.0, chat_format=self.engine.model.chat_format),
            deadline=None,
            timeout_s=chat.timeout,
            answer_by=None,
        )
        return request_id, request

    def run(self, todo: list[tuple[int, dict[str, Any]]], deliver: Deliver) -> None:
        served_by = self._served_by(todo)
        if served_by:
            deliver = _marking(deliver, served_by)
        queued: dict[str, tuple[int, Any, OpenAIOptions, EngineRequest]] = {}
        parts: dict[str, tuple[_Completion, int, EngineRequest]] = {}  # a completions line's prompts
        embeds: dict[str, tuple[int, Any, EmbeddingsCall]] = {}
        for i, req in todo:
            start = time.perf_counter()
            if url_of(req) == EMBEDDINGS_URL:
                try:
                    call = self.validate_embeddings(req)
                except EdgeLLMError as exc:
                    deliver(i, _line(req["id"], start, exc.http_status, _rendered(error_body(exc))))
                    continue
                embeds[call.request.request_id] = (i, req["id"], call)
                continue
            if url_of(req) == COMPLETIONS_URL:
                try:
                    chats, copts, echoes = self.validate_completions(req)
                except EdgeLLMError as exc:
                    deliver(i, _line(req["id"], start, exc.http_status, _rendered(error_body(exc))))
                    continue
                if copts.stream:
                    deliver(i, _line(req["id"], start, 200, SSE_PREFIX))
                    continue
                group = _Completion(i, req["id"], copts, echoes, [None] * len(chats))
                for p, chat in enumerate(chats):
                    request_id, request = self._engine_request(chat)
                    parts[request_id] = (group, p, request)
                continue
            try:
                chat, opts = self.validate(req)
            except EdgeLLMError as exc:
                deliver(i, _line(req["id"], start, exc.http_status, _rendered(error_body(exc))))
                continue
            if opts.stream:
                deliver(i, _line(req["id"], start, 200, SSE_PREFIX))
                continue
            request_id, request = self._engine_request(chat)
            queued[request_id] = (i, req["id"], opts, request)

        def finished(out: RequestOutput) -> None:
            if out.request_id in parts:
                group, p, request = parts.pop(out.request_id)
                group.outputs[p] = (out, request)
                if all(entry is not None for entry in group.outputs):
                    deliver(group.index, self._completion_line(group))
                return
            i, rid, opts, request = queued.pop(out.request_id)
            try:
                result = outcome_of(out, self.config.model_name).result_or_raise()
                code, body = 200, completion_body(result, opts)
            except EdgeLLMError as exc:
                code, body = exc.http_status, error_body(exc)
            line = {"id": rid, "latency_ms": _latency_ms(out, request), **answer_outcome(code, _rendered(body))}
            deliver(i, line)

        if not queued and not parts and not embeds:
            return
        decoding = None
        if self.on_phase is not None:
            # (1-based place in the file, the id for the phase of a request decoded alone)
            places = {rid: (entry[0] + 1, f"id {json.dumps(entry[1])[:80]}") for rid, entry in queued.items()}
            places.update({rid: (g.index + 1, f"id {json.dumps(g.rid)[:80]}") for rid, (g, _, _) in parts.items()})
            places.update({rid: (entry[0] + 1, f"id {json.dumps(entry[1])[:80]}") for rid, entry in embeds.items()})
            total = self.total or max(n for n, _ in places.values())
            decoding = decoding_reporter(self.on_phase, places, total, self._decoding_started)
        if embeds:
            self._embed(embeds, deliver, decoding)
        if not queued and not parts:
            return
        requests = [entry[3] for entry in queued.values()] + [entry[2] for entry in parts.values()]
        self.engine.generate(requests, on_finished=finished, on_decoding=decoding)

    def _embed(
        self,
        embeds: dict[str, tuple[int, Any, EmbeddingsCall]],
        deliver: Deliver,
        decoding: Callable[[tuple[str, ...]], None] | None,
    ) -> None:
        """The EMBED requests on the engine core's loop, each final output answered as it comes (the
        embedding batches take no slot: the core's own decoding report does not see them)."""
        if decoding is not None:
            decoding(tuple(embeds))

        def on_output(out: EngineOutput) -> None:
            if out.finished and out.request_id in embeds:
                i, rid, call = embeds.pop(out.request_id)
                deliver(i, self._embedding_line(rid, call, out))

        self.engine.core.run_until_idle([call.request for _, _, call in embeds.values()], on_output=on_output)

    def _completion_line(self, group: _Completion) -> dict[str, Any]:
        """A completions line once all its prompts ended: the route's body, or the first failed prompt's
        error (in prompt order; the node answers with the first to fail and cancels the others)."""
        try:
            results = [outcome_of(out, self.config.model_name).result_or_raise() for out, _ in group.outputs]
            code, body = 200, completion_response(results, group.opts, self.config.model_name, group.echoes)
        except EdgeLLMError as exc:
            code, body = exc.http_status, error_body(exc)
        latency = max(_latency_ms(out, request) for out, request in group.outputs)
        return {"id": group.rid, "latency_ms": latency, **answer_outcome(code, _rendered(body))}

    def close(self, *, abandon: bool) -> None:
        if self.on_phase is not None:  # what finished is journaled: what is left is the teardown
            self.on_phase(CLOSING, "closing")
        try:
            self.engine.close()
        except Exception:
            if not abandon:
                raise


@dataclass
class _Completion:
    """A `/v1/completions` line in flight: one engine request per prompt, answered once all have ended."""

    index: int
    rid: Any
    opts: CompletionOptions
    echoes: list[str]
    outputs: list[tuple[RequestOutput, EngineRequest] | None]


def _marking(deliver: Deliver, served_by: dict[int, str]) -> Deliver:
    """`deliver` whose lines of a model this engine does not serve say which one served them."""

    def marked(i: int, line: dict[str, Any]) -> None:
        deliver(i, {**line, "served_by": served_by[i]} if i in served_by else line)

    return marked


def _line(rid: Any, start: float, code: int, raw: bytes) -> dict[str, Any]:
    return {"id": rid, "latency_ms": round(1000 * (time.perf_counter() - start), 1), **answer_outcome(code, raw)}


def _latency_ms(out: RequestOutput | EngineOutput, request: EngineRequest) -> float:
    timings = out.timings
    if "ttft_ms" in timings and "decode_ms" in timings:  # queued -> first token -> final output
        return round(timings["ttft_ms"] + timings["decode_ms"], 1)
    if "embed_ms" in timings:  # an EMBED request: queued -> its vectors
        return round(timings["embed_ms"], 1)
    if request.deadline is not None and request.timeout_s is not None:  # ended before a slot took it
        queued_at = request.deadline - request.timeout_s  # the engine set the deadline when it queued it
        return round(max(0.0, 1000 * (time.time() - queued_at)), 1)
    return 0.0

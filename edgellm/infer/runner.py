"""`edgellm infer`: a parsed TensorRT-Edge-LLM job -> its output document (and profile) on the local engine.

Batches run one after another, as the format defines them (`batch_size` requests share the engine's
slots; one LoRA adapter and one logprobs K per batch); inside a batch the scheduler batches
continuously. A request that cannot run (its content, guide or adapter) fails alone; a batch that
breaks a batch rule fails as a whole; nothing stops the rest of the file.

Two hooks for the crash-guarded command (edgellm/runtime/supervision/crash_guard.py): `on_phase(text, point)`
is told what the engine is about to do (loading, warm-up, which requests it decodes; `point` names
the moment for native_crash.crash_point: "loading", "warm-up", "decoding:N" with N the request's
1-based place in the input file, "closing" once every response is final), and
`on_response(response)` gets each response as it is final, so what finished survives the process.
The profile's figures are infer/profile.py's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edgellm.api.text_state import RequestOutput
from edgellm.engine.chat_prompt import raw_prompt_text
from edgellm.engine.config import ModelConfig
from edgellm.engine.types import CacheCommit, EngineRequest, FinishReason, SamplingParams, StopCause
from edgellm.errors import EdgeLLMError
from edgellm.infer.contract import InferBatch, InferItem, InferJob
from edgellm.infer.journal import failed_response
from edgellm.infer.profile import batch_profile, job_profile
from edgellm.media.limits import MediaLimits, MediaSources
from edgellm.media.loading import load_content
from edgellm.media.types import MediaCaps
from edgellm.offline import OfflineEngine
from edgellm.phases import CLOSING, decoding_reporter

log = logging.getLogger(__name__)

MAX_SLOTS = 64  # a batch_size above this still runs, its requests queue for slots


@dataclass(frozen=True)
class InferOptions:
    model: ModelConfig  # path, threads, GPU layers, KV type from the node's settings; n_ctx/n_slots are set here
    max_seq_len: int = 2048  # tokens per request, prompt + generated (TensorRT-Edge-LLM's maxSeqLen)
    warmup: int = 0  # untimed runs of the first request before the file
    lora_dirs: tuple[str, ...] = ()  # adapters must live under one of these (besides the input file's folder)
    lora_cache_dir: str = field(default_factory=lambda: _default_cache_dir())
    media_dirs: tuple[str, ...] = ()  # image/audio files may also live here (besides the input file's folder)
    media_limits: MediaLimits = field(default_factory=MediaLimits)


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "edgellm", "lora")


@dataclass
class InferResult:
    document: dict[str, Any]  # the output JSON
    profile: dict[str, Any]
    failed: int  # requests that ended in error or were cancelled (the process exits 1 when > 0)
    interrupted: bool = False  # Ctrl-C: unfinished requests are `cancelled` (the process exits 130)


PhaseHook = Callable[[str, str | None], None]  # (what the engine is doing, its crash point name or None)
ResponseHook = Callable[[dict[str, Any]], None]


def engine_config(job: InferJob, options: InferOptions) -> ModelConfig:
    """One slot per request of a batch, each max_seq_len tokens long, as many as the settings' n_ctx
    (the KV memory the device was configured for) holds; the rest of a batch queues for a slot. Each slot
    owns its cells (kv_unified off): a request never passes max_seq_len (TensorRT-Edge-LLM's maxSeqLen),
    and its output does not depend on its batch neighbours."""
    seq_len = min(options.max_seq_len, options.model.n_ctx)  # one request never holds more than the budget
    n_slots = max(1, min(job.batch_size, MAX_SLOTS, options.model.n_ctx // seq_len))
    return replace(
        options.model,
        n_slots=n_slots,
        n_ctx=n_slots * seq_len,
        n_batch=max(options.model.n_batch, n_slots),
        kv_unified=False,
    )


def run_job(
    job: InferJob,
    options: InferOptions,
    *,
    on_request_done: Callable[[], None] | None = None,
    on_phase: PhaseHook | None = None,
    on_response: ResponseHook | None = None,
) -> InferResult:
    started = time.perf_counter()
    config = engine_config(job, options)
    t_load = time.perf_counter()
    if on_phase is not None:
        on_phase(f"loading the model {config.path}", "loading")
    with OfflineEngine(config) as engine:
        load_s = time.perf_counter() - t_load
        runner = _Runner(job, options, engine, on_request_done, on_phase, on_response)
        warmup_s = runner.warm_up(options.warmup)
        interrupted = False
        try:
            for batch in job.batches:
                runner.run_batch(batch)
        except KeyboardInterrupt:  # Ctrl-C: what finished is kept, the rest is reported as cancelled
            interrupted = True
            for item in job.items:
                if item.request_idx not in runner.responses:
                    runner.respond_failed(item, "interrupted before it finished", reason="cancelled")
        model_info = {
            "path": config.path,
            "name": engine.model.name,
            "device": engine.model.offload.device,
            "n_gpu_layers": engine.model.offload.n_gpu_layers,
            "n_threads": engine.model.n_threads,
            "n_slots": engine.model.n_slots,
            "n_ctx": engine.model.n_ctx,
            "seq_ctx": engine.model.seq_ctx,
        }
        if on_phase is not None:  # every response is final (and journaled): what is left is the teardown
            on_phase(CLOSING, "closing")
    responses = [runner.responses[i] for i in range(len(job.items))]
    failed = sum(1 for r in responses if r["finish_reason"] in ("error", "cancelled") or r.get("error"))
    document = {"input_file": job.input_file, "responses": responses}
    profile = job_profile(
        job, runner.batch_profiles, model_info, load_s, warmup_s, time.perf_counter() - started, failed
    )
    return InferResult(document, profile, failed, interrupted)


class _Runner:
    def __init__(
        self,
        job: InferJob,
        options: InferOptions,
        engine: OfflineEngine,
        on_done: Callable[[], None] | None,
        on_phase: PhaseHook | None = None,
        on_response: ResponseHook | None = None,
    ):
        self.job, self.options, self.engine, self.on_done = job, options, engine, on_done
        self.on_phase, self.on_response = on_phase, on_response
        self._decoding_started: set[int] = set()  # request_idx + 1 of those already announced to on_phase
        self.responses: dict[int, dict[str, Any]] = {}
        self.batch_profiles: list[dict[str, Any]] = []
        self._adapters: dict[str, str] = {}  # lora name -> GGUF path (converted once)
        self._base_dir = Path(job.input_file).resolve().parent
        self._media_caps = MediaCaps.from_dict(engine.scheduler.media_caps())

    # -- warm-up ---------------------------------------------------------------------------------
    def warm_up(self, runs: int) -> float:
        """Untimed runs of the first runnable request (short), so the profile measures a warm engine."""
        first = next((item for item in self.job.items if item.error is None and not item.request.media_parts), None)
        if runs <= 0 or first is None:
            return 0.0
        t0 = time.perf_counter()
        if self.on_phase is not None:
            runs_text = "1 untimed run" if runs == 1 else f"{runs} untimed runs"
            self.on_phase(f"running the warm-up ({runs_text} of request {first.request_idx + 1})", "warm-up")
        sampling = replace(first.request.sampling, max_tokens=min(8, first.request.sampling.max_tokens))
        # Nothing of the warm-up is left in the prefix cache: the timed run prefills its prompt for real.
        warm = [
            replace(
                first.request,
                request_id=f"#warm-up-{i}",
                sampling=sampling,
                lora_path=None,
                cache_lookup=False,
                cache_commit=CacheCommit.NONE,
            )
            for i in range(runs)
        ]
        self.engine.generate(warm)
        return time.perf_counter() - t0

    # -- one batch -------------------------------------------------------------------------------
    def run_batch(self, batch: InferBatch) -> None:
        items = [self.job.items[i] for i in batch.item_indices]
        error = batch.error
        lora_path = None
        if error is None and batch.lora_name is not None:
            try:
                lora_path = self._adapter(batch.lora_name)
            except EdgeLLMError as exc:
                error = f"lora_name {batch.lora_name!r}: {exc.message}"
            except OSError as exc:  # the conversion cache cannot be written (read-only, disk full)
                error = f"lora_name {batch.lora_name!r}: cannot prepare the adapter: {exc}"
        runnable: list[tuple[InferItem, EngineRequest]] = []
        for item in items:
            if error is not None or item.error is not None:
                self.respond_failed(item, error or item.error or "")
                continue
            try:
                runnable.append((item, self._engine_request(item, batch, lora_path)))
            except EdgeLLMError as exc:  # its image/audio: unreadable, outside the media folders, too large...
                sep = "." if exc.message.startswith("messages[") else ": "
                self.respond_failed(item, f"requests[{item.request_idx}]{sep}{exc.message}")
        if not runnable:
            self.batch_profiles.append({"batch_idx": batch.batch_idx, "requests": len(items), "error": error})
            return
        by_id = {request.request_id: (item, request) for item, request in runnable}

        def finished(out: RequestOutput) -> None:  # as each ends: Ctrl-C later keeps it
            self._respond(*by_id[out.request_id], out)
            self._tick()

        decoding = None
        if self.on_phase is not None:
            places = {rid: (item.request_idx + 1, None) for rid, (item, _) in by_id.items()}
            decoding = decoding_reporter(self.on_phase, places, len(self.job.items), self._decoding_started)
        outputs, stats = self.engine.generate(
            [request for _, request in runnable], on_finished=finished, on_decoding=decoding
        )
        self.batch_profiles.append(batch_profile(batch, len(items), outputs, stats))

    def _tick(self) -> None:
        if self.on_done is not None:
            self.on_done()

    def _adapter(self, name: str) -> str:
        if name not in self._adapters:
            from edgellm.engine.lora import gguf_adapter
            from edgellm.engine.lora_paths import resolve_adapter_path

            allowed = [self._base_dir, *self.options.lora_dirs]
            source = resolve_adapter_path(self.job.lora_weights[name], allowed, base_dir=self._base_dir)
            path = gguf_adapter(source, self.options.model.path, Path(self.options.lora_cache_dir))
            self._adapters[name] = str(path)
        return self._adapters[name]

    def _engine_request(self, item: InferItem, batch: InferBatch, lora_path: str | None) -> EngineRequest:
        sampling: SamplingParams = item.request.sampling
        n_vocab = self.engine.model.n_vocab
        unknown = sorted(t for t in sampling.logit_bias if t >= n_vocab)
        if unknown:
            # As TensorRT-Edge-LLM does with ids outside its vocabulary: the entry is ignored, with a warning.
            log.warning(
                "request %d: logit_bias token ids %s are not in the model's vocabulary (%d tokens); ignored",
                item.request_idx,
                unknown[:8],
                n_vocab,
            )
            sampling = replace(sampling, logit_bias={t: b for t, b in sampling.logit_bias.items() if t < n_vocab})
        messages, media = item.request.messages, []
        if item.request.media_parts:
            sources = MediaSources(media_dirs=(str(self._base_dir), *self.options.media_dirs))
            messages, media = load_content(
                messages, self._media_caps, sources, self.options.media_limits, base_dir=str(self._base_dir)
            )
        return replace(
            item.request,
            sampling=sampling,
            lora_path=lora_path,
            messages=messages,
            media=media,
            speculative=not batch.disable_spec_decode,  # batch-wide, as TensorRT-Edge-LLM applies it
        )

    # -- responses -------------------------------------------------------------------------------
    def _formatted(self, item: InferItem) -> str:
        request = item.request
        model = self.engine.model
        try:
            if not request.apply_chat_template:
                return raw_prompt_text(request.messages)
            return model.render_chat(
                request.messages,
                add_generation_prompt=request.add_generation_prompt,
                template_kwargs=request.template_kwargs,
            )
        except Exception:  # the template failed: the request itself reports why
            return ""

    def _base_response(self, item: InferItem) -> dict[str, Any]:
        return {
            "request_idx": item.request_idx,
            "batch_idx": item.batch_idx,
            "messages": item.messages,
            "formatted_complete_request": self._formatted(item) if item.error is None else "",
        }

    def respond_failed(self, item: InferItem, error: str, *, reason: str = "error") -> None:
        formatted = self._formatted(item) if item.error is None else ""
        self._final(failed_response(item, error, reason=reason, formatted=formatted))
        self._tick()

    def _final(self, response: dict[str, Any]) -> None:
        self.responses[response["request_idx"]] = response
        if self.on_response is not None:
            self.on_response(response)

    def _respond(self, item: InferItem, request: EngineRequest, out: RequestOutput) -> None:
        response: dict[str, Any] = {
            "output_text": out.text,
            **self._base_response(item),
            # A request with an error failed, whatever ended it (a guided output cut by the length limit
            # does not conform): `error` says why.
            "finish_reason": "error" if out.error else finish_reason(out),
        }
        if out.error:
            response["error"] = out.error
            if out.error.startswith("prompt is"):
                response["error"] += " (or raise --max-seq-len)"
        if out.logprobs is not None:
            response["logprobs"] = [
                [_candidate(c["token_id"], c["token"], c["bytes"], c["logprob"]) for c in entry.top_logprobs]
                for entry in out.logprobs
            ]
            # The sampled tokens themselves (top-K need not hold one at temperature > 0): their bytes,
            # concatenated, are exactly the generated text (before a stop string cut it).
            response["output_token_logprobs"] = [
                _candidate(e.token_id, e.token, e.bytes, e.logprob) for e in out.logprobs
            ]
        response["sampling_seed"] = request.sampling.seed
        response["usage"] = {
            "prompt_tokens": out.prompt_tokens,
            "generated_tokens": out.completion_tokens,
            "reused_prefix_tokens": out.cached_tokens,
        }
        self._final(response)


def _candidate(token_id: int, token: str, data: list[int], logprob: float) -> dict[str, Any]:
    return {"token_id": token_id, "token": token, "bytes": data, "logprob": logprob}


def finish_reason(out: RequestOutput) -> str:
    """The TensorRT-Edge-LLM names: end-of-sequence | max-length | stop-words | error | cancelled."""
    if out.finish_reason is FinishReason.STOP:
        return "stop-words" if out.stop_cause is StopCause.STOP_STRING else "end-of-sequence"
    if out.finish_reason is FinishReason.LENGTH:
        return "max-length"
    if out.finish_reason is FinishReason.ABORT:
        return "cancelled"
    return "error"

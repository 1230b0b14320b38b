"""The engine's requests that take no slot (EngineTask other than GENERATE).

- TOKENIZE, DETOKENIZE, RENDER: the model's own tokenizer and chat template, run in the scheduler's
  prepare pool (a 600 KB text delays only its own answer, never a decode step), answered as soon as
  they are done.
- EMBED: inputs are tokenized in the prepare pool, then batched on the embedding context
  (engine/embedder.py), one decode of at most `Embedder.n_ctx` tokens per engine step, between
  generation steps: like a prompt chunk, an embedding batch delays generation by one decode at most.

Each answer is a final EngineOutput whose `result` holds plain data (the vectors as a float32 array).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as L
import numpy as np

from edgellm.engine.embedder import MAX_SEQUENCES, Embedder, EmbeddingModel, cells, normalize
from edgellm.engine.model import LlamaModel
from edgellm.engine.types import EngineOutput, EngineRequest, EngineTask, FinishReason, Priority
from edgellm.engine.vocabulary import Vocabulary
from edgellm.errors import ContextLengthExceeded, EdgeLLMError, EngineError, ErrorType, InvalidRequest

log = logging.getLogger(__name__)


# While slots generate, embeddings get at most this share of the engine's decode time (generation keeps
# >= 80 % of its speed), in batches of at most BUSY_BATCH_CELLS cells (one batch holds a decode step up
# by ~0.2 s on 2 CPU cores); with no slot generating they take whole batches back to back.
EMBED_SHARE = 0.2
BUSY_BATCH_CELLS = 64
MAX_CREDIT_S = 1.0


@dataclass(eq=False)  # compared and hashed by identity: a job is in the queue once
class EmbedJob:
    """One EMBED request: its inputs' tokens (from the prepare pool), and the rows computed so far."""

    request: EngineRequest
    future: Future[list[list[int]]]
    rows: list[np.ndarray | None] = field(default_factory=list)
    next_input: int = 0  # inputs before this one are in a batch already
    started_at: float = field(default_factory=time.monotonic)

    @property
    def inputs(self) -> list[list[int]]:
        return self.future.result()


class Tasks:
    """The queue of slot-less requests; the scheduler adds to it and collects its outputs each step."""

    def __init__(self, model: LlamaModel, pool: ThreadPoolExecutor):
        self.model = model
        self.pool = pool
        config = model.config
        # The dedicated embedding model, loaded now (a bad file stops the engine at start, not a client's
        # first request); its context, like the generation model's, on the first embedding request.
        self.embed_model: Vocabulary = (
            EmbeddingModel(config.embedding_model_path, n_gpu_layers=model.offload.n_gpu_layers)
            if config.embedding_model_path
            else model
        )
        self.embed_ctx = (
            config.embedding_ctx if config.embedding_model_path else min(config.embedding_ctx, model.seq_ctx)
        )
        self.utility: list[tuple[EngineRequest, Future[dict[str, Any]]]] = []
        self.embeds: deque[EmbedJob] = deque()
        self.embedder: Embedder | None = None
        self.embedded_inputs = 0  # counters for /metrics
        self.embed_batches = 0
        self.credit_s = 0.0  # embedding decode time earned by generation steps (EMBED_SHARE)

    @property
    def n_embd(self) -> int:
        """The width of an embedding (0: embeddings are off)."""
        return int(L.llama_model_n_embd(self.embed_model.model)) if self.embed_ctx else 0

    # -- intake ------------------------------------------------------------------------------
    def add(self, request: EngineRequest) -> None:
        if request.task is EngineTask.EMBED:
            self.embeds.append(EmbedJob(request, self.pool.submit(self._embed_tokens, request)))
        else:
            self.utility.append((request, self.pool.submit(self._utility, request)))

    def pending(self) -> bool:
        return bool(self.utility or self.embeds)

    def ready(self) -> bool:
        """Whether step() has something to do now."""
        return any(f.done() for _, f in self.utility) or any(j.future.done() for j in self.embeds)

    def waiting(self) -> list[Future]:
        return [f for _, f in self.utility] + [j.future for j in self.embeds if not j.future.done()]

    # -- the step ----------------------------------------------------------------------------
    def earn(self, generation_s: float) -> None:
        """A generation decode took `generation_s`: embeddings may take their share of that much."""
        self.credit_s = min(MAX_CREDIT_S, self.credit_s + generation_s * EMBED_SHARE / (1 - EMBED_SHARE))

    def step(self, cancelled: set[str], *, generating: Priority | None = None) -> list[EngineOutput]:
        """Answers that are ready, and one embedding batch. While slots generate (`generating`: the highest
        lane among them) the batch is a small one, on credit earned by generation (earn()), unless an
        embedding request of a higher lane waits: that one goes at once, as it would preempt."""
        outputs: list[EngineOutput] = []
        for request, future in [(r, f) for r, f in self.utility if f.done()]:
            self.utility.remove((request, future))
            outputs.append(_answer(request, future))
        self._drop(outputs, cancelled)
        jobs = self._in_turn()
        if not jobs:
            return outputs
        outranks = generating is not None and jobs[0].request.priority.rank < generating.rank
        if generating is not None and self.credit_s <= 0 and not outranks:
            return outputs
        if outranks:  # without credit: only what outranks the generating lanes
            jobs = [j for j in jobs if j.request.priority.rank < generating.rank]
        batch = self._next_batch(jobs, BUSY_BATCH_CELLS if generating is not None else self.embed_ctx)
        t0 = time.perf_counter()
        self._run(batch, outputs)
        if generating is not None and not outranks:
            self.credit_s -= time.perf_counter() - t0
        return outputs

    def _drop(self, outputs: list[EngineOutput], cancelled: set[str]) -> None:
        """Embedding jobs cancelled, past their deadline, or whose inputs could not be prepared."""
        now = time.time()
        for job in list(self.embeds):
            reason = cancel_reason(job.request, cancelled, now)
            if reason is not None:
                self.embeds.remove(job)
                outputs.append(EngineOutput.failure(job.request.request_id, cancel_text(reason), None, reason))
            elif job.future.done() and job.future.exception() is not None:
                self.embeds.remove(job)
                outputs.append(_answer(job.request, job.future))

    def _in_turn(self) -> list[EmbedJob]:
        """The embedding jobs ready to run, in their turn: by lane, then the one served least so far (a
        1-input request sent during a 2,048-input one goes in the next batch; two big ones alternate), then
        arrival. A job still being tokenized waits for the next step."""
        ready = [j for j in self.embeds if j.future.done() and j.future.exception() is None]
        order = {id(j): i for i, j in enumerate(self.embeds)}
        return sorted(ready, key=lambda j: (j.request.priority.rank, j.next_input, order[id(j)]))

    def _next_batch(self, jobs: list[EmbedJob], budget: int) -> list[tuple[EmbedJob, int]]:
        """(job, input index) pairs for one decode: inputs of `jobs` in turn while they fit `budget` cells
        (the first input always goes: it fits the context, its request checked that)."""
        batch: list[tuple[EmbedJob, int]] = []
        lengths: list[int] = []
        for job in jobs:
            inputs = job.inputs
            if not job.rows:
                job.rows = [None] * len(inputs)
            while job.next_input < len(inputs):
                size = len(inputs[job.next_input])
                if batch and (len(batch) >= MAX_SEQUENCES or cells([*lengths, size]) > budget):
                    return batch
                batch.append((job, job.next_input))
                lengths.append(size)
                job.next_input += 1
        return batch

    def _run(self, batch: list[tuple[EmbedJob, int]], outputs: list[EngineOutput]) -> None:
        try:
            if self.embedder is None:
                self.embedder = Embedder(self.embed_model, self.embed_ctx, self.model.n_threads)
            rows = self.embedder.embed([job.inputs[i] for job, i in batch])
        except Exception as exc:  # the batch's requests fail, never the worker
            message, kind = (exc.message, exc.error_type) if isinstance(exc, EdgeLLMError) else (repr(exc), None)
            log.warning("embedding batch failed: %s", message, exc_info=not isinstance(exc, EdgeLLMError))
            for job in dict.fromkeys(job for job, _ in batch):
                self.embeds.remove(job)
                failure = EngineOutput.failure(job.request.request_id, message[:500], kind or ErrorType.ENGINE_ERROR)
                outputs.append(failure)
            return
        self.embed_batches += 1
        self.embedded_inputs += len(batch)
        for (job, i), row in zip(batch, rows, strict=True):
            job.rows[i] = row
        for job in dict.fromkeys(job for job, _ in batch):
            if job.next_input == len(job.inputs) and all(r is not None for r in job.rows):
                self.embeds.remove(job)
                outputs.append(self._embedding_output(job))

    def _embedding_output(self, job: EmbedJob) -> EngineOutput:
        matrix = np.stack(job.rows)
        if job.request.payload.get("normalize", True):
            matrix = normalize(matrix)
        n_tokens = sum(len(t) for t in job.inputs)
        out = EngineOutput(job.request.request_id, True, finish_reason=FinishReason.STOP, prompt_tokens=n_tokens)
        out.result = {"embeddings": matrix.astype(np.float32), "pooling": self.embedder.pooling}
        out.timings = {"embed_ms": 1000 * (time.monotonic() - job.started_at)}
        return out

    def close(self) -> None:
        if self.embedder is not None:
            self.embedder.close()
            self.embedder = None
        if isinstance(self.embed_model, EmbeddingModel):
            self.embed_model.close()

    # -- in the prepare pool -----------------------------------------------------------------
    def _embed_tokens(self, request: EngineRequest) -> list[list[int]]:
        """Each input's tokens: a string tokenized as text (control-token text stays text), with the
        BOS/EOS the vocabulary asks for; token ids as given. Each must fit the embedding context."""
        if self.embed_ctx == 0:
            raise InvalidRequest("embeddings are off on this node (embedding_ctx is 0)")
        model = self.embed_model
        out: list[list[int]] = []
        for i, item in enumerate(request.payload.get("inputs", [])):
            tokens = model.input_tokens(item) if isinstance(item, str) else model.checked_ids(item, f"input[{i}]")
            if not tokens:
                raise InvalidRequest(f"input[{i}] is empty", param="input")
            if len(tokens) > self.embed_ctx:
                raise ContextLengthExceeded(
                    f"input[{i}] is {len(tokens)} tokens; an embedding input holds at most {self.embed_ctx}"
                )
            out.append(tokens)
        if not out:
            raise InvalidRequest("input must not be empty", param="input")
        return out

    def _utility(self, request: EngineRequest) -> dict[str, Any]:
        model, p = self.model, request.payload
        if request.task is EngineTask.TOKENIZE:
            tokens = model.tokenize(p["content"], special=bool(p.get("parse_special", True)))
            if p.get("add_special"):
                tokens = model.with_special(tokens)
            if p.get("with_pieces"):  # llama-server's shape: each token with its text
                return {"tokens": [{"id": t, "piece": _piece_text(model.piece(t, special=True))} for t in tokens]}
            return {"tokens": tokens}
        if request.task is EngineTask.DETOKENIZE:
            tokens = model.checked_ids(p.get("tokens", []), "tokens")
            text = b"".join(model.piece(t, special=True) for t in tokens).decode("utf-8", "replace")
            return {"content": text}
        if request.task is EngineTask.RENDER:
            options = {
                "add_generation_prompt": request.add_generation_prompt,
                "template_kwargs": request.template_kwargs,
                "tools": request.tools,
            }
            room = model.seq_ctx - 1
            merged = False
            if request.apply_chat_template:
                rendered = model.render_prompt(request.messages, **options)
                prompt, merged = rendered.text, rendered.system_merged
                n = len(model.chat_tokens(request.messages, **options))
            else:
                prompt = "".join(str(m.get("content") or "") for m in request.messages)
                n = len(model.raw_tokens(request.messages))
            body = {"prompt": prompt, "n_tokens": n, "fits": n <= room, "seq_ctx": model.seq_ctx}
            if merged:  # the template has no system role: the system text went into the next turn
                body["system_role_merged"] = True
            return body
        raise EngineError(f"unknown engine task {request.task!r}")


def cancel_reason(request: EngineRequest, cancelled: set[str], now: float) -> FinishReason | None:
    """ABORT when the caller cancelled the request, TIMEOUT past its timeout, DEADLINE past its deadline_ms
    (wall clock), else None."""
    if request.request_id in cancelled:
        return FinishReason.ABORT
    if request.deadline is not None and now >= request.deadline:
        return FinishReason.TIMEOUT
    if request.answer_by is not None and now >= request.answer_by:
        return FinishReason.DEADLINE
    return None


def cancel_text(reason: FinishReason) -> str:
    texts = {FinishReason.TIMEOUT: "request timeout passed", FinishReason.DEADLINE: "request deadline_ms passed"}
    return texts.get(reason, "request cancelled")


def _piece_text(data: bytes) -> str | list[int]:
    """A token's text where it is valid UTF-8 on its own, else its bytes (llama-server's shape)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def _answer(request: EngineRequest, future: Future) -> EngineOutput:
    exc = future.exception()
    if exc is None:
        out = EngineOutput(request.request_id, True, finish_reason=FinishReason.STOP)
        out.result = future.result()
        out.prompt_tokens = int(out.result.get("n_tokens", 0)) if isinstance(out.result, dict) else 0
        return out
    if isinstance(exc, EdgeLLMError):
        return EngineOutput.failure(request.request_id, exc.message, exc.error_type)
    log.error("engine task %s failed", request.request_id, exc_info=exc)
    return EngineOutput.failure(
        request.request_id, f"internal error in the {request.task} task: {exc!r}"[:500], ErrorType.ENGINE_ERROR
    )

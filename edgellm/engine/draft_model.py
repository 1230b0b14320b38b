"""Draft-model speculation: a small GGUF with the target's vocabulary proposes each generating slot's
next tokens, in a llama.cpp context of its own.

The draft context mirrors the target's layout: as many KV cells, in one unified pool or one stream a slot
as the target's (n_seq_max = n_slots), sequence id = the slot's. For each sequence it remembers which tokens its KV
holds, so a call only feeds what the slot added since the last one (the tokens the target accepted and
sampled): the KV is cut back to the longest common prefix of those tokens and the slot's context, the
rest of the context is fed (a new prompt: in chunks of n_batch, all sequences together), then k steps of
one batched decode over every sequence still drafting. Draft tokens stay in the draft KV: most are
accepted, and the next call's common-prefix cut drops the ones that were not.

Each draft row is sampled exactly as the target samples its own rows (token_step.TokenStep): the same
penalties over the same history, the same sampler and the same (seed, output position) draw. With the
draft model equal to the target (and no grammar), each draft token is what the target will sample there,
so verification keeps all of them at any temperature; a smaller model of the same family proposes what it
would sample, and verification keeps the prefix on which the two agree. The output never depends on the
drafts (a draft token is kept only when it equals the target's own sample).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field

import llama_cpp as L
import numpy as np

from edgellm.engine.llama_load import can_drop_suffix, ensure_backend, free_llama, load_offloaded, pool_context
from edgellm.engine.sampler import apply_penalties, sample_row
from edgellm.engine.types import SamplingParams
from edgellm.engine.vocabulary import Vocabulary
from edgellm.errors import EngineError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftAsk:
    """One slot's request for drafts.

    context: the slot's prompt + generated tokens (the pending ones included: everything the target
    will have in its KV before the first draft); a context with a media stand-in (a negative id) gets
    no draft. k: draft tokens wanted. position: the output position of the first draft token (the
    slot's len(generated)): draft j is drawn with uniform_for(seed, position + j). history, generated:
    the slot's own lists (Slot.history, Slot.generated), for the penalties, as the target applies them;
    draft j sees them with drafts 0..j-1 appended, as the target's row j does.
    """

    seq_id: int
    context: list[int]
    k: int
    params: SamplingParams
    position: int
    history: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    # Where the target's prompt ends in `context`: the catch-up decodes the prompt apart from what follows
    # it, as the target did. llama.cpp's CPU results depend on a batch's shape (a 1001-token batch and a
    # 1000-token one give logits up to ~0.6 apart), so decoding prompt + first token as one batch would
    # leave the draft's KV slightly off the target's and turn some sampled drafts into misses.
    prompt_len: int = 0


@dataclass
class DraftStats:
    """Counters since the draft model was made (tests and /status read them)."""

    calls: int = 0
    decodes: int = 0  # llama_decode calls
    fed_tokens: int = 0  # tokens decoded: context catch-up and draft tokens
    catchup_tokens: int = 0  # of fed_tokens, the context catch-up part
    drafted_tokens: int = 0  # tokens proposed
    propose_s: float = 0.0


class DraftModel(Vocabulary):
    """Owns the draft model, its context and batch. Not thread-safe: the engine thread drives it."""

    def __init__(
        self,
        path: str,
        target: Vocabulary,
        *,
        n_slots: int,
        n_ctx: int,
        n_threads: int,
        n_gpu_layers: int,
        n_batch: int = 512,
        unified: bool = True,
    ):
        if not os.path.isfile(path):
            raise EngineError(f"draft model file not found: {path}")
        if n_slots < 1 or n_ctx < 1 or n_batch < 1:
            raise EngineError(f"draft model: n_slots, n_ctx and n_batch must be >= 1 ({n_slots}, {n_ctx}, {n_batch})")
        ensure_backend()
        self.path = path
        self.name = os.path.basename(path)
        self.n_slots = n_slots
        self.n_ctx = n_ctx  # cells of its KV cache, as many as the target's
        self.unified = unified  # one pool, as the target's (or one stream a slot)
        self.seq_ctx = n_ctx if unified else n_ctx // n_slots  # the most one sequence holds
        self.n_batch = n_batch
        self.n_threads = max(1, n_threads)
        self.ctx = None
        self.batch = None
        self.model = self._load(path, n_gpu_layers)
        try:
            self._init_vocab()
            self._check_vocabulary(target)
            self.ctx = self._new_context()
            self.memory = L.llama_get_memory(self.ctx)
            self.batch = L.llama_batch_init(n_batch, 0, 1)
        except BaseException:
            self.close()
            raise
        self.partial_trim = can_drop_suffix(self.model)
        self.n_params = int(L.llama_model_n_params(self.model))
        self.size_bytes = os.path.getsize(path)
        self.cached: dict[int, list[int]] = {}  # seq_id -> the tokens its KV holds, positions 0..n-1
        self.stats = DraftStats()
        self._step_ms: float | None = None  # EMA of one draft decode step (step_ms())
        log.info(
            "draft model %s ready: %d sequences over a pool of %d cells, %.0fM parameters, %d GPU layers",
            self.name,
            n_slots,
            n_ctx,
            self.n_params / 1e6,
            self.n_gpu_layers,
        )

    # -- loading -------------------------------------------------------------------------------
    def _load(self, path: str, n_gpu_layers: int) -> ctypes.c_void_p:
        model, self.n_gpu_layers, _ = load_offloaded(path, n_gpu_layers)
        return model

    def _check_vocabulary(self, target: Vocabulary) -> None:
        """Drafts are token ids of the target's vocabulary: the same ids must be the same pieces."""
        config = getattr(target, "config", None)  # LlamaModel: its path; another Vocabulary: its name
        target_name = getattr(config, "path", None) or getattr(target, "name", None) or "?"
        if self.n_vocab != target.n_vocab:
            raise EngineError(
                f"draft model {self.path} has a vocabulary of {self.n_vocab} tokens, the target model "
                f"{target_name} one of {target.n_vocab}: a draft model must share the target's vocabulary"
            )
        for t in range(self.n_vocab):
            mine, theirs = self.piece(t, special=True), target.piece(t, special=True)
            if mine != theirs:
                raise EngineError(
                    f"draft model {self.path} and the target model {target_name} differ at token {t} "
                    f"({mine!r} vs {theirs!r}): a draft model must share the target's vocabulary"
                )

    def _new_context(self) -> ctypes.c_void_p:
        # One unified pool, as in the target; a full pool fails a proposal, which the engine goes without.
        try:
            return pool_context(
                self.model,
                n_cells=self.n_ctx,
                n_seqs=self.n_slots,
                n_batch=self.n_batch,
                n_threads=self.n_threads,
                unified=self.unified,
            )
        except EngineError as exc:
            raise EngineError(f"draft model {self.path}: {exc.message}") from None

    def set_threads(self, n: int) -> None:
        """Threads for the next decodes (the engine's thread governor)."""
        self.n_threads = max(1, n)
        L.llama_set_n_threads(self.ctx, self.n_threads, self.n_threads)

    # -- drafting ------------------------------------------------------------------------------
    def propose(self, asks: list[DraftAsk]) -> list[list[int]]:
        """Draft tokens for each ask, in order (an empty list: no draft for it). Raises EngineError when
        a decode fails (the sequences it touched are cleared: the caller goes on without drafts)."""
        if self.ctx is None:
            raise EngineError("the draft model is closed")
        t0 = time.perf_counter()
        self.stats.calls += 1
        out: list[list[int]] = [[] for _ in asks]
        seen: set[int] = set()
        live: list[int] = []  # indices of the asks that draft
        for i, ask in enumerate(asks):
            if not 0 <= ask.seq_id < self.n_slots:
                raise EngineError(f"draft ask for sequence {ask.seq_id} outside [0, {self.n_slots - 1}]")
            if ask.seq_id in seen:
                raise EngineError(f"two draft asks for sequence {ask.seq_id} in one call")
            seen.add(ask.seq_id)
            ctx = ask.context
            # The draft KV holds the context and k - 1 draft tokens (the last one is never fed).
            if ask.k <= 0 or not ctx or len(ctx) >= self.seq_ctx or any(t < 0 or t >= self.n_vocab for t in ctx):
                continue
            live.append(i)
        if not live:
            return out
        try:
            rows = self._catch_up({i: asks[i] for i in live})
            t_steps, decodes_steps = time.perf_counter(), self.stats.decodes
            k = {i: min(asks[i].k, self.seq_ctx - len(asks[i].context)) for i in live}
            params = {i: dataclasses.replace(asks[i].params, num_logprobs=0) for i in live}
            drafting = list(live)
            for j in range(max(k.values())):
                feed: list[tuple[int, int, int]] = []  # (token, position, seq_id)
                still: list[int] = []
                for i in drafting:
                    ask, drafts = asks[i], out[i]
                    row = rows[i]
                    apply_penalties(row, params[i], [*ask.history, *drafts], [*ask.generated, *drafts])
                    token = sample_row(row, params[i], ask.position + j).token
                    if self.is_eog(token):
                        continue  # the target stops here: nothing to draft past it
                    drafts.append(token)
                    if len(drafts) < k[i]:
                        feed.append((token, len(ask.context) + j, ask.seq_id))
                        still.append(i)
                if not feed:
                    break
                got = self._decode([(t, p, s, True) for t, p, s in feed])
                rows = dict(zip(still, got, strict=True))
                drafting = still
        except EngineError:
            for i in live:
                self.forget(asks[i].seq_id)
            raise
        self.stats.drafted_tokens += sum(len(d) for d in out)
        elapsed = time.perf_counter() - t0
        self.stats.propose_s += elapsed
        # The price of a draft token is a draft step: the catch-up of a new prompt is a one-off, not counted.
        steps = self.stats.decodes - decodes_steps
        if steps > 0:
            ms = 1000 * (time.perf_counter() - t_steps) / steps
            self._step_ms = ms if self._step_ms is None else 0.8 * self._step_ms + 0.2 * ms
        return out

    def step_ms(self) -> float:
        """What one draft step (a batched decode) has cost lately: the price of each draft token in the
        scheduler's rule (draft.best_length). 0 until the first proposal."""
        return self._step_ms or 0.0

    def _catch_up(self, asks: dict[int, DraftAsk]) -> dict[int, np.ndarray]:
        """Bring each ask's sequence to its context: cut the KV to the common prefix of what it holds and
        the context, feed the rest (all sequences in the same batches). Returns, by the same keys, the
        logits row after each context's last token."""
        prompt_part: list[tuple[int, int, int, bool]] = []  # the prompts' tokens not in the KV yet
        entries: list[tuple[int, int, int, bool]] = []  # (token, position, seq_id, wants logits)
        owners: list[int] = []  # the key of each entry that wants logits, in entry order
        for key, ask in asks.items():
            ctx = ask.context
            keep = 0
            for a, b in zip(self.cached.get(ask.seq_id, []), ctx, strict=False):
                if a != b:
                    break
                keep += 1
            keep = self._trim(ask.seq_id, min(keep, len(ctx) - 1))  # the last token's row is needed: fed again
            self.cached[ask.seq_id] = list(ctx[:keep])
            split = min(max(keep, ask.prompt_len), len(ctx) - 1)
            prompt_part += [(ctx[pos], pos, ask.seq_id, False) for pos in range(keep, split)]
            entries += [(ctx[pos], pos, ask.seq_id, False) for pos in range(split, len(ctx))]
            entries[-1] = (*entries[-1][:3], True)
            owners.append(key)
            self.stats.catchup_tokens += len(ctx) - keep
        if prompt_part:
            self._decode(prompt_part)
        return dict(zip(owners, self._decode(entries), strict=True))

    def _trim(self, seq_id: int, keep: int) -> int:
        """Drop the sequence's KV from position `keep` on; returns what is kept (0 when only a full
        clear was possible: recurrent or sliding-window memory cannot drop a suffix)."""
        if keep > 0 and self.partial_trim and L.llama_memory_seq_rm(self.memory, seq_id, keep, -1):
            return keep
        L.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        return 0

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """Decode the entries (token, position, seq_id, wants logits) in batches of up to n_batch, in
        order; returns a copy of each wanted logits row, in entry order. Each fed token joins its
        sequence's `cached` list."""
        rows: list[np.ndarray] = []
        b = self.batch
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start : start + self.n_batch]
            b.n_tokens = len(chunk)
            for i, (token, pos, seq, want) in enumerate(chunk):
                b.token[i] = token
                b.pos[i] = pos
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = 1 if want else 0
            rc = L.llama_decode(self.ctx, b)
            self.stats.decodes += 1
            if rc != 0:
                raise EngineError(f"llama_decode returned {rc} in the draft model")
            self.stats.fed_tokens += len(chunk)
            for i, (token, _pos, seq, want) in enumerate(chunk):
                self.cached.setdefault(seq, []).append(token)
                if want:
                    ptr = L.llama_get_logits_ith(self.ctx, i)
                    if not ptr:
                        raise EngineError(f"the draft model returned no logits for batch row {i}")
                    rows.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
        return rows

    # -- sequences and lifetime ------------------------------------------------------------------
    def keep_prefix(self, seq_id: int, keep: int) -> None:
        """Keep at most the first `keep` positions of a sequence: a slot starting a request keeps as much
        of its draft KV as the target kept of its own. The rest is decoded again, as the target does,
        so the two KVs come from batches of the same shape (see DraftAsk.prompt_len)."""
        cached = self.cached.get(seq_id)
        if cached is None or len(cached) <= keep or self.ctx is None:
            return
        self.cached[seq_id] = cached[: self._trim(seq_id, keep)]

    def forget(self, seq_id: int) -> None:
        """Clear one sequence (its slot's KV was dropped, or the slot is gone)."""
        self.cached.pop(seq_id, None)
        if self.ctx is not None:
            L.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def close(self) -> None:
        """Free the batch, the context and the model; safe to call more than once."""
        free_llama(self)
        if hasattr(self, "cached"):
            self.cached.clear()

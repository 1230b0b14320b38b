"""Embeddings: a second llama.cpp context on the same weights, with pooling, beside the generation one.

The generation context's slots keep their KV and their prefix caches; embedding inputs are decoded
in a context of their own (`embeddings` on, one unified KV stream, up to MAX_SEQUENCES inputs per
decode, each its own sequence), so an embedding request never evicts a slot's cache and one decode
batches several inputs. The context is made on the first embedding request (a node that never
embeds pays nothing) and its KV is cleared before each batch: every input starts at position 0 of
an empty cache, so its vector does not depend on what it was batched with.

Pooling is the GGUF's own (`<arch>.pooling_type`: mean, cls, last, rank) where it declares one, else
mean over the input's tokens, the usual choice for decoder models (llama-server's default for them).
"""

from __future__ import annotations

import ctypes
import logging

import llama_cpp as L
import numpy as np

from edgellm.engine.llama_load import ensure_backend, load_model
from edgellm.engine.vocabulary import Vocabulary
from edgellm.errors import EngineError

log = logging.getLogger(__name__)

# Inputs in one decode; with the padding sequence the context holds 16 sequences, a divisor of its n_ctx
# (llama.cpp's graph reservation asserts on a sequence count that does not divide the batch).
MAX_SEQUENCES = 15
PAD_SEQ = MAX_SEQUENCES  # the padding sequence's id: its tokens fill gaps, nothing reads its output
# Where an input sits in the batch relative to tiles of TILE cells changes its vector: the CPU backend's
# kernels block the batch's rows by 16, and a row's result depends on its place in the block. Measured,
# llama.cpp 0.3.36: a 7-token text at cells 3-9 differs from the same text at cells 0-6 by ~1e-2 per
# token (~4e-5 in the normalised vector) on an AVX2 EPYC, while at cells 1-7, 2-8 or 16-22 it is
# bit-identical; another host measured ~3e-2 for cells 15-21. So every input starts on a tile boundary,
# as it does alone (cell 0); the gap before it is filled by the padding sequence. Measured: bit-identical
# rows alone and at cells 16/32/48/64 for texts of 1-15 tokens. Flash attention does not help: it
# switches kernels once a batch holds 64 cells, and differs by ~1e-2 across that line.
TILE = 16


def layout(lengths: list[int]) -> list[int]:
    """The first KV cell of each input, in order: the next tile boundary (a fresh cache fills cells in
    batch order)."""
    starts, cursor = [], 0
    for n in lengths:
        cursor = -(-cursor // TILE) * TILE
        starts.append(cursor)
        cursor += n
    return starts


def cells(lengths: list[int]) -> int:
    """The KV cells (padding included) a batch of inputs of these lengths takes."""
    return layout(lengths)[-1] + lengths[-1] if lengths else 0


POOLING_NAMES = {1: "mean", 2: "cls", 3: "last", 4: "rank"}


class EmbeddingModel(Vocabulary):
    """A dedicated embedding model (`embedding_model_path`: a BERT/bge/nomic/e5-style GGUF), loaded beside
    the generation model and freed with the engine; its own tokenizer and pooling."""

    def __init__(self, path: str, *, n_gpu_layers: int):
        ensure_backend()
        self.model = load_model(path, max(0, n_gpu_layers) if L.llama_supports_gpu_offload() else 0)
        self._init_vocab()
        self.name = path

    def close(self) -> None:
        if getattr(self, "model", None):
            L.llama_model_free(self.model)
            self.model = None


class Embedder:
    """Owns the embedding context. Not thread-safe: the engine thread drives it."""

    def __init__(self, model: Vocabulary, n_ctx: int, n_threads: int):
        self.model = model
        # One decode holds a whole batch of inputs: pooling is computed per micro-batch, so an input
        # split across two would be pooled wrong. n_batch = n_ubatch = n_ctx keeps them whole.
        self.n_ctx = n_ctx
        declared = _declared_pooling(model)
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_ctx
        cp.n_ubatch = n_ctx
        cp.n_seq_max = MAX_SEQUENCES + 1  # the inputs and the padding sequence
        cp.n_threads = n_threads
        cp.n_threads_batch = n_threads
        cp.embeddings = True
        cp.kv_unified = True
        cp.pooling_type = declared if declared is not None else L.LLAMA_POOLING_TYPE_MEAN
        if hasattr(cp, "flash_attn_type"):
            cp.flash_attn_type = 0  # off: its kernel switch at 64 cells would make vectors batch-dependent (TILE)
        self.ctx = L.llama_init_from_model(model.model, cp)
        if not self.ctx:
            raise EngineError("llama.cpp could not create the embedding context (out of memory?)")
        self.memory = L.llama_get_memory(self.ctx)
        self.pooling = POOLING_NAMES.get(int(L.llama_pooling_type(self.ctx)), "none")
        if self.pooling == "none":
            self.close()
            raise EngineError("this model's embedding context has no pooling; embeddings need a pooled vector")
        self.n_embd = int(L.llama_model_n_embd(model.model))
        self.batch = L.llama_batch_init(n_ctx, 0, 1)
        log.info("embedding context ready: %d tokens, %s pooling, %d dimensions", n_ctx, self.pooling, self.n_embd)

    def set_threads(self, n: int) -> None:
        L.llama_set_n_threads(self.ctx, n, n)

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """One decode of up to MAX_SEQUENCES inputs (their tokens together at most n_ctx); one pooled
        float32 row per input, as llama.cpp computes it (not normalised)."""
        lengths = [len(t) for t in inputs]
        n = cells(lengths)
        if not inputs or len(inputs) > MAX_SEQUENCES or n > self.n_ctx or not all(lengths):
            raise EngineError(f"embedding batch of {len(inputs)} inputs / {n} cells outside the context's bounds")
        L.llama_memory_clear(self.memory, True)
        b = self.batch
        i = pad_pos = 0

        def put(token: int, pos: int, seq: int) -> None:
            nonlocal i
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1  # pooling reads every token's output
            i += 1

        for seq, (tokens, start) in enumerate(zip(inputs, layout(lengths), strict=True)):
            while i < start:  # the padding sequence's positions go on from one gap to the next
                put(tokens[0], pad_pos, PAD_SEQ)
                pad_pos += 1
            for pos, token in enumerate(tokens):
                put(token, pos, seq)
        b.n_tokens = i
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise EngineError(f"llama_decode returned {rc} for an embedding batch")
        rows = np.empty((len(inputs), self.n_embd), dtype=np.float32)
        for seq in range(len(inputs)):
            ptr = L.llama_get_embeddings_seq(self.ctx, seq)
            if not ptr:
                raise EngineError(f"llama.cpp returned no pooled embedding for sequence {seq}")
            rows[seq] = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_embd,))
        return rows

    def close(self) -> None:
        if getattr(self, "batch", None) is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            L.llama_free(self.ctx)
            self.ctx = None


def _declared_pooling(model: Vocabulary) -> int | None:
    """The GGUF's `<arch>.pooling_type` (an integer in llama.cpp's enum), or None where it has none."""
    arch = model.meta("general.architecture")
    value = model.meta(f"{arch}.pooling_type") if arch else None
    if value is None or not value.strip().isdigit():
        return None
    kind = int(value)
    return kind if kind in POOLING_NAMES else None


def normalize(rows: np.ndarray) -> np.ndarray:
    """Each row scaled to unit L2 norm (a zero row stays zero)."""
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.where(norms == 0, 1.0, norms)

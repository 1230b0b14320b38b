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

from edgellm.engine.model import LlamaModel
from edgellm.errors import EngineError

log = logging.getLogger(__name__)

# Inputs in one decode; with the padding sequence the context holds 16, a divisor of its n_ctx (llama.cpp's
# graph reservation asserts on a count that does not divide it).
MAX_SEQUENCES = 15
# Each input starts at a KV cell that is a multiple of ALIGN: where an input's cells start inside an
# attention tile changes the kernel's path and its vector by ~1e-3 (measured on the CPU backend: a
# 7-token text at cell 15 vs cell 0 or 16). Aligned, a text's vector is the same alone or in any
# batch to float rounding (~5e-7). The gaps are filled by a padding sequence that nothing reads.
ALIGN = 16
PAD_SEQ = MAX_SEQUENCES  # the padding sequence's id (the context holds MAX_SEQUENCES + 1 sequences)


def cells(n_tokens: int) -> int:
    """The KV cells an input of n_tokens takes in a batch, its padding included."""
    return -(-n_tokens // ALIGN) * ALIGN


POOLING_NAMES = {1: "mean", 2: "cls", 3: "last", 4: "rank"}


class Embedder:
    """Owns the embedding context. Not thread-safe: the engine thread drives it."""

    def __init__(self, model: LlamaModel, n_ctx: int):
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
        cp.n_threads = model.n_threads
        cp.n_threads_batch = model.n_threads
        cp.embeddings = True
        cp.kv_unified = True
        cp.pooling_type = declared if declared is not None else L.LLAMA_POOLING_TYPE_MEAN
        if hasattr(cp, "flash_attn_type"):
            cp.flash_attn_type = 0  # as the generation context's default; results must not depend on it
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
        n = sum(cells(len(t)) for t in inputs)
        if not inputs or len(inputs) > MAX_SEQUENCES or n > self.n_ctx or any(not t for t in inputs):
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

        for seq, tokens in enumerate(inputs):
            for pos, token in enumerate(tokens):
                put(token, pos, seq)
            if seq < len(inputs) - 1:  # up to the next input's aligned start (a fresh cache fills in order)
                for _ in range(cells(len(tokens)) - len(tokens)):
                    put(tokens[-1], pad_pos, PAD_SEQ)
                    pad_pos += 1
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


def _declared_pooling(model: LlamaModel) -> int | None:
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

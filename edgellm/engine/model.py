"""The llama.cpp generation model and its one context, over llama-cpp-python's low-level bindings.

LlamaModel loads the model (engine/llama_load.py: the GPU ladder falls back to smaller pools, then the CPU),
makes the context and decodes batches into it; it trims, copies, saves and loads sequences of its KV pool.
The scheduler sees tokens, logits rows and sequence ids. llama.cpp return codes become `EngineError` at this
boundary. Its tokenizer (engine/vocabulary.py) and chat template (engine/chat_prompt.py) are the bases it
reads text with.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import sys

import llama_cpp as L
import numpy as np

from edgellm.engine import test_hooks
from edgellm.engine.chat_prompt import ChatPrompt
from edgellm.engine.config import ModelConfig
from edgellm.engine.cpu_share import affinity_cores
from edgellm.engine.llama_load import (
    OffloadInfo,
    can_drop_suffix,
    ensure_backend,
    free_llama,
    load_model,
    load_offloaded,
    pool_context,
    shrink_ladder,
)
from edgellm.engine.memory_costs import kv_cells
from edgellm.errors import EngineError

log = logging.getLogger(__name__)


# The patched llama.cpp's switch to its batch-invariant CPU attention kernel (ModelConfig.batch_invariant).
BATCH_INVARIANT_ENV = "EDGELLM_FA_BATCH_INVARIANT"


class KvNoRoom(EngineError):
    """llama_decode placed nothing: a sequence of the batch has no free cell after its own last one (a
    unified pool keeps each sequence's cells in position order: tools/llama_cpp/edgellm.patch), or the
    pool is full. The cache is as it was; the scheduler frees cells (preempts) and decodes the rest."""


def _joined(offload: OffloadInfo, reason: str) -> str:
    """A new fallback reason after any earlier one (a failed GPU load, then a context that did not fit)."""
    return f"{offload.fallback_reason}; {reason}" if offload.fallback_reason else reason


class LlamaModel(ChatPrompt):
    """Owns model + context + batch. Not thread-safe: one engine thread drives it."""

    def __init__(self, config: ModelConfig):
        if not os.path.isfile(config.path):
            raise EngineError(f"model file not found: {config.path}")
        ensure_backend()
        self.config = config
        hooks = test_hooks.current()  # off unless a test installed them (engine/test_hooks.py)
        self.offload = self._load(config, hooks.gpu_load_failure)
        self._init_vocab()
        self.n_embd = int(L.llama_model_n_embd(self.model))
        self.n_threads = config.n_threads or affinity_cores()
        self.n_slots = config.n_slots  # sequences decoding at once (the batch width)
        self.unified = config.kv_unified  # one KV pool (True) or n_ctx / n_slots cells owned by each slot
        streams = 1 if self.unified else config.n_slots
        if config.n_ctx // streams < 64:
            raise EngineError(f"n_ctx={config.n_ctx} leaves {config.n_ctx // streams} cells a sequence; need >= 64")
        self.n_ctx = config.n_ctx  # cells in the KV pool (the GPU ladder may make it smaller)
        self.ctx = self._context_on_gpu_or_cpu(config, hooks)
        self.n_ctx = int(L.llama_n_ctx(self.ctx))  # llama.cpp pads the pool to whole 256-cell steps
        self.n_ctx_train = int(L.llama_model_n_ctx_train(self.model)) or self.n_ctx
        # The most cells one request may hold: the whole pool (its slot's share when each slot owns its
        # cells), but never past the context the model was trained for (positions beyond it are noise, and
        # llama.cpp only warns).
        self.seq_ctx = min(self.n_ctx // streams, self.n_ctx_train)
        if self.n_ctx != config.n_ctx:
            # The GPU held a smaller pool (or llama.cpp padded it): whatever reads the config from here on
            # (the scheduler's limits, its messages) sees the pool actually made.
            config = dataclasses.replace(config, n_ctx=self.n_ctx)
            self.config = config
        self.memory = L.llama_get_memory(self.ctx)
        self.n_batch = config.n_batch
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        self.eog_tokens = [t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t)]
        self.eos_token = L.llama_vocab_eos(self.vocab)
        self.name = os.path.basename(config.path)
        self._init_chat(config.chat_template)
        self.partial_trim = self._memory_can_drop_suffix()

    # -- loading -------------------------------------------------------------------------------
    def _load(self, config: ModelConfig, force_gpu_failure: bool) -> OffloadInfo:
        self.model, on_gpu, fallback = load_offloaded(config.path, config.n_gpu_layers, force_failure=force_gpu_failure)
        n_layers = L.llama_model_n_layer(self.model)
        return OffloadInfo(bool(L.llama_supports_gpu_offload()), on_gpu, n_layers, fallback)

    def _context_on_gpu_or_cpu(self, config: ModelConfig, hooks: test_hooks.FaultHooks) -> ctypes.c_void_p:
        """The context. When it cannot be made with layers on the GPU (its KV pool and compute buffers did
        not fit next to the weights: shared memory on a Jetson), smaller pools are tried on the GPU first
        (shrink_ladder: the pool halved, the batch width kept); only when none fits is the model reloaded
        on the CPU and the context made there with the configured pool, as a failed GPU model load does.
        n_ctx ends as the pool made; the offload's fallback_reason (/health) says each step."""
        wanted = self.n_ctx
        try:
            return self._gpu_context(hooks, wanted)
        except EngineError as exc:
            if self.offload.n_gpu_layers == 0:
                raise
            first_error = exc
        failed = [wanted]
        for cells in shrink_ladder(wanted):
            try:
                ctx = self._gpu_context(hooks, cells)
            except EngineError:
                failed.append(cells)
                continue
            self.n_ctx = cells
            reason = (
                f"GPU context for a KV pool of {', '.join(map(str, failed))} cells did not fit ({first_error}); "
                f"running a pool of {cells} cells on the GPU"
            )
            log.warning("%s", reason)
            self.offload = dataclasses.replace(self.offload, fallback_reason=_joined(self.offload, reason))
            return ctx
        reason = (
            f"GPU context creation failed for a KV pool of {', '.join(map(str, failed))} cells ({first_error}); "
            f"retried on CPU with {wanted} cells"
        )
        log.warning("%s", reason)
        L.llama_model_free(self.model)
        self.model = load_model(config.path, 0)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.offload = OffloadInfo(self.offload.gpu_supported, 0, self.offload.n_layers, _joined(self.offload, reason))
        return self._new_context(wanted)

    def _gpu_context(self, hooks: test_hooks.FaultHooks, n_cells: int) -> ctypes.c_void_p:
        """A context with a pool of n_cells and the model as loaded; the test hooks stand in for a GPU that
        cannot hold it (on a machine without one, where the allocation would never fail)."""
        if self.offload.n_gpu_layers > 0:
            if hooks.gpu_context_failure:
                raise EngineError("GPU context failure forced by EDGELLM_FORCE_GPU_CONTEXT_FAILURE (test hook)")
            cap = hooks.gpu_context_max_cells
            cells = kv_cells(n_cells, 1 if self.unified else self.n_slots)
            if cap is not None and cells > cap:
                raise EngineError(
                    f"{cells} KV cells over the {cap} the pretend GPU holds (gpu_context_max_cells test hook)"
                )
        return self._new_context(n_cells)

    def limit_reason(self) -> str:
        """Why one request holds at most seq_ctx tokens, for the error that refuses a longer one."""
        trained = f"the model was trained for {self.n_ctx_train}"
        if self.unified:
            return f"the KV pool has {self.n_ctx} cells; {trained}"
        return (
            f"each of the {self.n_slots} slots owns {self.n_ctx // self.n_slots} of the KV cache's {self.n_ctx} "
            f"cells, kv_unified makes them one pool; {trained}"
        )

    def _memory_can_drop_suffix(self) -> bool:
        """Prefix KV reuse keeps positions [0, n) and drops the rest; recurrent state (Mamba, RWKV,
        hybrids) and sliding-window attention cannot do that reliably, so they re-process prompts."""
        return can_drop_suffix(self.model)

    def _new_context(self, n_cells: int) -> ctypes.c_void_p:
        config = self.config
        return pool_context(
            self.model,
            n_cells=n_cells,
            n_seqs=self.n_slots,
            n_batch=config.n_batch,
            n_threads=self.n_threads,
            flash_attn=config.flash_attn,
            kv_cache_type=config.kv_cache_type,
            unified=self.unified,
        )

    # -- decoding ------------------------------------------------------------------------------
    def decode(
        self, tokens: list[int], positions: list[int], seq_ids: list[int], want_logits: list[bool]
    ) -> np.ndarray:
        """Decode one batch; returns a copy of the logits rows, in batch order of want_logits."""
        n = len(tokens)
        if n == 0 or n > self.n_batch:
            raise EngineError(f"batch of {n} tokens outside [1, {self.n_batch}]")
        b = self.batch
        b.n_tokens = n
        for i in range(n):
            b.token[i] = tokens[i]
            b.pos[i] = positions[i]
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq_ids[i]
            b.logits[i] = 1 if want_logits[i] else 0
        self.select_attention_kernel()
        rc = L.llama_decode(self.ctx, b)
        if rc == 1 and self.unified:
            raise KvNoRoom("llama_decode found no KV cells for the batch (returned 1)")
        if rc != 0:
            raise EngineError(f"llama_decode returned {rc}")
        n_out = sum(1 for w in want_logits if w)
        if n_out == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        ptr = L.llama_get_logits(self.ctx)
        # The buffer is overwritten by the next decode: copy the rows out now. Into the array the
        # last decode returned when nobody holds it (or a view of it) any more: a fresh 1.5 MB array
        # each step can cost ~0.8 ms of page faults (measured: the allocator gives blocks of that size
        # back to the OS when they are freed). A caller that keeps rows across decodes (the scheduler's
        # bisecting retry) holds a reference, and gets a new array. Only small outputs are kept (at
        # most 32 rows: 6 MB).
        src = np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))
        spare = getattr(self, "_logits_spare", None)
        # Unheld: as many references as an object only this model holds, counted the same way (the
        # attribute, the local name; what getrefcount itself adds depends on the interpreter).
        probe = self.__dict__.setdefault("_logits_probe", object())
        if spare is not None and spare.shape[0] >= n_out and sys.getrefcount(spare) == sys.getrefcount(probe):
            out = spare[:n_out]
            np.copyto(out, src)
            return out
        out = src.copy()
        self._logits_spare = out if n_out <= 32 else None
        return out

    def select_attention_kernel(self) -> None:
        """Before each decode of this model's context: the CPU attention kernel its config asks for. The
        patched llama.cpp reads EDGELLM_FA_BATCH_INVARIANT at each call (tools/llama_cpp/edgellm.patch); a
        process-wide variable, so it is set for the model about to decode (tests hold several)."""
        want = "1" if self.config.batch_invariant else "0"
        if os.environ.get(BATCH_INVARIANT_ENV) != want:
            os.environ[BATCH_INVARIANT_ENV] = want

    def trim_sequence(self, seq_id: int, keep: int) -> bool:
        """Drop every cached position >= keep of one sequence (keep=0 clears it).

        False when only a full clear was possible (recurrent or sliding-window memory cannot drop a
        suffix): the caller must then prefill from position 0, not leave a gap.
        """
        if keep > 0 and not self.partial_trim:
            L.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
            return False
        if L.llama_memory_seq_rm(self.memory, seq_id, keep, -1):
            return True
        L.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        return keep == 0

    def copy_sequence(self, src: int, dst: int, keep: int) -> bool:
        """Make sequence `dst` hold positions [0, keep) of sequence `src` (n > 1 samples share one prefill,
        requests share a system prompt). In the unified pool the cells are shared, not copied: `dst` is
        added to the cells `src` holds there. False where the memory cannot drop a suffix (recurrent,
        SWA: a sequence's state is not a list of cells): `dst` is left empty then."""
        L.llama_memory_seq_rm(self.memory, dst, -1, -1)
        if not self.partial_trim or keep <= 0:
            return False
        if self.unified:
            L.llama_memory_seq_cp(self.memory, src, dst, 0, keep)
            return True
        # Each slot its own KV stream: llama.cpp copies between streams only whole (queued for the start of
        # the next llama_decode), then the positions >= keep are dropped from `dst`.
        L.llama_memory_seq_cp(self.memory, src, dst, -1, -1)
        return self.trim_sequence(dst, keep)

    def set_threads(self, n: int) -> None:
        """Threads for the next decodes (generation and prompt batches alike)."""
        L.llama_set_n_threads(self.ctx, n, n)

    def save_sequence(self, seq_id: int, path: str, tokens: list[int]) -> int:
        """Write sequence `seq_id`'s KV state and `tokens` (what it holds, positions 0..n-1) to `path`
        (llama.cpp's sequence state file); the bytes written, 0 when llama.cpp could not write it."""
        arr = (L.llama_token * max(1, len(tokens)))(*tokens)
        return int(L.llama_state_seq_save_file(self.ctx, os.fsencode(path), seq_id, arr, len(tokens)))

    def load_sequence(self, seq_id: int, path: str, max_tokens: int) -> list[int] | None:
        """Replace sequence `seq_id`'s KV with the state in `path` (saved by save_sequence); the tokens
        stored with it, or None when llama.cpp refused the file (unreadable, foreign, more than
        `max_tokens` tokens): the sequence is left empty then."""
        L.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        arr = (L.llama_token * max(1, max_tokens))()
        count = ctypes.c_size_t(0)
        read = L.llama_state_seq_load_file(self.ctx, os.fsencode(path), seq_id, arr, max_tokens, ctypes.byref(count))
        n = count.value
        # The KV must hold exactly the stored tokens' positions, 0..n-1 (a file saved with other tokens
        # than its sequence held, or made for another context layout, fails this).
        span = (L.llama_memory_seq_pos_min(self.memory, seq_id), L.llama_memory_seq_pos_max(self.memory, seq_id))
        if read == 0 or n == 0 or n > max_tokens or span != (0, n - 1):
            L.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
            return None
        return list(arr[:n])

    def sequence_state_size(self, seq_id: int) -> int:
        """The bytes sequence `seq_id`'s KV state takes in a state file (the tokens stored with it apart)."""
        return int(L.llama_state_seq_get_size(self.ctx, seq_id))

    def close(self) -> None:
        free_llama(self)

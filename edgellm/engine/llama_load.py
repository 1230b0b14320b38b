"""Loading a GGUF into llama.cpp and making its contexts: what the generation model, the draft model and the
embedding model share.

The backend's one-time init, a model loaded with its layers on the GPU (a failed GPU load retried on the
CPU: `load_offloaded`), the smaller pools the GPU ladder tries (`shrink_ladder`), a context over one KV pool
or a stream a slot (`pool_context`), whether a model's memory can drop a suffix (`can_drop_suffix`) and
freeing what an owner holds. Apart from engine/model.py (the one generation model and its context) because
engine/draft_model.py and engine/embedder.py load theirs the same way.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import llama_cpp as L

from edgellm.engine.memory_costs import CELL_ALIGN
from edgellm.errors import EngineError

log = logging.getLogger(__name__)


_backend_ready = False


@dataclass(frozen=True)
class OffloadInfo:
    gpu_supported: bool
    n_gpu_layers: int
    n_layers: int
    fallback_reason: str | None = None

    @property
    def device(self) -> str:
        return "gpu" if self.n_gpu_layers > 0 else "cpu"


def ensure_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        L.llama_backend_init()
        _backend_ready = True


def load_model(path: str, n_gpu_layers: int) -> ctypes.c_void_p:
    params = L.llama_model_default_params()
    params.n_gpu_layers = n_gpu_layers
    model = L.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise EngineError(f"llama.cpp could not load the model at {path} with n_gpu_layers={n_gpu_layers}")
    return model


def load_offloaded(
    path: str, n_gpu_layers: int, *, force_failure: bool = False
) -> tuple[ctypes.c_void_p, int, str | None]:
    """(model, layers on the GPU, why it fell back to the CPU or None). n_gpu_layers -1 = auto: every layer
    when llama.cpp can offload; a GPU load that fails is retried on the CPU."""
    wanted = n_gpu_layers
    if wanted < 0:
        wanted = 10_000 if L.llama_supports_gpu_offload() else 0  # llama.cpp clamps to the layer count
    if wanted > 0:
        try:
            if force_failure:
                raise EngineError("GPU load failure forced by EDGELLM_FORCE_GPU_FAILURE (test hook)")
            model = load_model(path, wanted)
            return model, min(wanted, int(L.llama_model_n_layer(model)) + 1), None
        except EngineError as exc:
            fallback = f"GPU load failed ({exc}); retried on CPU"
            log.warning("%s: %s", path, fallback)
    else:
        fallback = None
    return load_model(path, 0), 0, fallback


# The smallest pool the GPU ladder shrinks to (LlamaModel._context_on_gpu_or_cpu): below it the pool no
# longer holds a few chat turns at once, and the CPU with the configured pool serves better. A config that
# asks for less is never grown to it.
LADDER_MIN_CELLS = 1024


def shrink_ladder(n_cells: int, min_cells: int = LADDER_MIN_CELLS) -> list[int]:
    """The smaller pools (KV cells) to try, in order, after n_cells did not fit on the GPU: halved, on the
    256-cell steps llama.cpp allocates, down to min_cells or the configured size when that is smaller. The
    batch width (n_slots) stays: it costs compute buffers, not KV, and a request may still use all of a
    smaller pool."""
    pools: list[int] = []
    floor = min(min_cells, n_cells)
    cells = n_cells
    while cells > floor:
        cells = max(floor, cells // 2 // CELL_ALIGN * CELL_ALIGN)
        pools.append(cells)
    return pools


def pool_context(
    model: ctypes.c_void_p,
    *,
    n_cells: int,
    n_seqs: int,
    n_batch: int,
    n_threads: int,
    flash_attn: bool = True,
    kv_cache_type: str = "f16",
    unified: bool = True,
) -> ctypes.c_void_p:
    """A context of n_seqs sequences over one unified KV pool of n_cells cells (kv_unified: any sequence
    may take any free cell, and a prefix copied between sequences is shared, not duplicated); with
    unified False, each sequence owns n_cells / n_seqs of them (a KV stream of its own)."""
    cp = L.llama_context_default_params()
    cp.n_ctx = n_cells
    cp.n_batch = n_batch
    cp.n_ubatch = n_batch
    cp.n_seq_max = n_seqs
    cp.n_threads = n_threads
    cp.n_threads_batch = n_threads
    cp.kv_unified = unified
    if hasattr(cp, "flash_attn_type"):
        cp.flash_attn_type = -1 if flash_attn else 0  # -1 = auto
    if kv_cache_type != "f16":
        kv_type = {"q8_0": L.GGML_TYPE_Q8_0, "f32": L.GGML_TYPE_F32}.get(kv_cache_type)
        if kv_type is None:
            raise EngineError(f"kv_cache_type must be f16, q8_0 or f32, got {kv_cache_type!r}")
        cp.type_k = kv_type
        cp.type_v = kv_type
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise EngineError("llama.cpp could not create a context (out of memory?)")
    return ctx


def can_drop_suffix(model: ctypes.c_void_p) -> bool:
    """Whether a sequence's KV can be cut at a position: not recurrent (Mamba, RWKV, hybrids), not
    sliding-window attention."""
    for name in ("llama_model_is_recurrent", "llama_model_is_hybrid"):
        fn = getattr(L, name, None)
        if fn is not None and fn(model):
            return False
    n_swa = getattr(L, "llama_model_n_swa", None)
    return not (n_swa is not None and n_swa(model) > 0)


def free_llama(owner: Any) -> None:
    """Free `owner`'s llama.cpp `batch`, `ctx` and `model` (whichever it has); safe to call twice."""
    if getattr(owner, "batch", None) is not None:
        L.llama_batch_free(owner.batch)
        owner.batch = None
    if getattr(owner, "ctx", None):
        L.llama_free(owner.ctx)
        owner.ctx = None
    if getattr(owner, "model", None):
        L.llama_model_free(owner.model)
        owner.model = None

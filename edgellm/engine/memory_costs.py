"""What each part of a node's memory costs, in bytes, from a GGUF header's shape alone (nothing is loaded).

The weights' KV cells (kv_bytes_per_token, kv_cells: llama.cpp's 256-cell padding), the compute buffers
(compute_bytes), the embedding context, a draft model, the multimodal projector, the CUDA runtime. Apart
from memory_plan.py, which adds these up and chooses the context and slots: an estimate changes when
llama.cpp's allocation does, the plan when the node's policy does. engine/model.py reads the 256-cell
padding from here too.
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

from edgellm.engine.gguf_header import read_metadata
from edgellm.engine.shape import ModelShape

MIB = 1024**2
GIB = 1024**3

# Bytes per stored K or V element. q8_0 stores blocks of 32 values as 32 int8 plus one f16 scale: 34 bytes.
KV_BYTES_PER_ELEMENT: dict[str, float] = {"f16": 2.0, "f32": 4.0, "q8_0": 34 / 32}

# llama.cpp rounds the context up to a multiple of 256 cells; the engine's one unified KV pool
# (engine/llama_load.py: kv_unified) is a single stream of that many cells. With kv_unified off, each slot is a
# stream of its own, and llama.cpp rounds each one's share up to 256 cells as well.
CELL_ALIGN = 256

# What the CUDA runtime itself takes once llama.cpp offloads: the CUDA context (driver state plus the loaded
# kernels of ggml-cuda), the cuBLAS handle and its workspace, and llama.cpp's CUDA memory pools (scratch for
# dequantized weights and cuBLAS inputs, which grow to the largest batch). On a Jetson all of it comes out of
# the same unified memory as the weights and the KV cache. Published figures for the context alone:
#   - llama.cpp PR #23604 (ggml-org/llama.cpp, 2026-05): creating the primary context (cudaMemGetInfo)
#     "permanently eats" 107 MiB on an RTX 4060 Ti (34 SMs) and 555 MiB on an RTX PRO 6000 Blackwell; the
#     cost scales with the SM count;
#   - pytorch/pytorch#107667 (2023-08, ptrblck): ~300 MB for the context with CUDA >= 11.7 lazy module
#     loading, over 1000 MB before it; pytorch/pytorch#20532: 300-400 MB per process without lazy loading.
# JetPack 6 ships CUDA 12.2+, where lazy loading is the default on Linux (NVIDIA developer forums, "How to
# enable the CUDA's lazy module loading"), and an Orin has 4-16 SMs, so its context is at the small end; with
# cuBLAS (its handle and a few MiB of workspace) and the pools, 300 MiB is a conservative default. The
# setting cuda_context_mib sets it (0 leaves it out).
DEFAULT_CUDA_CONTEXT_BYTES = 300 * MIB

# Where the host shows a CUDA device without importing llama.cpp (the API process never does): a Jetson's
# L4T release file (as runtime/board/gpu_memory.py reads it), or a discrete NVIDIA GPU's driver nodes.
_CUDA_DEVICE_MARKERS = ("/etc/nv_tegra_release", "/dev/nvidia0", "/dev/nvhost-gpu", "/proc/driver/nvidia/gpus")

# Compute buffer estimate (see compute_bytes): a 10 % margin plus a fixed 8 MiB for the small host-side
# inputs (token ids, positions, output ids) and allocator alignment.
_COMPUTE_MARGIN = 1.10
_COMPUTE_FIXED = 8 * MIB
_F32 = 4


def kv_bytes_per_token(shape: ModelShape, kv_type: str = "f16") -> float:
    """Bytes one KV cell takes over all layers: a K and a V vector per KV head per layer."""
    if kv_type not in KV_BYTES_PER_ELEMENT:
        raise ValueError(f"kv_type must be one of {', '.join(KV_BYTES_PER_ELEMENT)}, got {kv_type!r}")
    elements = shape.n_layer * shape.n_head_kv * (shape.head_dim_k + shape.head_dim_v)
    return elements * KV_BYTES_PER_ELEMENT[kv_type]


def kv_cells(n_ctx: int, streams: int = 1) -> int:
    """KV cells llama.cpp allocates for n_ctx: one pool padded to a multiple of 256 (1000 -> 1024); over
    `streams` KV streams (kv_unified off: one a slot), the total padded, then each stream's share (1000 over
    3 streams: 1536)."""
    per_stream = max(1, n_ctx // streams)
    total = round_up(per_stream * streams, CELL_ALIGN)
    return round_up(total // streams, CELL_ALIGN) * streams


def compute_bytes(
    shape: ModelShape,
    n_batch: int,
    n_slots: int,
    n_ctx: int | None = None,
    *,
    flash_attn: bool = True,
    unified: bool = True,
) -> int:
    """Estimate of llama.cpp's compute buffers plus its logits output buffer, with a safety margin.

    llama.cpp reserves its compute buffer for the worst graph: a full ubatch (n_ubatch = n_batch here) with
    every token producing logits. Buffers are reused from layer to layer, so the size is the peak of two
    phases, in f32 activations per batch token:
      - output: the logits (n_vocab) next to the final hidden state and norms (~6 x n_embd);
      - a layer: the FFN's gate/up/activation (3 x n_ff), the residual, norm, Q/K/V and attention output
        (~8 x n_embd) and the attention mask over the pool's cells (in a unified pool a token may attend
        to any cell); without flash attention, also the full score matrix (n_head scores per cell).
    Checked against llama.cpp 0.3.36's printed "compute buffer size" for SmolLM2-135M (CPU, n_batch 512):
    102.5 MiB measured vs 102.8 estimated with flash attention; 166.4 vs 178 without it at 8192 cells a slot.
    Reports of CUDA runs match the same shape (the graph splits into a device buffer and a small host one).

    On top, the output buffer the logits are copied to: n_vocab f32 per output row, up to n_batch rows (it
    grows to the largest batch's outputs). The engine asks for at most 1 + 16 drafted rows per slot, so
    n_batch rows also covers the engine's own copy of those rows.

    n_ctx: the cache's cells; None = n_slots requests of min(n_ctx_train, 4096) each. unified: one pool (a
    token's mask spans all of it) or one stream a slot (the slot's share).
    """
    if n_batch < 1 or n_slots < 1:
        raise ValueError("n_batch and n_slots must be >= 1")
    if n_ctx is None:
        n_ctx = n_slots * min(shape.n_ctx_train, 4096)
    streams = 1 if unified else n_slots
    cells = kv_cells(n_ctx, streams) // streams
    n_tokens = min(n_batch, cells)  # llama.cpp caps the batch at the context for causal models
    n_ff = shape.n_ff or 8 * shape.n_embd
    output_phase = shape.n_vocab + 6 * shape.n_embd
    per_cell = 1 if flash_attn else 1 + shape.n_head  # mask, plus the scores without flash attention
    layer_phase = 3 * n_ff + 8 * shape.n_embd + per_cell * cells
    graph = _F32 * n_tokens * max(output_phase, layer_phase)
    output_buffer = _F32 * shape.n_vocab * n_batch
    return math.ceil((graph + output_buffer) * _COMPUTE_MARGIN) + _COMPUTE_FIXED


def embedding_bytes(shape: ModelShape, embedding_ctx: int, dedicated: ModelShape | None = None) -> int:
    """What embeddings cost: a dedicated model's weights, and the embedding context on the model that
    embeds (its f16 KV cells, one stream padded to 256, and its compute and output buffers for a batch of
    embedding_ctx tokens that all produce outputs, without flash attention). 0 when embedding_ctx is 0."""
    if embedding_ctx <= 0:
        return 0
    model = dedicated or shape
    cells = round_up(embedding_ctx, CELL_ALIGN)
    kv = math.ceil(cells * kv_bytes_per_token(model, "f16"))
    weights = dedicated.file_bytes if dedicated is not None else 0
    return weights + kv + compute_bytes(model, embedding_ctx, 1, cells, flash_attn=False)


def draft_bytes(draft: ModelShape, n_ctx: int, n_slots: int, n_batch: int, unified: bool = True) -> tuple[int, int]:
    """What a draft model costs: (its weights and compute buffers, its KV cache). Its context mirrors the
    target's (a unified f16 pool of n_ctx cells for n_slots sequences, n_batch tokens a batch, flash
    attention auto; one stream a slot without kv_unified)."""
    cells = kv_cells(n_ctx, 1 if unified else n_slots)
    kv = math.ceil(cells * kv_bytes_per_token(draft, "f16"))
    return draft.file_bytes + compute_bytes(draft, n_batch, n_slots, n_ctx, unified=unified), kv


def cuda_device_present(markers: tuple[str, ...] = _CUDA_DEVICE_MARKERS) -> bool:
    """Whether this host shows a CUDA device (a Jetson, or an NVIDIA GPU's driver), read from files only:
    the API process plans memory without importing llama.cpp. A CPU-only llama.cpp build on such a host
    is over-planned by cuda_bytes, never under-planned."""
    return any(os.path.exists(m) for m in markers)


# What a projector's graph holds per input token at its peak (f32 activations): the FFN (3 x n_ff: up,
# gate/activation, down's input), the residual, norms, Q/K/V and attention output (~8 x n_embd); the
# attention scores (n_head x n_tokens per token) come on top, as clip.cpp's encoder attends over all of them.
# Audio encoders (Whisper-style) see one 30 s window: 1500 positions after the conv stem.
_AUDIO_TOKENS = 1500


def projector_bytes(path: str | Path | None) -> int:
    """What the multimodal projector costs: its weights (the file, loaded whole) plus an estimate of its
    compute buffer for one input at the projector's own size (clip.vision.image_size / patch_size, or one
    audio window), read from the GGUF header. Dynamic-resolution projectors (Qwen2-VL tiling) may go above
    it for large images; the estimate is for the nominal input. 0 when path is None."""
    if path is None:
        return 0
    weights = Path(path).stat().st_size
    compute = 0
    for modality in ("vision", "audio"):
        keys = {
            "n_embd": f"clip.{modality}.embedding_length",
            "n_ff": f"clip.{modality}.feed_forward_length",
            "n_head": f"clip.{modality}.attention.head_count",
            "image": f"clip.{modality}.image_size",
            "patch": f"clip.{modality}.patch_size",
        }
        try:
            meta = read_metadata(path, keys.values())
        except (OSError, ValueError, struct.error):
            return weights  # llama.cpp reports an unreadable file when it loads it
        n_embd, n_ff, n_head = (_int(meta.get(keys[k])) for k in ("n_embd", "n_ff", "n_head"))
        if not n_embd:
            continue
        image, patch = _int(meta.get(keys["image"])), _int(meta.get(keys["patch"]))
        if modality == "vision":
            tokens = (image // patch) ** 2 + 1 if image and patch else 1024
        else:
            tokens = _AUDIO_TOKENS
        per_token = 3 * (n_ff or 4 * n_embd) + 8 * n_embd + max(1, n_head) * tokens
        compute = max(compute, math.ceil(_F32 * tokens * per_token * _COMPUTE_MARGIN) + _COMPUTE_FIXED)
    return weights + compute


def _int(value: object) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step

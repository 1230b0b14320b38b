"""The one seam for fault-injection test hooks of the model loader.

A test makes the GPU model load, or the GPU context, fail, to exercise the CPU fallback on a machine
without a GPU (settings EDGELLM_FORCE_GPU_FAILURE / EDGELLM_FORCE_GPU_CONTEXT_FAILURE); or pretends the
GPU holds only so many KV cells (gpu_context_max_cells), to exercise the smaller shapes tried on the GPU
before that fallback (engine/llama_load.py's shrink_ladder); or makes the projector's GPU init fail, to
exercise its retry on the CPU (engine/projector.py). They stand in for llama.cpp's failed allocations,
which a CPU build never makes. The hooks are installed here, once, by whoever starts the engine (the
worker, from its WorkerConfig; an engine test, directly); the loaders read them. Nothing on the
production path takes them as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FaultHooks:
    gpu_load_failure: bool = False  # pretend the GPU load ran out of memory
    gpu_context_failure: bool = False  # pretend the GPU context did not fit next to the weights
    # Pretend the GPU holds at most this many KV cells (as llama.cpp pads them): a context over it fails
    # as an out-of-memory one would. None: no limit. Only with layers on the GPU.
    gpu_context_max_cells: int | None = None
    gpu_projector_failure: bool = False  # pretend the projector's GPU init ran out of memory


_hooks = FaultHooks()


def install(hooks: FaultHooks) -> None:
    global _hooks
    _hooks = hooks


def current() -> FaultHooks:
    return _hooks

"""The one seam for fault-injection test hooks of the model loader.

A test makes the GPU model load, or the GPU context, fail, to exercise the CPU fallback on a machine
without a GPU (settings EDGELLM_FORCE_GPU_FAILURE / EDGELLM_FORCE_GPU_CONTEXT_FAILURE). The hooks are
installed here, once, by whoever starts the engine (the worker, from its WorkerConfig); the model
loader reads them. Nothing on the production path takes them as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FaultHooks:
    gpu_load_failure: bool = False  # pretend the GPU load ran out of memory
    gpu_context_failure: bool = False  # pretend the GPU context did not fit next to the weights


_hooks = FaultHooks()


def install(hooks: FaultHooks) -> None:
    global _hooks
    _hooks = hooks


def current() -> FaultHooks:
    return _hooks

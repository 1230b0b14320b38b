"""LoRA adapters in llama.cpp: load a GGUF adapter into a model, set the active one on its context, free them.

Step 3 of an adapter's way to the engine (engine/lora.py's overview): `load_adapter` / `apply_adapters` /
`free_adapter` drive llama.cpp's adapter API, and `AdapterCache` keeps the adapters loaded into one model
and which one is active. Apart from the conversion (engine/lora.py) because this is the only LoRA step that
needs llama_cpp: it is imported when called, in the engine process only; the scheduler imports this
module when a request first names an adapter.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edgellm.errors import EngineError, LoraError


def _llama() -> Any:
    import llama_cpp

    return llama_cpp


def load_adapter(model: Any, gguf_path: Path) -> Any:
    """Load a GGUF LoRA adapter into `model` (an object with a `.model` llama_model pointer)."""
    L = _llama()
    handle = L.llama_adapter_lora_init(model.model, os.fsencode(gguf_path))
    if not handle:
        raise LoraError(f"llama.cpp could not load the LoRA adapter {gguf_path} (its log says why)")
    return handle


def apply_adapters(model: Any, handles_and_scales: Sequence[tuple[Any, float]]) -> None:
    """Make exactly these adapters (with their scales) active on `model.ctx`; an empty list means none."""
    L = _llama()
    n = len(handles_and_scales)
    if n == 0:
        rc = L.llama_set_adapters_lora(model.ctx, None, 0, None)
    else:
        handles = (L.llama_adapter_lora_p_ctypes * n)(*(h for h, _ in handles_and_scales))
        scales = (ctypes.c_float * n)(*(float(s) for _, s in handles_and_scales))
        rc = L.llama_set_adapters_lora(model.ctx, handles, n, scales)
    if rc != 0:
        raise EngineError(f"llama_set_adapters_lora returned {rc}")


def free_adapter(handle: Any) -> None:
    """Free an adapter. It must not be active on any context, and its model must still be alive
    (llama.cpp frees the adapters left over together with their model)."""
    _llama().llama_adapter_lora_free(handle)


class AdapterCache:
    """The adapters loaded into one model, by GGUF path, and which one is active on its context.

    `activate(model, path, scale)` loads a path once and sets it (or, with None, no adapter) only when that
    changes. Close it before the model: `close()` clears the context and frees every adapter.
    """

    def __init__(self) -> None:
        self._model: Any = None
        self._handles: dict[str, Any] = {}
        self._active: tuple[str, float] | None = None

    @property
    def active(self) -> tuple[str, float] | None:
        return self._active

    @property
    def loaded(self) -> list[str]:
        return list(self._handles)

    def _bind(self, model: Any) -> None:
        if self._model is None:
            self._model = model
        elif self._model is not model:
            raise EngineError("this AdapterCache holds adapters of another model")

    def load(self, model: Any, gguf_path: str | Path) -> Any:
        self._bind(model)
        key = os.fspath(gguf_path)
        if key not in self._handles:
            self._handles[key] = load_adapter(model, Path(key))
        return self._handles[key]

    def activate(self, model: Any, gguf_path: str | Path | None, scale: float = 1.0) -> None:
        self._bind(model)
        if gguf_path is None:
            if self._active is not None:
                apply_adapters(model, [])
                self._active = None
            return
        if not math.isfinite(scale):
            raise LoraError(f"LoRA scale must be a finite number, got {scale!r}")
        want = (os.fspath(gguf_path), float(scale))
        if self._active == want:
            return
        handle = self.load(model, want[0])
        apply_adapters(model, [(handle, want[1])])
        self._active = want

    def drop_unused(self) -> int:
        """Free every adapter but the one active on the context (memory pressure): how many were freed.
        An adapter applies to the whole context, so the active one is the only one a running slot can be
        using; a later request naming a freed one loads it again from its file."""
        model = self._model
        if model is None or not getattr(model, "model", None):
            return 0
        keep = self._active[0] if self._active is not None else None
        unused = [key for key in self._handles if key != keep]
        for key in unused:
            free_adapter(self._handles.pop(key))
        return len(unused)

    def close(self) -> None:
        model, handles = self._model, self._handles
        self._handles, self._active = {}, None
        if model is None or not getattr(model, "model", None):
            return  # no model, or it is already freed and took its adapters along
        if getattr(model, "ctx", None):
            apply_adapters(model, [])
        for handle in handles.values():
            free_adapter(handle)

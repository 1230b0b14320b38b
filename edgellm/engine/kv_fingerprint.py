"""The identity of a model and context that a saved KV state belongs to: a state file made under another is foreign.

`fingerprint_parts(model)` covers everything that makes a llama.cpp sequence state foreign: the model file
(`file_identity`: its size, a sha256 of its GGUF header and first and last MiB, without reading all of it),
the slot's context size, the KV cache type, flash attention, the GPU layers and the llama-cpp-python
version, and the prefix store's folder FORMAT. `model_fingerprint` hashes them into the name of the prefix
store's folder (engine/prefix_store.py); engine/start_record.py keys a start's self-test record by the same
parts. Apart from the store: this says which model and layout a file is for, the store what it keeps.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from typing import TYPE_CHECKING

import llama_cpp as L

if TYPE_CHECKING:
    from edgellm.engine.model import LlamaModel

FORMAT = 1  # of the prefix store's folder (index.json and the .kv files in it): a new one starts a new folder
_MIB = 1024 * 1024
_HEADER_CAP = 64 * _MIB  # the most of a GGUF header hashed for the model's identity


def file_identity(path: str) -> str:
    """A model file's identity without reading all of it: its size and a sha256 of its GGUF header
    (capped at 64 MiB), its first MiB and its last MiB."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        head = _MIB
        try:
            from edgellm.engine.gguf_header import _tensor_layout  # where the tensor data starts

            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                head = max(head, min(_tensor_layout(m, path)[0], _HEADER_CAP))
        except Exception:  # not a readable GGUF header: its first MiB stands for it
            pass
        h.update(f.read(head))
        f.seek(max(0, size - _MIB))
        h.update(f.read(_MIB))
    return f"{size}-{h.hexdigest()}"


def model_fingerprint(model: LlamaModel) -> str:
    """The name of the folder a model's state files live in: a hash of everything that makes a state
    file foreign to this model and context (see fingerprint_parts)."""
    return fingerprint(fingerprint_parts(model))


def fingerprint_parts(model: LlamaModel) -> dict[str, object]:
    config = model.config
    return {
        "format": FORMAT,
        "model": file_identity(config.path),
        "seq_ctx": model.seq_ctx,
        "kv_cache_type": config.kv_cache_type,
        "flash_attn": config.flash_attn,
        "n_gpu_layers": model.offload.n_gpu_layers,
        "device": model.offload.device,
        "llama_cpp": L.__version__,
    }


def fingerprint(parts: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]

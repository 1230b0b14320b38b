"""The Ollama dialect's model routes: the bodies of `GET /api/tags`, `POST /api/show`, `GET /api/ps` and
`GET /api/version`, and what they tell of a model file (`ModelFacts`: read from the GGUF header, never by
loading it).

Ollama names a model by its registry tag; this node by its id (settings `model_name` or the GGUF file
name, or a `models:` entry's id) and the names in `model_aliases`, each listed as a model of its own.
`digest` is not the file's sha256 (reading gigabytes to list models would stall the route): it is the
sha256 of the file's path, size and modification time, which changes whenever the file does.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from edgellm.engine.gguf_header import read_scalars
from edgellm.engine.info import EngineInfo

# general.file_type (llama.cpp's LLAMA_FTYPE) -> Ollama's quantization_level
FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4",
}
VERSION = "0.12.0"  # the Ollama API version whose routes and shapes this node answers (docs/api/ollama.md)
FOREVER_ISO = "2318-08-15T00:00:00Z"  # Ollama's expires_at of a model kept loaded (keep_alive -1)


@dataclass(frozen=True)
class ModelFacts:
    """A served model's file as /api/tags and /api/show describe it."""

    id: str
    path: str
    size: int = 0
    modified_at: str = ""
    digest: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)  # the GGUF header's scalars (arrays as None)
    template: str = ""  # the chat template the node renders with (Jinja), as far as it is a file's text

    @classmethod
    def read(cls, model_id: str, path: str, chat_template: str | None = None) -> ModelFacts:
        """The facts of `path`; a file that cannot be read (moved since the start) is listed with what is known."""
        try:
            st = os.stat(path)
        except OSError:
            return cls(model_id, path)
        key = f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}".encode("utf-8", "backslashreplace")
        try:
            metadata = read_scalars(path)
        except (OSError, ValueError, struct.error):  # changed since the start, or truncated: no details
            metadata = {}
        template = str(metadata.get("tokenizer.chat_template") or "")
        if chat_template:  # the chat_template setting: a built-in name or a .jinja file
            template = _file_text(chat_template) or chat_template
        return cls(
            model_id,
            path,
            size=st.st_size,
            modified_at=datetime.fromtimestamp(st.st_mtime, timezone.utc).isoformat().replace("+00:00", "Z"),
            digest=hashlib.sha256(key).hexdigest(),
            metadata=metadata,
            template=template,
        )

    def details(self) -> dict[str, Any]:
        arch = str(self.metadata.get("general.architecture") or "")
        ftype = self.metadata.get("general.file_type")
        return {
            "parent_model": "",
            "format": "gguf",
            "family": arch,
            "families": [arch] if arch else None,
            "parameter_size": self.parameter_size(),
            "quantization_level": FILE_TYPES.get(ftype, str(ftype) if ftype is not None else ""),
        }

    def parameter_size(self) -> str:
        count = self.metadata.get("general.parameter_count")
        if isinstance(count, int) and count > 0:
            for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
                if count >= scale:
                    return f"{count / scale:.2f}".rstrip("0").rstrip(".") + unit
            return str(count)
        label = self.metadata.get("general.size_label")
        return str(label) if label else ""

    def model_info(self) -> dict[str, Any]:
        """The GGUF header's keys (arrays as null, as Ollama shows them without `verbose`), the chat
        template apart (it is `template`)."""
        return {k: v for k, v in self.metadata.items() if k != "tokenizer.chat_template"}


def tag_entry(name: str, facts: ModelFacts) -> dict[str, Any]:
    return {
        "name": name,
        "model": name,
        "modified_at": facts.modified_at,
        "size": facts.size,
        "digest": facts.digest,
        "details": facts.details(),
    }


def tags_body(models: list[ModelFacts], aliases: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """/api/tags: each served model, then each alias (as the model it stands for)."""
    by_id = {m.id: m for m in models}
    entries = [tag_entry(m.id, m) for m in models]
    entries += [tag_entry(name, by_id[target]) for name, target in aliases if target in by_id]
    return {"models": entries}


def capabilities(info: EngineInfo | None) -> list[str]:
    """What the model takes: completion and tools always (tool calls are guided decoding on any template),
    thinking where its template has a thinking block, vision with an image projector, insert (`suffix`)
    with fill-in-the-middle tokens, embedding where /api/embed answers. Before the model has loaded, only
    what every model has."""
    caps = ["completion", "tools"]
    if info is None:
        return caps
    if (info.chat_format or {}).get("thinking"):
        caps.append("thinking")
    if (info.media or {}).get("vision"):
        caps.append("vision")
    if (info.media or {}).get("audio"):
        caps.append("audio")
    if info.infill:
        caps.append("insert")
    if info.n_embd and info.embed_ctx:
        caps.append("embedding")
    return caps


def show_body(facts: ModelFacts, info: EngineInfo | None, *, verbose: bool = False) -> dict[str, Any]:
    """/api/show: the template, the node's parameters for it, the GGUF header's model_info, capabilities."""
    params = []
    if info is not None:
        params.append(f"num_ctx {info.seq_ctx}")
    model_info = facts.model_info()
    if not verbose:
        model_info = {k: v for k, v in model_info.items() if not isinstance(v, str) or len(v) <= 1024}
    return {
        "license": str(facts.metadata.get("general.license") or ""),
        "modelfile": f"# edgellm serves this model from its GGUF file\nFROM {facts.path}\n",
        "parameters": "\n".join(params),
        "template": facts.template,
        "details": facts.details(),
        "model_info": model_info,
        "capabilities": capabilities(info),
        "modified_at": facts.modified_at,
    }


def ps_entry(
    name: str, facts: ModelFacts, info: EngineInfo | None, size: int, expires_at: str | None
) -> dict[str, Any]:
    on_gpu = bool(info is not None and (info.offload or {}).get("n_gpu_layers"))
    return {
        "name": name,
        "model": name,
        "size": size,
        "digest": facts.digest,
        "details": facts.details(),
        "expires_at": expires_at or FOREVER_ISO,
        "size_vram": size if on_gpu else 0,
        "context_length": info.seq_ctx if info is not None else 0,
    }


def version_body(edgellm_version: str) -> dict[str, str]:
    return {"version": VERSION, "edgellm": edgellm_version}


def _file_text(path: str, limit: int = 1 << 20) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(limit)
    except OSError:
        return None

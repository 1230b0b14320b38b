"""A model's shape, read from its GGUF header without loading it: the one `ModelShape`.

Memory sizing (engine/memory_plan.py) needs the attention geometry, the vocabulary and the weights'
size; LoRA conversion (engine/lora.py) needs the architecture, each block's head counts and, with
`tensors=True`, every tensor's shape. Both read it here, through engine/gguf_header.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from edgellm import gguf_split
from edgellm.engine.gguf_header import array_length, read_header, read_metadata


@dataclass(frozen=True)
class ModelShape:
    n_layer: int
    n_head: int  # the most any block has (per-block counts: head_count)
    n_head_kv: int
    n_embd: int
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    n_vocab: int
    file_bytes: int
    n_ff: int = 0  # feed-forward width; 0 = unknown (estimated as 8 x n_embd, above common models' ratio)
    arch: str = ""
    head_count: tuple[int, ...] = ()  # per block (OpenELM-style models vary them)
    head_count_kv: tuple[int, ...] = ()
    # GGUF tensor name -> shape in HF order ([out, in] for a matrix); read only when asked (tensors=True)
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict, compare=False)

    @property
    def n_block(self) -> int:
        return self.n_layer

    @classmethod
    def from_gguf(cls, path: str | Path, *, tensors: bool = False) -> ModelShape:
        """Read the shape from the GGUF header. Raises ValueError when a key the sizing needs is missing.

        `{arch}.attention.head_count_kv` (or head_count) is a per-layer array in a few models (OpenELM-style
        variable attention): n_head / n_head_kv are then the largest any layer has (an over-estimate of the
        KV cache, never an under-estimate); a missing head_count_kv is read as llama.cpp does ("no GQA").
        """
        arch = read_metadata(path, ["general.architecture"]).get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ValueError(f"{path}: GGUF has no general.architecture")
        keys = {
            "n_layer": f"{arch}.block_count",
            "n_head": f"{arch}.attention.head_count",
            "n_head_kv": f"{arch}.attention.head_count_kv",
            "n_embd": f"{arch}.embedding_length",
            "head_dim_k": f"{arch}.attention.key_length",
            "head_dim_v": f"{arch}.attention.value_length",
            "n_ctx_train": f"{arch}.context_length",
            "n_vocab": f"{arch}.vocab_size",
            "n_ff": f"{arch}.feed_forward_length",
        }
        meta, shapes = read_header(path, keys.values(), tensors=tensors)

        def get(name: str) -> int | None:
            value = meta.get(keys[name])
            return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        def need(name: str) -> int:
            value = get(name)
            if value is None or value <= 0:
                raise ValueError(f"{path}: GGUF has no usable {keys[name]}; cannot size memory for a {arch} model")
            return value

        n_layer = need("n_layer")

        def per_block(name: str, default: tuple[int, ...] | None) -> tuple[int, ...]:
            value = meta.get(keys[name])
            if isinstance(value, tuple):
                if len(value) != n_layer:
                    raise ValueError(f"{path}: {keys[name]} has {len(value)} entries for {n_layer} blocks")
                return tuple(int(v) for v in value)
            if value is None and default is not None:
                return default
            return (need(name),) * n_layer

        heads = per_block("n_head", None)
        heads_kv = per_block("n_head_kv", heads)
        n_head, n_embd = max(heads), need("n_embd")
        if n_head <= 0:
            raise ValueError(f"{path}: GGUF has no usable {keys['n_head']}; cannot size memory for a {arch} model")
        head_dim_k = get("head_dim_k") or n_embd // n_head
        n_vocab = get("n_vocab") or array_length(path, "tokenizer.ggml.tokens")
        if not n_vocab:
            raise ValueError(f"{path}: GGUF has neither {keys['n_vocab']} nor tokenizer.ggml.tokens")
        return cls(
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=max(heads_kv) or n_head,
            n_embd=n_embd,
            head_dim_k=head_dim_k,
            head_dim_v=get("head_dim_v") or head_dim_k,
            n_ctx_train=need("n_ctx_train"),
            n_vocab=n_vocab,
            file_bytes=gguf_split.total_bytes(path),
            n_ff=get("n_ff") or 0,
            arch=arch,
            head_count=heads,
            head_count_kv=heads_kv,
            shapes=shapes,
        )

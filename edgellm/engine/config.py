"""How to load the model and size its context: plain data, importable without llama.cpp (the API
process builds it from the settings and hands it to the worker)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    path: str
    n_ctx: int = 8192  # cells of the KV cache
    n_slots: int = 8  # sequences decoding at once
    # True: one KV pool every sequence draws from (any request up to the whole of it, shared prefixes stored
    # once, preemption when it is full; each token after its sequence's cells: tools/llama_cpp/edgellm.patch).
    # False: each slot owns n_ctx / n_slots cells. With batch_invariant off, outputs in a pool depend on what
    # else runs (docs/jetson.md "Context per request: one KV pool").
    kv_unified: bool = True
    n_batch: int = 512
    n_threads: int = 0  # 0 = all free cores
    n_gpu_layers: int = -1  # -1 = auto: all layers when llama.cpp can offload, else 0
    flash_attn: bool = True
    # True: CPU flash attention runs edgellm's batch-invariant kernel (tools/llama_cpp/edgellm.patch), so a
    # sequence's logits are bit-identical whatever else its steps decode and wherever its cells sit, and a
    # preempted request continues exactly; it prefills as fast as llama.cpp's kernels and decodes long
    # contexts faster (docs/jetson.md "batch invariance"). False: llama.cpp's kernels by batch shape (in a
    # pool, outputs vary with load by up to ~1 logit). CUDA kernels are llama.cpp's either way.
    batch_invariant: bool = True
    kv_cache_type: str = "f16"  # or "q8_0": half the KV memory (needs flash attention for V)
    # True: the thread count follows the cores other processes leave free (engine/cpu_share.py), at
    # most n_threads; False: always n_threads.
    adaptive_threads: bool = True
    speculative: bool = True  # prompt-lookup drafts verified in the batch (engine/draft.py)
    # A small GGUF with the target's vocabulary (engine/draft_model.py): drafts come from it instead of
    # prompt lookup (None: prompt lookup). Only with speculative on.
    draft_model_path: str | None = None
    mmproj_path: str | None = None  # a multimodal projector GGUF made for this model (images, audio)
    # The chat template instead of the GGUF's (engine/chat_template.py): a built-in name ("chatml") or a
    # .jinja file's path; None: the GGUF's, ChatML when it has none.
    chat_template: str | None = None
    # /v1/embeddings: a dedicated embedding model (None: the generation model's weights, mean-pooled), and
    # the embedding context's size (the longest input, and the tokens of one batch); 0 turns embeddings off.
    embedding_model_path: str | None = None
    embedding_ctx: int = 512
    # The persistent prefix KV cache (engine/prefix_store.py): a folder for prefix state files that survive
    # restarts (None: off), and the most bytes its files may take (least recently used go first).
    prefix_cache_dir: str | None = None
    prefix_cache_bytes: int = 512 * 1024 * 1024

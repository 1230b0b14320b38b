#!/usr/bin/env python
"""Does llama.cpp's output for a sequence depend on where its cells sit in one unified KV pool?

Why the engine's default is each slot its own KV stream (kv_unified false, README "one KV pool"): with
llama-cpp-python 0.3.36, a sequence whose later tokens land in cells *before* its earlier ones (what holes
left by finished requests make routine in a shared pool) gets logits far from those of the same tokens
placed in order (measured on the bundled model: up to ~1.0, with f32 or f16 caches, flash attention on or
off), while any in-order placement is bit-identical. Run it after a llama.cpp bump: exit 0 when every
placement gives the same logits (then the pool could be the default again), 1 when they differ.

    .venv/bin/python tools/kv_layout_check.py [--model PATH] [--kv f16|q8_0|f32] [--no-flash-attn]

It drives the engine's LlamaModel directly: a prompt and a fixed continuation, decoded (a) alone at the
start of the pool, (b) after another sequence's cells, (c) with the continuation in a hole before the
prompt's cells. It loads a model: run it alone (flock /tmp/edgellm-cpu.lock ...).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import llama_cpp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgellm.engine.model import LlamaModel, ModelConfig  # noqa: E402
from edgellm.runtime.settings import bundled_model_path  # noqa: E402

PROMPT = "<|im_start|>user\nName a colour and an animal.<|im_end|>\n<|im_start|>assistant\n"
CONTINUATION = " The colour blue and the animal whale are both found in the ocean deep"
FILLER = "hello world " * 30


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF model (default: the bundled one)")
    ap.add_argument("--kv", default="f16", choices=("f16", "q8_0", "f32"), help="KV cache type")
    ap.add_argument("--no-flash-attn", action="store_true")
    args = ap.parse_args(argv)
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    path = args.model or bundled_model_path()
    config = ModelConfig(
        path=path, n_ctx=2048, n_slots=4, kv_unified=True, kv_cache_type=args.kv, flash_attn=not args.no_flash_attn
    )
    m = LlamaModel(config)
    try:
        prompt, continuation, filler = m.tokenize(PROMPT), m.tokenize(CONTINUATION), m.tokenize(FILLER)
        n = len(prompt)

        def prefill(seq: int, tokens: list[int]) -> np.ndarray:
            wanted = [False] * (len(tokens) - 1) + [True]
            return m.decode(tokens, list(range(len(tokens))), [seq] * len(tokens), wanted)[-1].copy()

        def generate(seq: int) -> list[np.ndarray]:
            return [m.decode([t], [n + i], [seq], [True])[-1].copy() for i, t in enumerate(continuation)]

        alone = [prefill(0, prompt), *generate(0)]  # (a) cells 0.. in order
        m.trim_sequence(0, 0)
        prefill(1, filler)
        after = [prefill(2, prompt), *generate(2)]  # (b) after another sequence's cells, in order
        m.trim_sequence(2, 0)
        prefill(2, prompt)
        m.trim_sequence(1, 0)  # a hole before the prompt's cells
        m.trim_sequence(2, n - 1)  # the last prompt token and the continuation go into the hole
        hole = [m.decode(prompt[-1:], [n - 1], [2], [True])[-1].copy(), *generate(2)]  # (c)

        def worst(a: list[np.ndarray], b: list[np.ndarray]) -> float:
            return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))

        in_order, out_of_order = worst(alone, after), worst(alone, hole)
        print(f"llama-cpp-python {llama_cpp.__version__}: kv {args.kv}, flash attention {not args.no_flash_attn}")
        print(f"  in order, after another sequence: largest logit difference {in_order:.6f}")
        print(f"  continuation in a hole before the prompt's cells: largest logit difference {out_of_order:.6f}")
        same = in_order == 0.0 and out_of_order == 0.0
        print("same logits in every placement" if same else "logits depend on where the cells sit")
        return 0 if same else 1
    finally:
        m.close()


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Does the engine's output for a sequence depend on where its cells sit in one unified KV pool, or on what
else its steps decode?

Stock llama-cpp-python 0.3.36 says yes, in three ways (measured on the bundled model): a sequence whose later
tokens land in cells *before* its earlier ones (what holes left by finished requests make routine in a
shared pool) gets logits up to ~1.0 apart; and the CPU flash-attention kernel is picked by the whole batch's
shape (a tiled kernel for 64+ query rows, a KV-split one for a lone row over 512+ cells, a row kernel
otherwise), each summing in another order. The engine's build patches both (tools/llama_cpp/edgellm.patch:
each token after its sequence's cells; a batch-invariant kernel, with batch_invariant), and this check proves it:
it runs every case with batch_invariant on and off, and exits 0 when every case with it on gives
bit-identical logits, 1 when any differs (off is reported, not judged). Run it after a llama.cpp bump or a
patch change.

    .venv/bin/python tools/kv_layout_check.py [--model PATH] [--kv f16|q8_0|f32] [--no-flash-attn]

It drives the engine's LlamaModel directly: a prompt of 100+ tokens and a fixed continuation decoded token
by token (a) alone at the start of the pool, (b) after 600 cells of another sequence, (c) with a hole left
before the prompt's cells when the continuation is decoded, (d) beside another sequence decoding in the
same steps, and (e) re-fed in one batch with the prompt (how a preempted request resumes): the last logits
of (e) must equal those of (a). It loads a model: run it alone (flock /tmp/edgellm-cpu.lock ...).
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
from edgellm.runtime.model_sizing import bundled_model_path  # noqa: E402

PROMPT = (
    "<|im_start|>system\nYou are a careful assistant who answers in one short sentence, naming things plainly "
    "and never adding a list, a heading or a question of your own. Keep to what was asked.<|im_end|>\n"
    "<|im_start|>user\nName a colour and an animal, and say where the animal lives.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
CONTINUATION = " The colour blue and the animal whale are both found in the ocean deep"
FILLER = "hello world " * 300


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF model (default: the bundled one)")
    ap.add_argument("--kv", default="f16", choices=("f16", "q8_0", "f32"), help="KV cache type")
    ap.add_argument("--no-flash-attn", action="store_true")
    args = ap.parse_args(argv)
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    path = args.model or bundled_model_path()
    same = {}
    for invariant in (True, False):
        config = ModelConfig(
            path=path,
            n_ctx=2048,
            n_slots=4,
            kv_unified=True,
            kv_cache_type=args.kv,
            flash_attn=not args.no_flash_attn,
            batch_invariant=invariant,
        )
        same[invariant] = check(LlamaModel(config), args)
    # The guarantee is batch_invariant's; the default kernels are reported, not judged.
    return 0 if same[True] else 1


def prefill(m: LlamaModel, seq: int, tokens: list[int]) -> np.ndarray:
    """Decode `tokens` as sequence `seq` from position 0, in n_batch chunks as the engine prefills; the
    last token's logits."""
    for start in range(0, len(tokens), m.n_batch):
        chunk = tokens[start : start + m.n_batch]
        wanted = [start + len(chunk) == len(tokens)] * len(chunk)
        rows = m.decode(chunk, list(range(start, start + len(chunk))), [seq] * len(chunk), wanted)
    return rows[-1].copy()


def check(m: LlamaModel, args: argparse.Namespace) -> bool:
    try:
        prompt, continuation, filler = m.tokenize(PROMPT), m.tokenize(CONTINUATION), m.tokenize(FILLER)
        n = len(prompt)

        def generate(seq: int) -> list[np.ndarray]:
            return [m.decode([t], [n + i], [seq], [True])[-1].copy() for i, t in enumerate(continuation)]

        def clear() -> None:
            for seq in range(4):
                m.trim_sequence(seq, 0)

        alone = [prefill(m, 0, prompt), *generate(0)]  # (a) cells 0.. in order
        clear()
        prefill(m, 1, filler)
        after = [prefill(m, 2, prompt), *generate(2)]  # (b) after another sequence's 600 cells
        clear()
        prefill(m, 1, filler[:40])
        prefill(m, 2, prompt)
        m.trim_sequence(1, 0)  # (c) a hole before the prompt's cells when the continuation comes
        m.trim_sequence(2, n - 1)
        hole = [m.decode(prompt[-1:], [n - 1], [2], [True])[-1].copy(), *generate(2)]
        clear()
        prefill(m, 1, filler)  # (d) beside a sequence that decodes in the same steps
        prefill(m, 3, filler[:200])
        beside = [prefill(m, 2, prompt)]
        for i, t in enumerate(continuation):
            rows = m.decode([t, filler[200 + i]], [n + i, 200 + i], [2, 3], [True, True])
            beside.append(rows[0].copy())
        clear()
        refed = prefill(m, 2, prompt + continuation)  # (e) re-fed at once, as a preempted request resumes
        clear()

        def worst(a: list[np.ndarray], b: list[np.ndarray]) -> float:
            return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))

        cases = {
            "(b) after another sequence's cells": worst(alone, after),
            "(c) a hole before its cells": worst(alone, hole),
            "(d) beside another sequence in every step": worst(alone, beside),
            "(e) prompt and continuation re-fed in one batch": worst(alone[-1:], [refed]),
        }
        kernels = "batch-invariant kernel" if m.config.batch_invariant else "llama.cpp's kernels by shape"
        print(
            f"llama-cpp-python {llama_cpp.__version__}: kv {args.kv}, flash attention {not args.no_flash_attn}, "
            f"{kernels}"
        )
        for name, diff in cases.items():
            print(f"  {name}: largest logit difference {diff:.6f}")
        same = all(d == 0.0 for d in cases.values())
        print("  same logits in every case" if same else "  logits depend on placement or batch")
        return same
    finally:
        m.close()


if __name__ == "__main__":
    sys.exit(main())

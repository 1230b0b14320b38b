#!/usr/bin/env python
"""The batch-invariant CPU attention kernel (batch_invariant: true, the default) against llama.cpp's own
kernels (batch_invariant: false), in the same build and the same run.

The engine's LlamaModel is driven directly (no server): one model over a pool of 8192 cells, 8 sequences,
the machine's threads, in turns invariant, llama.cpp, invariant (`--turns 5`: on), each turn loading the
model afresh. Each turn measures
  prefill: one sequence's prompt of N tokens (in n_batch chunks, as the engine prefills) -> tokens/s;
  decode: 16 tokens one at a time after that prompt -> ms a token at N tokens of context;
  4 sequences of 1,500 tokens decoding together -> ms a step;
  quality: the mean negative log-likelihood of 1,535 tokens of this repository's docs (nats; lower is
    better; the two kernels sum in other orders, so they differ by rounding, not by more).
Each llama.cpp turn is read against the invariant turns either side of it (bracket ratios).

    .venv/bin/python tools/bench/attention_kernel.py [--lengths 128,512,1024,2048] [--turns 3] [--kv f16]
        [--model PATH] [--out results.json]

It loads a model: run it alone (flock /tmp/edgellm-cpu.lock ...). tools/kv_layout_check.py proves the
invariance itself; this measures its price.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgellm.engine.model import LlamaModel, ModelConfig  # noqa: E402
from edgellm.runtime.model_sizing import bundled_model_path  # noqa: E402
from tools.bench.results import Table, bracket_ratios, turns, write_results  # noqa: E402
from tools.kv_layout_check import prefill  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FILLER = "The quick brown fox jumps over the lazy dog near the river bank while it rains. " * 600
SIDES = ("invariant", "llama.cpp")


def measure(path: str, invariant: bool, lengths: list[int], kv: str) -> dict:
    m = LlamaModel(ModelConfig(path=path, n_ctx=8192, n_slots=8, batch_invariant=invariant, kv_cache_type=kv))
    try:
        filler = m.tokenize(FILLER)
        out: dict = {"prefill_tok_s": {}, "decode_ms": {}}
        for n in lengths:
            tokens = filler[:n]
            t0 = time.perf_counter()
            prefill(m, 0, tokens)
            out["prefill_tok_s"][n] = n / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i in range(16):
                m.decode([filler[i]], [n + i], [0], [True])
            out["decode_ms"][n] = (time.perf_counter() - t0) / 16 * 1000
            m.trim_sequence(0, 0)
        for seq in range(4):
            prefill(m, seq, filler[seq * 10 : seq * 10 + 1500])
        t0 = time.perf_counter()
        for i in range(16):
            m.decode([filler[i]] * 4, [1500 + i] * 4, [0, 1, 2, 3], [True] * 4)
        out["four_seqs_step_ms"] = (time.perf_counter() - t0) / 16 * 1000
        for seq in range(4):
            m.trim_sequence(seq, 0)
        text = (REPO / "README.md").read_text() + (REPO / "docs" / "architecture.md").read_text()
        tokens = m.tokenize(text)[:1536]
        nll = []
        for start in range(0, len(tokens), m.n_batch):
            chunk = tokens[start : start + m.n_batch]
            rows = m.decode(chunk, list(range(start, start + len(chunk))), [0] * len(chunk), [True] * len(chunk))
            for i in range(len(chunk)):
                if start + i + 1 < len(tokens):
                    row = rows[i].astype(np.float64)
                    row -= row.max()
                    nll.append(float(np.log(np.exp(row).sum()) - row[tokens[start + i + 1]]))
        out["nll"] = statistics.fmean(nll)
        return out
    finally:
        m.close()


def report(runs: dict[str, list[dict]], lengths: list[int]) -> str:
    inv, ref = runs["invariant"], runs["llama.cpp"]

    def row(table: Table, name: str, get, fmt: str, higher_is_better: bool) -> None:
        a, b = [get(r) for r in inv], [get(r) for r in ref]
        # each llama.cpp turn against the invariant turns around it, as "how much better is invariant"
        brackets = bracket_ratios(a, b)  # invariant / llama.cpp
        ratios = brackets if higher_is_better else [1 / x for x in brackets]
        table.add(
            name,
            fmt.format(statistics.fmean(a)),
            fmt.format(statistics.fmean(b)),
            ", ".join(f"{x:.2f}x" for x in ratios),
        )

    t = Table("measure", "invariant", "llama.cpp", "invariant / llama.cpp (per bracket)")
    for n in lengths:
        row(t, f"prefill {n} tokens, tok/s", lambda r, n=n: r["prefill_tok_s"][n], "{:.0f}", True)
    for n in lengths:
        row(t, f"decode at {n} tokens, ms a token", lambda r, n=n: r["decode_ms"][n], "{:.1f}", False)
    row(t, "4 sequences at 1,500, ms a step", lambda r: r["four_seqs_step_ms"], "{:.1f}", False)
    t.add(
        "mean NLL of 1,535 doc tokens (nats)",
        f"{statistics.fmean(r['nll'] for r in inv):.4f}",
        f"{statistics.fmean(r['nll'] for r in ref):.4f}",
        "-",
    )
    return str(t) + "\n\n(ratio > 1x: the invariant kernel is faster; decode rows: llama.cpp's ms over invariant's)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the bundled SmolLM2-135M)")
    ap.add_argument("--lengths", default="128,512,1024,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--turns", type=int, default=3, help="turns in all, odd, >= 3 (invariant first and last)")
    ap.add_argument("--kv", default="f16", choices=("f16", "q8_0", "f32"), help="KV cache type")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.turns < 3 or args.turns % 2 == 0:
        ap.error("--turns must be odd and at least 3")
    lengths = [int(x) for x in args.lengths.split(",")]
    if any(n < 1 or n > 6000 for n in lengths):
        ap.error("--lengths must be between 1 and 6000 (a 1,500-token x 4 part shares the 8192-cell pool)")
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    path = args.model or bundled_model_path()
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for turn in turns(SIDES, args.turns):
        print(f"turn {turn.number}: {turn.side}", flush=True)
        runs[turn.side].append(measure(path, turn.side == "invariant", lengths, args.kv))
    results = {"model": path, "kv": args.kv, "lengths": lengths, "runs": runs}
    write_results(results, report(runs, lengths), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

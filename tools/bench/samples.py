#!/usr/bin/env python
"""n samples of one prompt (one request with n) vs n separate requests of it, in one run.

On the in-process engine (the node's scheduler, n_slots = n): the same prompt, temperature 0.8,
sample i of the n-request uses seed + i and separate request i that seed too. Prints, per prompt
length, the prompt tokens decoded (the n-request decodes the prompt once, plus one token per other
sample), the wall time, total completion tokens per second and the ratio. Runs alternate (noise
hits both sides alike); the median of --runs is reported.

    python tools/bench/samples.py [--n 8] [--max-tokens 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgellm.engine.config import ModelConfig  # noqa: E402
from edgellm.engine.types import EngineRequest, SamplingParams  # noqa: E402
from edgellm.offline import OfflineEngine  # noqa: E402
from edgellm.runtime.model_sizing import bundled_model_path  # noqa: E402
from tools.bench.prompts import REPORT  # noqa: E402  (the same maintenance log as the speculation bench)
from tools.bench.results import Table, times, turns  # noqa: E402
from tools.bench.servers import run_main  # noqa: E402

PROMPTS = {
    "short question": "Suggest a name for a greenhouse robot.",
    "one log (~200 tok)": f"Write a one-line headline for this log.\n\n{REPORT}",
    "four logs (~800 tok)": "Write a one-line headline for these logs.\n\n" + "\n\n".join([REPORT] * 4),
}


def run(engine: OfflineEngine, prompt: str, n: int, together: bool, max_tokens: int, tag: str):
    messages = [{"role": "user", "content": prompt}]

    def request(rid: str, seed: int, samples: int) -> EngineRequest:
        sampling = SamplingParams(temperature=0.8, seed=seed, max_tokens=max_tokens)
        return EngineRequest(rid, messages, sampling, cache_lookup=False, n=samples)

    if together:
        requests = [request(f"{tag}-n", 1000, n)]
    else:
        requests = [request(f"{tag}-{i}", 1000 + i, 1) for i in range(n)]
    outs, stats = engine.generate(requests)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    tokens = sum(o.completion_tokens for o in outs)
    return tokens / stats.wall_s, stats.prompt_tokens, stats.wall_s, outs[0].prompt_tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=bundled_model_path())
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    config = ModelConfig(path=args.model, n_ctx=2048 * args.n, n_slots=args.n)
    print(f"n = {args.n}, {args.max_tokens} tokens each", flush=True)
    table = Table("prompt", "tokens", "decoded sep.", "decoded n", "tok/s sep.", "tok/s n", "ratio", stream=True)
    with OfflineEngine(config) as engine:
        run(engine, PROMPTS["short question"], 2, True, 4, "warm")
        for name, prompt in PROMPTS.items():
            measured: dict[bool, list] = {False: [], True: []}  # separate requests, then one with n
            for turn in turns((False, True), 2 * args.runs):
                tag = f"{name[:5]}-{'t' if turn.side else 's'}{turn.round}"
                measured[turn.side].append(run(engine, prompt, args.n, turn.side, args.max_tokens, tag))
            separate, together = measured[False], measured[True]
            a = statistics.median(r[0] for r in separate)
            b = statistics.median(r[0] for r in together)
            table.add(name, separate[0][3], separate[0][1], together[0][1], f"{a:.1f}", f"{b:.1f}", times(b, a))
    return 0


if __name__ == "__main__":
    run_main(main)

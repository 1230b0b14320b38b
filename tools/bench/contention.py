#!/usr/bin/env python
"""Throughput with one busy competing process vs alone, with the adaptive thread policy and with fixed threads.

An edge CPU is shared with camera and sensor pipelines. The engine (in-process, one slot, the bundled
model) generates 128 tokens per request, 3 requests per measurement (median tok/s), in four conditions:
alone / beside a busy loop (one process spinning one core), each with `thread_policy: fixed` (n_threads
= every core) and `adaptive` (engine/cpu_share.py). Ratios are against "alone, fixed", measured in the
same run. The adaptive runs give the governor 3 s with the competitor before measuring.

    python tools/bench/contention.py [--tokens 128]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgellm.engine.config import ModelConfig  # noqa: E402
from edgellm.engine.types import EngineRequest, SamplingParams  # noqa: E402
from edgellm.offline import OfflineEngine  # noqa: E402
from edgellm.runtime.model_sizing import bundled_model_path  # noqa: E402
from tools.bench.results import Table, times  # noqa: E402
from tools.bench.servers import run_main  # noqa: E402

# Both end tokens banned: every request generates exactly --tokens tokens.
NO_END = {0: -100.0, 2: -100.0}


def measure(engine: OfflineEngine, tokens: int, runs: int = 3) -> float:
    rates = []
    for i in range(runs):
        sampling = SamplingParams(temperature=0.0, max_tokens=tokens, logit_bias=NO_END)
        request = EngineRequest(
            f"c{time.monotonic_ns()}-{i}", [{"role": "user", "content": "Tell me a story."}], sampling
        )
        outs, stats = engine.generate([request])
        rates.append(outs[0].completion_tokens / stats.wall_s)
    return statistics.median(rates)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=bundled_model_path())
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    rows = []
    for policy in ("fixed", "adaptive"):
        config = ModelConfig(path=args.model, n_ctx=2048, n_slots=1, adaptive_threads=policy == "adaptive")
        with OfflineEngine(config) as engine:
            measure(engine, 16, 1)  # warm-up
            alone = measure(engine, args.tokens)
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                if policy == "adaptive":  # the governor needs two readings (about 2 s) to act
                    end = time.monotonic() + 3.0
                    while time.monotonic() < end:
                        measure(engine, 16, 1)
                contended = measure(engine, args.tokens)
            finally:
                busy.kill()
            threads = engine.scheduler.threads.current
        rows.append((policy, alone, contended, threads))
    base = rows[0][1]
    table = Table("policy", "alone tok/s", "busy tok/s", "busy/alone", "vs fixed alone", "threads")
    for policy, alone, contended, threads in rows:
        table.add(policy, f"{alone:.1f}", f"{contended:.1f}", times(contended, alone), times(contended, base), threads)
    table.print()
    return 0


if __name__ == "__main__":
    run_main(main)

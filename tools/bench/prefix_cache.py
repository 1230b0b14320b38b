#!/usr/bin/env python
"""The persistent prefix cache: time to first token of a request behind a ~1,000-token system prompt,
warm (the slot's own cache), after a restart (restored from the prefix file), and cold (a restart with
no file: the whole prompt prefilled), in one run.

In-process engines on the bundled model, one at a time (2 cores: never two engines decoding at once):
  1. engine A on a fresh state folder: two requests with the system prompt (the second reuses the
     first's prefix: it is saved), then --runs warm requests (the slot's cache serves them);
  2. engine B on the same folder (a restart): --runs requests, each on a freshly started engine, so
     each is the first after a restart and restores the file;
  3. engine C on an empty folder: the same, each one the first after a restart with nothing saved.
Each restarted engine runs its start-up self-test first, as the node's worker does before it takes
requests (the prefix files found at start are checksummed in the background meanwhile).
Prints the median TTFT of each and the ratios restored / warm (goal <= 1.5) and cold / warm.

    python tools/bench/prefix_cache.py [--runs 5] [--system-tokens 1000]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgellm.engine.config import ModelConfig  # noqa: E402
from edgellm.engine.types import EngineRequest, SamplingParams  # noqa: E402
from edgellm.offline import OfflineEngine  # noqa: E402
from edgellm.runtime.model_sizing import bundled_model_path  # noqa: E402
from tools.bench.results import Table, times  # noqa: E402
from tools.bench.servers import run_main  # noqa: E402


def system_prompt(model, tokens: int) -> str:
    """Numbered farm rules until the system message alone is about `tokens` tokens."""
    rules: list[str] = []
    while True:
        i = len(rules)
        rules.append(
            f"Rule {i}: when sensor S-{i} in row {i % 17} reads above {30 + i % 40} percent moisture, close "
            f"valve V-{i}, log the time and the reading, and tell the operator on duty."
        )
        text = "You are the maintenance assistant of a farm. Follow these rules.\n" + "\n".join(rules)
        if len(model.chat_tokens([{"role": "system", "content": text}])) >= tokens:
            return text


def ttft_ms(engine: OfflineEngine, rid: str, system: str, question: str) -> tuple[float, int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    request = EngineRequest(rid, messages, SamplingParams(temperature=0.0, max_tokens=4))
    out = engine.generate([request])[0][0]
    if out.error:
        raise SystemExit(f"request {rid} failed: {out.error}")
    return out.timings["ttft_ms"], out.cached_tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=bundled_model_path())
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=1000)
    args = p.parse_args()
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    saved = tempfile.mkdtemp(prefix="edgellm-prefix-bench-")

    def config(folder: str) -> ModelConfig:
        return ModelConfig(path=args.model, n_ctx=8192, n_slots=4, prefix_cache_dir=folder)

    with OfflineEngine(config(saved)) as engine:
        system = system_prompt(engine.core.model, args.system_tokens)
        n_system = len(engine.core.model.chat_tokens([{"role": "system", "content": system}]))
        ttft_ms(engine, "first", system, "What do I do when S-3 reads 40 percent?")
        ttft_ms(engine, "second", system, "Which valve goes with sensor S-7?")  # reuses the prefix: saved
        files = engine.core.scheduler.prefix_store.stats()
        warm = [ttft_ms(engine, f"warm{i}", system, f"Who is told about sensor S-{i}?") for i in range(args.runs)]
    restored, cold = [], []
    for i in range(args.runs):  # each request the first after a (re)start
        with OfflineEngine(config(saved)) as engine:
            engine.core.warm_up()
            restored.append(ttft_ms(engine, f"restored{i}", system, f"Who is told about sensor S-{i}?"))
        with OfflineEngine(config(tempfile.mkdtemp(prefix="edgellm-prefix-cold-"))) as engine:
            engine.core.warm_up()
            cold.append(ttft_ms(engine, f"cold{i}", system, f"Who is told about sensor S-{i}?"))
    w, r, c = (statistics.median(t for t, _ in xs) for xs in (warm, restored, cold))
    print(f"system prompt: {n_system} tokens; prefix files: {files['entries']} ({files['bytes'] / 2**20:.1f} MiB)")
    table = Table("case", "TTFT ms (median)", "prompt tokens reused")
    table.add("warm (the slot cache)", f"{w:.1f}", warm[0][1])
    table.add("after a restart, prefix file", f"{r:.1f}", restored[0][1])
    table.add("after a restart, no file (cold)", f"{c:.1f}", cold[0][1])
    table.print()
    print(f"restored / warm {times(r, w)} (goal <= 1.5x); cold / warm {times(c, w)}; cold / restored {times(c, r)}")
    return 0


if __name__ == "__main__":
    run_main(main)

#!/usr/bin/env python
"""Embeddings: the engine's batching vs one input per decode vs llama-cpp-python's create_embedding, and
chat generation while embeddings run, in one run.

Part 1, in-process on the bundled model (each side alone on the CPU, one after the other):
  - llama-cpp-python's high-level `Llama(embedding=True).create_embedding(texts)` (mean pooling, the
    same context size): the baseline;
  - the engine (engine/tasks.py), 256 requests of one text each, submitted one after the other
    (batch 1: each waits for the one before);
  - the engine, the same 256 requests submitted at once (the engine batches them across requests).
  Inputs/s, tokens/s and the ratios; the median of --runs.
Part 2, a real node (`edgellm serve`): 4 chat clients' completion tokens/s for --seconds, alone and
while one client posts /v1/embeddings of 16 texts back to back; the ratio (goal >= 0.8).

    python tools/bench/embeddings.py [--texts 256] [--runs 3] [--seconds 20]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgellm.engine.config import ModelConfig  # noqa: E402
from edgellm.engine.core import EngineCore  # noqa: E402
from edgellm.engine.types import EngineOutput, EngineRequest, EngineTask  # noqa: E402
from edgellm.runtime.model_sizing import bundled_model_path  # noqa: E402
from tools.bench.results import Table, times  # noqa: E402
from tools.bench.servers import EdgellmNode, run_main  # noqa: E402

EMBED_CTX_TOKENS = ModelConfig.embedding_ctx  # the engine's default embedding context, for the baseline too
TOPICS = ("the weather", "a greenhouse robot", "battery health", "a delivery drone", "the harvest", "a sensor fault")


def texts(n: int) -> list[str]:
    """Short texts of 6-20 tokens, all different."""
    return [f"Note {i}: a short remark about {TOPICS[i % len(TOPICS)]} on day {i // len(TOPICS)}." for i in range(n)]


def baseline(model: str, items: list[str]) -> tuple[float, int]:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=model,
        embedding=True,
        n_ctx=EMBED_CTX_TOKENS,
        n_batch=EMBED_CTX_TOKENS,
        n_ubatch=EMBED_CTX_TOKENS,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        verbose=False,
    )
    try:
        t0 = time.perf_counter()
        out = llm.create_embedding(items)
        wall = time.perf_counter() - t0
        return wall, int(out["usage"]["prompt_tokens"])
    finally:
        llm.close()


def engine_run(core: EngineCore, items: list[str], together: bool, tag: str) -> tuple[float, int]:
    outs: list[EngineOutput] = []

    def request(i: int) -> EngineRequest:
        return EngineRequest(f"{tag}-{i}", [], task=EngineTask.EMBED, payload={"inputs": [items[i]]})

    t0 = time.perf_counter()
    if together:
        for i in range(len(items)):
            core.add(request(i))
        core.run_until_idle(on_output=lambda o: outs.append(o) if o.finished else None)
    else:
        for i in range(len(items)):
            core.add(request(i))
            core.run_until_idle(on_output=lambda o: outs.append(o) if o.finished else None)
    wall = time.perf_counter() - t0
    assert len(outs) == len(items) and all(o.error is None for o in outs), [o.error for o in outs if o.error][:3]
    return wall, sum(o.prompt_tokens for o in outs)


def part1(model: str, n: int, runs: int) -> None:
    items = texts(n)
    results: dict[str, list[tuple[float, int]]] = {"create_embedding": [], "engine, batch 1": [], "engine": []}
    core = EngineCore(ModelConfig(path=model, n_ctx=2048, n_slots=4), max_waiting=max(64, n))
    try:
        engine_run(core, items[:8], True, "warm")  # makes the embedding context
        for r in range(runs):
            results["engine, batch 1"].append(engine_run(core, items, False, f"one{r}"))
            results["engine"].append(engine_run(core, items, True, f"all{r}"))
    finally:
        core.close()
    for _ in range(runs):
        results["create_embedding"].append(baseline(model, items))
    base = statistics.median(w for w, _ in results["create_embedding"])
    print(f"\n{n} texts, median of {runs} runs")
    table = Table("", "inputs/s", "tokens/s", "vs create_embedding")
    for name, rows in results.items():
        wall = statistics.median(w for w, _ in rows)
        tokens = rows[0][1]
        table.add(name, f"{n / wall:.1f}", f"{tokens / wall:.1f}", times(base, wall))  # walls: baseline over this
    table.print()


def part2(seconds: float) -> None:
    with tempfile.TemporaryDirectory() as state:
        node = EdgellmNode(Path(state)).start()
        try:
            model = node.model_id
            alone = chat_rate(node, model, seconds, embed=False)
            mixed = chat_rate(node, model, seconds, embed=True)
        finally:
            node.stop()
    print(
        f"\n4 chat clients, {seconds:g} s each: alone {alone[0]:.1f} tok/s; with embeddings {mixed[0]:.1f} tok/s "
        f"({times(mixed[0], alone[0])}), {mixed[1]:.1f} embedded inputs/s beside them"
    )


def chat_rate(node: EdgellmNode, model: str, seconds: float, *, embed: bool) -> tuple[float, float]:
    stop = time.monotonic() + seconds
    tokens = [0] * 4
    embedded = [0]

    def chat(i: int) -> None:
        with httpx.Client(base_url=node.base, timeout=120) as c:
            while time.monotonic() < stop:
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": f"Write a short story about robot number {i}."}],
                    "max_tokens": 64,
                    "temperature": 0.8,
                }
                r = c.post("/v1/chat/completions", json=body)
                if time.monotonic() < stop:
                    tokens[i] += r.json()["usage"]["completion_tokens"]

    def embedder() -> None:
        items = texts(16)
        with httpx.Client(base_url=node.base, timeout=120) as c:
            while time.monotonic() < stop:
                r = c.post("/v1/embeddings", json={"model": model, "input": items})
                r.raise_for_status()
                if time.monotonic() < stop:
                    embedded[0] += len(items)

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(4)]
    if embed:
        threads.append(threading.Thread(target=embedder))
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = min(time.monotonic(), stop) - t0
    return sum(tokens) / wall, embedded[0] / wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=bundled_model_path())
    p.add_argument("--texts", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--skip-node", action="store_true", help="part 1 only")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    part1(args.model, args.texts, args.runs)
    if not args.skip_node:
        part2(args.seconds)
    return 0


if __name__ == "__main__":
    run_main(main)

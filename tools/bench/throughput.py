#!/usr/bin/env python
"""Throughput/latency of the node through HTTP vs llama-cpp-python's serial high-level API.

Same run, same machine, same prompts: first the baseline (`Llama.create_chat_completion`, one
request at a time; `response_format` for the constrained ones), then the baseline is freed and the
node is started as a subprocess and driven by C concurrent clients (1, 4, 8) for plain and
JSON-schema-constrained requests. Prints a table with aggregate tok/s, p50/p95 latency and TTFT,
the ratios to the baseline, the guided-decoding cost per step and the node's RSS under load.

    python tools/bench/throughput.py [--requests 32] [--max-tokens 128] [--clients 1,4,8]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgellm.runtime.model_sizing import bundled_model_path  # noqa: E402
from tools.bench.prompts import PROMPTS  # noqa: E402
from tools.bench.results import Table, percentile, times  # noqa: E402
from tools.bench.servers import EdgellmNode, rss_mb, run_main  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
        "bio": {"type": "string", "maxLength": 160},
    },
    "required": ["name", "age", "city", "hobbies", "bio"],
    "additionalProperties": False,
}


def body(i: int, constrained: bool, max_tokens: int) -> dict:
    msgs = (
        [{"role": "user", "content": f"Create a detailed fictional person, number {i}, as JSON."}]
        if constrained
        else [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    )
    b = {"messages": msgs, "temperature": 0.7, "top_p": 0.95, "max_tokens": max_tokens, "seed": 1000 + i}
    if constrained:
        b["response_format"] = {"type": "json_object", "schema": SCHEMA}
    return b


def pct(values: list[float], q: float) -> float:
    """The rank percentile; NaN when every request failed (the table then says so)."""
    value = percentile(values, q)
    return math.nan if value is None else value


def baseline(model: str, n: int, max_tokens: int, constrained: bool, threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=4)  # warm-up
    lat, ttft, toks = [], [], 0
    t0 = time.perf_counter()
    for i in range(n):
        b = body(i, constrained, max_tokens)
        kw = {"response_format": b["response_format"]} if constrained else {}
        s = time.perf_counter()
        first = None
        n_tok = 0
        for chunk in llm.create_chat_completion(
            messages=b["messages"],
            temperature=b["temperature"],
            top_p=b["top_p"],
            max_tokens=max_tokens,
            seed=b["seed"],
            stream=True,
            **kw,
        ):
            if chunk["choices"][0]["delta"].get("content"):
                n_tok += 1
                first = first or time.perf_counter()
        lat.append(time.perf_counter() - s)
        ttft.append((first or time.perf_counter()) - s)
        toks += n_tok
    wall = time.perf_counter() - t0
    del llm
    gc.collect()
    return {
        "tok_s": toks / wall,
        "p50": pct(lat, 0.5),
        "p95": pct(lat, 0.95),
        "ttft50": pct(ttft, 0.5),
        "tokens": toks,
        "wall": wall,
    }


def drive(base: str, clients: int, n: int, constrained: bool, max_tokens: int) -> dict:
    lat, ttft, toks, bad = [], [], [0], [0]
    lock = threading.Lock()

    def one(i: int, session: requests.Session) -> None:
        s = time.perf_counter()
        r = session.post(base + "/create_chat_completion", json=body(i, constrained, max_tokens), timeout=600)
        elapsed = time.perf_counter() - s
        with lock:
            if r.status_code != 200:
                bad[0] += 1
                return
            full = r.json()["result"]["FULL_OUTPUT"][0]
            lat.append(elapsed)
            ttft.append(full["timings"]["ttft_ms"] / 1000)
            toks[0] += full["usage"]["completion_tokens"]
            if constrained:
                json.loads(full["choices"][0]["message"]["content"])

    def client(k: int) -> None:
        with requests.Session() as session:
            for i in range(k, n, clients):
                one(i, session)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - t0
    return {
        "tok_s": toks[0] / wall,
        "p50": pct(lat, 0.5),
        "p95": pct(lat, 0.95),
        "ttft50": pct(ttft, 0.5),
        "ttft95": pct(ttft, 0.95),
        "tokens": toks[0],
        "failed": bad[0],
        "wall": wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    model = bundled_model_path()
    clients = [int(c) for c in args.clients.split(",")]
    print(
        f"model {Path(model).name}, {args.requests} requests x {args.max_tokens} max tokens, {args.threads} threads",
        flush=True,
    )
    base = {c: baseline(model, args.requests, args.max_tokens, c, args.threads) for c in (False, True)}
    for c, b in base.items():
        print(f"baseline {'schema' if c else 'plain '}: {b['tok_s']:.1f} tok/s, p50 {b['p50']:.2f}s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as state:
        node = EdgellmNode(Path(state), "--n-threads", str(args.threads), "--log-level", "warning").start()
        try:
            pids = [node.proc.pid, node.worker_pid()]
            guide_cost = None
            peak_rss = 0.0
            for constrained in (False, True):
                for c in clients:
                    before = requests.get(node.base + "/metrics", timeout=10).json()["result"]["engine"]
                    sampler_stop = threading.Event()
                    rss_samples: list[float] = []

                    def sample_rss(stop=sampler_stop, samples=rss_samples) -> None:
                        while not stop.wait(0.25):
                            samples.append(rss_mb(pids))

                    t = threading.Thread(target=sample_rss)
                    t.start()
                    res = drive(node.base, c, args.requests, constrained, args.max_tokens)
                    sampler_stop.set()
                    t.join()
                    time.sleep(2.5)  # let a ping refresh the engine statistics
                    after = requests.get(node.base + "/metrics", timeout=10).json()["result"]["engine"]
                    res["rss"] = max(rss_samples or [rss_mb(pids)])
                    peak_rss = max(peak_rss, res["rss"])
                    if constrained and c == max(clients) and after.get("steps", 0) > before.get("steps", 0):
                        steps = after["steps"] - before["steps"]

                        def total(d, k):
                            return d.get(k, 0) * d.get("steps", 0)

                        guide_cost = (
                            (total(after, "guide_ms_per_step") - total(before, "guide_ms_per_step")) / steps,
                            (total(after, "decode_ms_per_step") - total(before, "decode_ms_per_step")) / steps,
                        )
                    rows.append((constrained, c, res))
                    print(f"node {'schema' if constrained else 'plain '} C={c}: {res['tok_s']:.1f} tok/s", flush=True)
        finally:
            node.stop()
    print()
    table = Table(
        "mode",
        "clients",
        "tok/s",
        "ratio vs serial baseline",
        "p50 latency s",
        "p95 latency s",
        "p50 TTFT ms",
        "p95 TTFT ms",
        "node RSS MB",
        "failed",
    )
    for constrained, b in base.items():
        mode = "schema" if constrained else "plain"
        table.add(
            mode,
            "baseline (serial high-level API)",
            f"{b['tok_s']:.1f}",
            "1.00x",
            f"{b['p50']:.2f}",
            f"{b['p95']:.2f}",
            f"{1000 * b['ttft50']:.0f}",
            "-",
            "-",
            0,
        )
    for constrained, c, r in rows:
        table.add(
            "schema" if constrained else "plain",
            c,
            f"{r['tok_s']:.1f}",
            times(r["tok_s"], base[constrained]["tok_s"]),
            f"{r['p50']:.2f}",
            f"{r['p95']:.2f}",
            f"{1000 * r['ttft50']:.0f}",
            f"{1000 * r['ttft95']:.0f}",
            f"{r['rss']:.0f}",
            r["failed"],
        )
    table.print()
    if guide_cost:
        g, d = guide_cost
        print(
            f"\nguided decoding (mask + apply + advance) at C={max(clients)}: {g:.2f} ms/step vs llama_decode "
            f"{d:.2f} ms/step ({100 * g / d:.1f}% of the decode step)"
        )
    print(f"peak node RSS (API + engine worker): {peak_rss:.0f} MB")
    return 0


if __name__ == "__main__":
    run_main(main)

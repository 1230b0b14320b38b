#!/usr/bin/env python
"""The same engine behind two front doors: the native host (`edgellm serve`) and a real offline Ratio1
node serving EDGELLM_INFERENCE_API (`edgellm.ratio1.launcher`, as `edgellm ratio1-node`).

Same machine, same run, same settings (N_SLOTS, N_CTX), same prompts, one after the other. For each:
start-to-ready time, memory (PSS of every process of the server: node, uvicorn, engine worker; RSS
double-counts shared pages), one request's latency (median of sequential requests) and the tokens/s
of C concurrent clients. Prints both and the node/native ratio.

    EDGELLM_RATIO1_PYTHON=$(tools/ratio1_venv.sh)/bin/python python tools/bench/ratio1.py [--clients 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgellm.ratio1.launcher import NodeOptions, Ratio1Node  # noqa: E402
from edgellm.ratio1.ports import free_port  # noqa: E402
from tools.bench.prompts import PROMPTS  # noqa: E402  (the same prompts as the node benchmark)
from tools.bench.results import Table, times  # noqa: E402
from tools.bench.servers import EdgellmNode, pss_mb, run_main, tree_pids  # noqa: E402


def body(i: int, max_tokens: int) -> dict:
    return {
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": i,
    }


def completion_tokens(reply: dict) -> int:
    result = reply.get("result", reply)
    return result["FULL_OUTPUT"][0]["usage"]["completion_tokens"]


def measure(base: str, clients: int, max_tokens: int, singles: int) -> dict:
    s = requests.Session()
    for i in range(2):  # warm-up (first-call costs on both sides)
        s.post(base + "/create_chat_completion", json=body(i, 16), timeout=300).raise_for_status()
    latencies = []
    for i in range(singles):
        t = time.perf_counter()
        r = s.post(base + "/create_chat_completion", json=body(i, 32), timeout=300)
        latencies.append(time.perf_counter() - t)
        r.raise_for_status()
    out: dict[int, int] = {}
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            r = requests.post(base + "/create_chat_completion", json=body(i, max_tokens), timeout=600)
            r.raise_for_status()
            out[i] = completion_tokens(r.json())
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed: {errors[:3]}")
    return {
        "latency_s": statistics.median(latencies),
        "tok_s": sum(out.values()) / wall,
        "tokens": sum(out.values()),
        "wall_s": wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--singles", type=int, default=5, help="sequential requests (32 tokens) for the latency")
    ap.add_argument("--n-slots", type=int, default=4)
    ap.add_argument("--n-ctx", type=int, default=4096)
    args = ap.parse_args()
    python = os.environ.get("EDGELLM_RATIO1_PYTHON")
    if not python:
        print("set EDGELLM_RATIO1_PYTHON (make ratio1-setup; tools/ratio1_venv.sh prints the venv)", file=sys.stderr)
        return 2
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        # Native host.
        native = EdgellmNode(
            Path(tmp) / "native", "--n-slots", str(args.n_slots), "--n-ctx", str(args.n_ctx), "--log-level", "warning"
        ).start()
        try:
            m = measure(native.base, args.clients, args.max_tokens, args.singles)
            rows["native host"] = {**m, "ready_s": native.ready_s, "pss_mb": pss_mb(tree_pids(native.proc.pid))}
        finally:
            native.stop()
        # Ratio1 node.
        port = free_port()
        pipeline = {
            "NAME": "llm_api",
            "TYPE": "Loopback",
            "PLUGINS": [
                {
                    "SIGNATURE": "EDGELLM_INFERENCE_API",
                    "INSTANCES": [{"INSTANCE_ID": "bench", "PORT": port, "N_SLOTS": args.n_slots, "N_CTX": args.n_ctx}],
                }
            ],
        }
        node = Ratio1Node(
            NodeOptions(python=python, workdir=Path(tmp) / "node", mqtt_port=free_port(), pipelines=[pipeline])
        )
        node.start()
        try:
            m = measure(node.base_url, args.clients, args.max_tokens, args.singles)
            pss = pss_mb(tree_pids(node.node.pid))
            rows["Ratio1 node"] = {
                **m,
                "ready_s": node.ready_s,
                "pss_mb": pss,
                "broker_pss_mb": pss_mb([node.broker.pid]),
            }
        finally:
            node.stop()

    print(f"\nN_SLOTS {args.n_slots}, N_CTX {args.n_ctx}, {args.clients} clients x {args.max_tokens} tokens")
    table = Table("", "ready s", "PSS MB", "1 req s", f"{args.clients}-client tok/s")
    for name, r in rows.items():
        table.add(name, f"{r['ready_s']:.1f}", f"{r['pss_mb']:.0f}", f"{r['latency_s']:.3f}", f"{r['tok_s']:.1f}")
    n, nat = rows["Ratio1 node"], rows["native host"]
    table.add("node/native", *(times(n[k], nat[k]) for k in ("ready_s", "pss_mb", "latency_s", "tok_s")))
    table.print()
    print(f"(mosquitto: {n['broker_pss_mb']:.0f} MB PSS, not included)")
    return 0


if __name__ == "__main__":
    run_main(main)

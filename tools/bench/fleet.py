#!/usr/bin/env python
"""Request balancing between two real offline Ratio1 nodes, against one node alone, in the same run.

A burst of --requests async requests into node A, twice: A alone (balancing off), then A in a 2-node
balancing group with B (edgellm.ratio1.node_fleet.fleet: one broker, ChainStore running). Both engines have
1 slot; the pending limit is 1. Printed: the burst's completion time (first submit to last result), the
share B executed, p50/p95 latency (each record's finished_at - created_at on A) of delegated and local
requests, and the delegation overhead alone: a delegated request's time on A less its time on B
(INFERENCE_ELAPSED_TIME: registered on B to finished there), i.e. the envelopes' way out and back and
the polling. On one 2-core machine both nodes share the cores (the engines use 1 thread each), so the
completion time does not show the scaling of two devices; the overhead is the figure that carries over.

    EDGELLM_RATIO1_PYTHON=$(tools/ratio1_venv.sh)/bin/python flock /tmp/edgellm-cpu.lock \\
        .venv/bin/python tools/bench/fleet.py [--requests 32] [--max-tokens 32] [--out results.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgellm.ratio1.launcher import NodeOptions, Ratio1Node  # noqa: E402
from edgellm.ratio1.node_fleet import fleet  # noqa: E402
from edgellm.ratio1.ports import free_port  # noqa: E402
from tools.bench.results import Table, percentile, times, write_results  # noqa: E402
from tools.bench.servers import run_main  # noqa: E402

BALANCING = {
    "REQUEST_BALANCING_ENABLED": True,
    "REQUEST_BALANCING_GROUP": "edgellm-bench",
    "REQUEST_BALANCING_PENDING_LIMIT": 1,
    "REQUEST_BALANCING_ANNOUNCE_PERIOD": 2,
    "REQUEST_BALANCING_CAPACITY_DEBOUNCE_SECONDS": 0,
    "REQUEST_BALANCING_CAPACITY_REFRESH_PERIOD": 2,
    "REQUEST_BALANCING_CAPACITY_REFRESH_JITTER_SECONDS": 0,
    "REQUEST_BALANCING_PEER_STALE_SECONDS": 10,
    "REQUEST_BALANCING_MAILBOX_POLL_PERIOD": 0.3,
}


def pipeline(port: int, balancing: dict) -> dict:
    instance = {"INSTANCE_ID": "api", "PORT": port, "N_SLOTS": 1, "N_THREADS": 1, "N_CTX": 1024, **balancing}
    return {
        "NAME": "bench_api",
        "TYPE": "Loopback",
        "PLUGINS": [{"SIGNATURE": "EDGELLM_INFERENCE_API", "INSTANCES": [instance]}],
    }


def burst(url: str, n: int, max_tokens: int) -> tuple[float, list[dict]]:
    """Submit n async requests at once; poll until each has ended: (wall seconds, the final records)."""

    def body(i: int) -> dict:
        return {"messages": [{"role": "user", "content": f"Count from 1 to {12 + i % 5}."}], "max_tokens": max_tokens}

    with httpx.Client(base_url=url, timeout=60) as client:
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            ids = list(
                pool.map(lambda i: client.post("/predict_async", json=body(i)).json()["result"]["request_id"], range(n))
            )
        done: dict[str, dict] = {}
        while len(done) < n:
            for rid in ids:
                if rid not in done:
                    rec = client.get("/request_status", params={"request_id": rid, "return_full": "true"}).json()[
                        "result"
                    ]
                    if rec["status"] != "pending":
                        done[rid] = rec
            time.sleep(0.2)
        return time.monotonic() - started, list(done.values())


def pct(values: list[float], q: int) -> float | None:
    """The q-th percentile (whole percents), interpolated between the two samples either side of it."""
    return percentile(values, q / 100, "linear")


def latency(rec: dict) -> float:
    return rec["finished_at"] - rec["created_at"]


def ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


def summary(wall: float, records: list[dict], b_addr: str | None) -> dict:
    on_b = [r for r in records if b_addr and r.get("result", {}).get("EXECUTOR_NODE_ADDR") == b_addr]
    local = [r for r in records if r not in on_b]
    overhead = [
        latency(r) - r["result"]["INFERENCE_ELAPSED_TIME"] for r in on_b if "INFERENCE_ELAPSED_TIME" in r["result"]
    ]
    return {
        "completion_s": round(wall, 2),
        "completed": sum(r["status"] == "completed" for r in records),
        "executed_on_b": len(on_b),
        "local_p50_ms": ms(pct([latency(r) for r in local], 50)),
        "local_p95_ms": ms(pct([latency(r) for r in local], 95)),
        "delegated_p50_ms": ms(pct([latency(r) for r in on_b], 50)),
        "delegated_p95_ms": ms(pct([latency(r) for r in on_b], 95)),
        "overhead_p50_ms": ms(pct(overhead, 50)),
        "overhead_p95_ms": ms(pct(overhead, 95)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out")
    args = ap.parse_args()
    python = os.environ.get("EDGELLM_RATIO1_PYTHON")
    if not python:
        print("set EDGELLM_RATIO1_PYTHON to the node venv's python (tools/ratio1_venv.sh)", file=sys.stderr)
        return 2
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        port = free_port()
        options = NodeOptions(
            python=python, workdir=Path(tmp) / "lone", mqtt_port=free_port(), pipelines=[pipeline(port, {})]
        )
        with Ratio1Node(options) as lone:
            lone.wait_http(lone.instances[0], timeout_s=240)
            results["lone"] = summary(*burst(lone.base_url, args.requests, args.max_tokens), None)
        ports = [free_port(), free_port()]
        options = [
            NodeOptions(
                python=python,
                workdir=Path(tmp) / f"node{i}",
                node_id=f"edgellm-bench-{i}",
                pipelines=[pipeline(p, BALANCING)],
            )
            for i, p in enumerate(ports)
        ]
        with fleet(options) as (a, b):
            b.wait_http(b.instances[0], timeout_s=240)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:  # B's capacity record on A: the group has formed
                state = httpx.get(f"{a.base_url}/status", timeout=30).json()["result"]["balancing"]
                if any(peer["addr"] == b.address for peer in state["peers_accepting"]):
                    break
                time.sleep(0.5)
            results["fleet"] = summary(*burst(a.base_url, args.requests, args.max_tokens), b.address)
    lone, two = results["lone"], results["fleet"]
    table = Table("", "A alone", "A + B")
    for key in ("completion_s", "completed", "executed_on_b", "local_p50_ms", "local_p95_ms"):
        table.add(key, lone[key], two[key])
    for key in ("delegated_p50_ms", "delegated_p95_ms", "overhead_p50_ms", "overhead_p95_ms"):
        table.add(key, "", two[key])
    report = [f"{args.requests} requests, {args.max_tokens} max tokens, 1 slot and 1 thread per engine", str(table)]
    if lone["completion_s"] and two["completion_s"]:
        report.append(f"completion time A+B / A alone: {times(two['completion_s'], lone['completion_s'])}")
    write_results(results, "\n".join(report), args.out)
    return 0


if __name__ == "__main__":
    run_main(main)

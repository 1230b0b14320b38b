#!/usr/bin/env python
"""What Ollama's dialect costs: completion tokens/s through `POST /api/chat` against `POST /v1/chat/completions`
on the same node, at 1 and 8 clients, streamed and not (issue 45: the dialect must cost < 3%).

One node, the bundled model (or --model). The two routes take turns (OpenAI, Ollama, OpenAI, ...:
tools/bench/results.turns) with the same requests (prompts, seeds, max_tokens, temperature), so the
machine's drift hits both alike; each Ollama turn is read against the OpenAI turns either side of it
(bracket_ratios) and the table shows the median ratio. Tokens are each route's own count (usage
completion_tokens / eval_count).

    flock /tmp/edgellm-cpu.lock .venv/bin/python tools/bench/ollama.py [--requests 16] [--max-tokens 64] [--turns 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.prompts import PROMPTS  # noqa: E402
from tools.bench.results import Table, bracket_ratios, turns, write_results  # noqa: E402
from tools.bench.servers import EdgellmNode, model_and_env, run_main  # noqa: E402

ROUTES = ("openai", "ollama")


def request(client: httpx.Client, route: str, model: str, i: int, max_tokens: int, stream: bool) -> int:
    """One request; its completion tokens as the route counts them."""
    messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    if route == "openai":
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.7, "seed": i}
        if not stream:
            r = client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])
        body.update(stream=True, stream_options={"include_usage": True})
        tokens = 0
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    usage = json.loads(line[6:]).get("usage")
                    tokens = int(usage["completion_tokens"]) if usage else tokens
        return tokens
    options = {"num_predict": max_tokens, "temperature": 0.7, "seed": i}
    body = {"model": model, "messages": messages, "options": options, "stream": stream}
    if not stream:
        r = client.post("/api/chat", json=body)
        r.raise_for_status()
        return int(r.json()["eval_count"])
    tokens = 0
    with client.stream("POST", "/api/chat", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line:
                part = json.loads(line)
                if part.get("done"):
                    tokens = int(part["eval_count"])
    return tokens


def turn(node: EdgellmNode, route: str, n: int, clients: int, max_tokens: int, stream: bool) -> float:
    """Completion tokens/s of `n` requests from `clients` concurrent clients."""
    with httpx.Client(base_url=node.base, timeout=600) as client, ThreadPoolExecutor(clients) as pool:
        t0 = time.perf_counter()
        counts = list(pool.map(lambda i: request(client, route, node.model_id, i, max_tokens, stream), range(n)))
        return sum(counts) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the bundled SmolLM2-135M)")
    ap.add_argument("--requests", type=int, default=16, help="requests per turn")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--turns", type=int, default=5, help="turns per case, OpenAI first and last (odd)")
    ap.add_argument("--edgellm-env", action="append", default=[], metavar="KEY=VAL")
    ap.add_argument("--out", help="write the results here (JSON)")
    args = ap.parse_args()
    model, extra_env = model_and_env(ap, args)
    env = {"EDGELLM_MODEL_PATH": model, "EDGELLM_SPECULATIVE_DECODING": "false", **extra_env}
    folder = Path(tempfile.mkdtemp(prefix="bench-ollama-"))
    node = EdgellmNode(folder, "--log-level", "warning", env=env).start()
    table = Table("clients", "stream", "OpenAI tok/s", "Ollama tok/s", "Ollama / OpenAI (median bracket)")
    results: dict = {"cases": []}
    try:
        turn(node, "openai", 4, 4, 16, False)  # warm-up
        for clients in (int(c) for c in args.clients.split(",")):
            for stream in (False, True):
                measured: dict[str, list[float]] = {r: [] for r in ROUTES}
                for t in turns(ROUTES, args.turns | 1):
                    measured[t.side].append(turn(node, t.side, args.requests, clients, args.max_tokens, stream))
                ratios = bracket_ratios(measured["openai"], measured["ollama"])
                ratio = 1 / statistics.median(ratios)  # Ollama's tok/s over OpenAI's
                a, b = statistics.median(measured["openai"]), statistics.median(measured["ollama"])
                table.add(clients, stream, f"{a:.1f}", f"{b:.1f}", f"{ratio:.3f}")
                results["cases"].append({"clients": clients, "stream": stream, "turns": measured, "ratio": ratio})
    finally:
        node.stop()
    write_results(results, str(table), args.out)
    return 0


if __name__ == "__main__":
    run_main(main)

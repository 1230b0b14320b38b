#!/usr/bin/env python
"""Tool calling on /v1/chat/completions: throughput, latency, guide cost and call validity.

Same run, same node, same prompts: C concurrent clients (1, 8) send OpenAI chat requests that ask for a
weather lookup or a sum, in three modes: `plain` (no `tools`: the baseline), `auto` and `required`
(`tools` = get_weather, add). The modes are interleaved in rounds (plain, auto, required, plain, ...) so
that machine noise hits them alike. Per mode and client count: aggregate completion tok/s and its ratio
to plain, p50/p95 latency, the grammar's share of step time (guide / (decode + guide + sample), from the
engine's counters before and after each batch) and valid calls / all calls: a call is valid when its
name is one of the tools and json.loads(arguments) validates against that tool's schema (jsonschema).
Ends with one JSON line holding every number.

    python tools/bench/tool_calls.py [--requests 16] [--max-tokens 64] [--clients 1,8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.results import Table, percentile, times, turns  # noqa: E402
from tools.bench.servers import EdgellmNode, run_main  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city name, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["c", "f"], "description": "c for Celsius, f for Fahrenheit"},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    "What is the weather like in Paris right now, in celsius?",
    "What is 17 plus 25?",
    "Is it cold in Oslo today? Answer in fahrenheit.",
    "Please add 1234 and 4321.",
    "How warm is it in Tokyo? Use celsius.",
    "What do you get when you add 99 and 1?",
    "Tell me the current weather in New York in fahrenheit.",
    "Compute 7 + 35.",
]
MODES = ("plain", "auto", "required")


MODEL = {"id": ""}  # the node's model name, read from /v1/models at start


def body(i: int, mode: str, max_tokens: int) -> dict:
    b = {
        "model": MODEL["id"],
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "temperature": 0.7,
        "top_p": 0.95,
        "max_tokens": max_tokens,
        "seed": 1000 + i,
    }
    if mode != "plain":
        b["tools"] = TOOLS
        b["tool_choice"] = mode
    return b


def f2(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def call_problem(call: dict) -> str | None:
    """Why a tool call in a response is not valid (None when it is)."""
    fn = call.get("function") or {}
    name = fn.get("name")
    if call.get("type") != "function" or name not in SCHEMAS:
        return f"unknown function {name!r} (type {call.get('type')!r})"
    try:
        args = json.loads(fn.get("arguments"))
    except (TypeError, ValueError) as exc:
        return f"arguments do not parse: {exc}"
    try:
        jsonschema.validate(args, SCHEMAS[name])
    except jsonschema.ValidationError as exc:
        return f"arguments do not match {name}'s schema: {exc.message}"
    return None


def find_keys(tree: object, names: tuple[str, ...], path: str = "") -> list[tuple[str, object]]:
    """(dotted path, value) of every key named in `names` anywhere in a JSON tree."""
    found: list[tuple[str, object]] = []
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k in names:
                found.append((path + k, v))
            else:
                found.extend(find_keys(v, names, f"{path}{k}."))
    return found


def engine_stats(base: str) -> dict:
    return requests.get(base + "/metrics", timeout=10).json()["result"]["engine"]


def settled_stats(base: str, timeout: float = 8.0) -> dict:
    """The engine's counters once a ping has brought the whole batch (they arrive every ~2 s)."""
    time.sleep(2.5)
    last = engine_stats(base)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = engine_stats(base)
        if now.get("steps") == last.get("steps"):
            return now
        last = now
    return last


def totals(stats: dict) -> dict:
    steps = stats.get("steps", 0)
    return {
        "steps": steps,
        "generated": stats.get("generated_tokens", 0),
        "prompt": stats.get("prompt_tokens", 0),
        "reused": stats.get("reused_tokens", 0),
        **{k: stats.get(f"{k}_ms_per_step", 0.0) * steps for k in ("decode", "guide", "sample")},
    }


def drive(base: str, clients: int, indices: list[int], mode: str, max_tokens: int, acc: dict) -> float:
    """Send the requests `indices` from `clients` concurrent clients; results go into acc; returns the wall."""
    lock = threading.Lock()

    def one(i: int, session: requests.Session) -> None:
        b = body(i, mode, max_tokens)
        s = time.perf_counter()
        try:
            r = session.post(base + "/v1/chat/completions", json=b, timeout=600)
        except requests.RequestException as exc:
            with lock:
                acc["failed"] += 1
                acc["problems"].append({"request": b, "error": repr(exc)})
            return
        elapsed = time.perf_counter() - s
        with lock:
            if r.status_code != 200:
                acc["failed"] += 1
                acc["problems"].append({"request": b, "status": r.status_code, "response": r.text[:2000]})
                return
            out = r.json()
            acc["latency"].append(elapsed)
            acc["tokens"] += out["usage"]["completion_tokens"]
            acc["prompt_tokens"] += out["usage"]["prompt_tokens"]
            choice = out["choices"][0]
            acc["finish"][choice["finish_reason"]] = acc["finish"].get(choice["finish_reason"], 0) + 1
            calls = choice["message"].get("tool_calls") or []
            if mode == "required" and not calls:
                acc["problems"].append({"request": b, "response": out, "why": "required but no tool call"})
            if calls and choice["finish_reason"] != "tool_calls":
                acc["problems"].append({"request": b, "response": out, "why": "tool calls but finish not tool_calls"})
            acc["with_calls"] += bool(calls)
            if mode != "plain" and not calls and "tool_calls" in (choice["message"].get("content") or ""):
                acc["untriggered"] += 1  # an envelope in the text that the trigger did not catch (auto)
            for call in calls:
                acc["calls"] += 1
                why = call_problem(call)
                if why is None:
                    acc["valid"] += 1
                else:
                    acc["problems"].append({"request": b, "response": out, "why": why})
            if len(acc["samples"]) < 2:
                acc["samples"].append(choice["message"])

    def client(k: int) -> None:
        with requests.Session() as session:
            for i in indices[k::clients]:
                one(i, session)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return time.perf_counter() - t0


def new_acc() -> dict:
    return {
        "latency": [],
        "tokens": 0,
        "failed": 0,
        "calls": 0,
        "valid": 0,
        "with_calls": 0,
        "untriggered": 0,
        "finish": {},
        "problems": [],
        "samples": [],
        "wall": 0.0,
        "prompt_tokens": 0,
        "engine": {"steps": 0, "generated": 0, "prompt": 0, "reused": 0, "decode": 0.0, "guide": 0.0, "sample": 0.0},
    }


def summary(acc: dict, n: int) -> dict:
    e = acc["engine"]
    step_ms = e["decode"] + e["guide"] + e["sample"]
    return {
        "requests": n,
        "failed": acc["failed"],
        "tok_s": acc["tokens"] / acc["wall"] if acc["wall"] else 0.0,
        "tokens": acc["tokens"],
        "wall_s": acc["wall"],
        "p50_s": percentile(acc["latency"], 0.5),
        "p95_s": percentile(acc["latency"], 0.95),
        "steps": e["steps"],
        "engine_generated_tokens": e["generated"],
        "prompt_tokens_per_request": acc["prompt_tokens"] / max(1, len(acc["latency"])),
        "engine_prompt_tokens_decoded": e["prompt"],
        "engine_prompt_tokens_reused": e["reused"],
        "tokens_per_step": acc["tokens"] / e["steps"] if e["steps"] else None,
        "guide_ms_per_step": e["guide"] / e["steps"] if e["steps"] else 0.0,
        "step_ms_per_step": step_ms / e["steps"] if e["steps"] else 0.0,
        "guide_share": e["guide"] / step_ms if step_ms else 0.0,
        "responses_with_calls": acc["with_calls"],
        "call_text_in_content": acc["untriggered"],
        "calls": acc["calls"],
        "valid_calls": acc["valid"],
        "finish": acc["finish"],
        "problems": len(acc["problems"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16, help="requests per mode and client count")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds the requests are split into")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--n-slots", default="auto")
    ap.add_argument("--show-problems", type=int, default=3, help="how many invalid/failed requests to print")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    rounds = max(1, min(args.rounds, args.requests))
    t_start = time.perf_counter()
    results: dict[int, dict[str, dict]] = {}
    problems: list[tuple[int, str, dict]] = []
    with tempfile.TemporaryDirectory() as state:
        node = EdgellmNode(
            Path(state), "--n-threads", str(args.threads), "--n-slots", args.n_slots, "--log-level", "warning"
        ).start()
        try:
            MODEL["id"] = node.model_id
            status = requests.get(node.base + "/status", timeout=10).json().get("result", {})
            info = dict(find_keys(status, ("chat_format", "tool_format", "model", "n_slots")))
            print(
                f"node up in {time.perf_counter() - t_start:.0f}s; {args.requests} requests per mode x "
                f"{args.max_tokens} max tokens, clients {clients}, {rounds} rounds, {args.threads} threads; "
                f"{json.dumps(info)[:300]}",
                flush=True,
            )
            # Warm-up (first tool prompt render and grammar compile), not counted.
            for mode in MODES:
                requests.post(node.base + "/v1/chat/completions", json=body(0, mode, 8), timeout=600)
            for c in clients:
                accs = {m: new_acc() for m in MODES}
                after = totals(settled_stats(node.base))
                for turn in turns(MODES, rounds * len(MODES)):  # plain, auto, required, plain, ...
                    mode, indices = turn.side, list(range(turn.round, args.requests, rounds))
                    before = after
                    accs[mode]["wall"] += drive(node.base, c, indices, mode, args.max_tokens, accs[mode])
                    after = totals(settled_stats(node.base))
                    for k in accs[mode]["engine"]:
                        accs[mode]["engine"][k] += after[k] - before[k]
                results[c] = {m: summary(a, args.requests) for m, a in accs.items()}
                for m, a in accs.items():
                    problems.extend((c, m, p) for p in a["problems"])
                    s = results[c][m]
                    print(
                        f"C={c} {m:8}: {s['tok_s']:.1f} tok/s, p50 {f2(s['p50_s'])}s, "
                        f"guide {100 * s['guide_share']:.1f}%, valid {s['valid_calls']}/{s['calls']}, "
                        f"failed {s['failed']}; e.g. "
                        f"{json.dumps(a['samples'][:1])[:200]}",
                        flush=True,
                    )
        finally:
            node.stop()
    total_s = time.perf_counter() - t_start
    print()
    table = Table(
        "clients",
        "mode",
        "tok/s",
        "vs plain",
        "p50 s",
        "p95 s",
        "prompt tok (decoded/reused)",
        "tok/step",
        "guide ms/step",
        "step ms",
        "guide share",
        "responses with calls",
        "call text in content",
        "valid calls / calls",
        "failed",
    )
    for c, per_mode in results.items():
        plain = per_mode["plain"]["tok_s"]
        for m, s in per_mode.items():
            table.add(
                c,
                m,
                f"{s['tok_s']:.1f}",
                times(s["tok_s"], plain) if plain else "-",
                f2(s["p50_s"]),
                f2(s["p95_s"]),
                f"{s['prompt_tokens_per_request']:.0f} ({s['engine_prompt_tokens_decoded']}/"
                f"{s['engine_prompt_tokens_reused']})",
                f2(s["tokens_per_step"]),
                f"{s['guide_ms_per_step']:.2f}",
                f"{s['step_ms_per_step']:.1f}",
                f"{100 * s['guide_share']:.1f}%",
                f"{s['responses_with_calls']}/{s['requests'] - s['failed']}",
                s["call_text_in_content"],
                f"{s['valid_calls']}/{s['calls']}" if m != "plain" else "-",
                s["failed"],
            )
    table.print()
    for c, m, p in problems[: args.show_problems]:
        print(f"\nproblem C={c} {m}: {json.dumps(p)[:3000]}")
    if len(problems) > args.show_problems:
        print(f"... {len(problems) - args.show_problems} more problems")
    print(f"\nrun took {total_s:.0f}s")
    line = {
        "bench": "tools",
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": rounds,
        "threads": args.threads,
        "n_slots": args.n_slots,
        "run_s": round(total_s, 1),
        "results": {str(c): per_mode for c, per_mode in results.items()},
    }
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    run_main(main)

#!/usr/bin/env python
"""Lanes under load: edgellm's priorities and KV layouts against llama-server, which serves FIFO.

Same model (the bundled SmolLM2-135M unless --model), 2 threads, 8 slots, 8192 KV cells. Servers run one
at a time (never two engines on the cores). Three parts:

(a) realtime TTFT. A 1-token classification request every 0.5 s (`--realtime` of them; edgellm:
    `priority: realtime`), timed to its answer (one token: the answer is the first token), first with no
    other load, then while 8 batch clients keep every slot busy with long answers (edgellm: `priority:
    batch`). edgellm on its default layout (one pool), llama-server with `--kv-unified` (its default, the
    same cells) and no priorities. p50 / p99 / max, and loaded p99 over unloaded p99 (the issue's goal:
    <= 2x for edgellm).
(b) context. The longest prompt each configuration accepts (edgellm: /status `seq_ctx`; llama-server:
    /props), a ~3,000-token prompt sent to each (answered or refused), and how many of 4 concurrent
    ~2,000-token requests run at once (the most /status `slots_busy` or /slots `is_processing` showed).
(c) shared system prompt. 8 concurrent clients whose prompts share a ~900-token system prompt: the KV
    cells held while all 8 run (edgellm: /status `kv_pool.used`, the most seen; llama-server: the sum
    over processing slots of prompt + decoded tokens, each slot's own cells, from /slots).

    .venv/bin/python tools/bench/lanes.py [--realtime 20] [--out lanes.json] [--llama-server PATH]

Run it on a quiet machine (on a shared one: flock /tmp/edgellm-cpu.lock ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.results import Table, percentile, ratio, write_results  # noqa: E402
from tools.bench.servers import (  # noqa: E402
    ABORT,
    EdgellmNode,
    LlamaServer,
    Server,
    llama_binaries,
    model_and_env,
    run_main,
)

THREADS = 2
SLOTS = 8
N_CTX = 8192
REALTIME_EVERY_S = 0.5
BATCH_MAX_TOKENS = 256
SENTENCE = "The harbour master logged the tide, the wind and every ship that came in that night. "
SYSTEM_SENTENCE = "You are the maintenance assistant of a robot fleet; follow the safety manual, section {i}. "


# -- requests -------------------------------------------------------------------------------------
def lane(server: Server, priority: str) -> dict:
    return {"priority": priority} if server.name.startswith("edgellm") else {}


def classify(server: Server, i: int) -> dict:
    content = f"Reading {i}: the door sensor says closed. Is the door open? Answer yes or no."
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}
    return {**body, **lane(server, "realtime")}


def busy_slots(server: Server) -> int:
    if server.name.startswith("edgellm"):
        return int(httpx.get(server.base + "/status", timeout=10).json()["result"]["load"].get("slots_busy", 0))
    return sum(1 for s in httpx.get(server.base + "/slots", timeout=10).json() if s.get("is_processing"))


def settle(server: Server) -> None:
    """Until no slot is busy (edgellm's /status load is its engine's last report, up to 2 s old: a
    measurement must not start on the previous part's figures)."""
    deadline = time.monotonic() + 120
    while busy_slots(server) and time.monotonic() < deadline:
        time.sleep(0.2)


def held_cells(server: Server) -> int:
    """KV cells held now: edgellm's pool count; llama-server's processing slots' prompt + decoded tokens."""
    if server.name.startswith("edgellm"):
        return int(httpx.get(server.base + "/status", timeout=10).json()["result"]["kv_pool"].get("used", 0))
    slots = httpx.get(server.base + "/slots", timeout=10).json()
    return sum(
        int(s.get("n_prompt_tokens", 0)) + int(s.get("next_token", [{}])[0].get("n_decoded", 0))
        for s in slots
        if s.get("is_processing")
    )


def text_of(server: Server, tokens: int, sentence: str = SENTENCE) -> str:
    """About `tokens` tokens of text, counted with the server's own tokenizer (/tokenize)."""
    probe = "".join(sentence.format(i=i) for i in range(10))
    per_10 = len(httpx.post(server.base + "/tokenize", json={"content": probe}, timeout=30).json()["tokens"])
    return "".join(sentence.format(i=i) for i in range(max(1, round(10 * tokens / per_10))))


# -- (a) realtime TTFT ----------------------------------------------------------------------------
def realtime_ttft(server: Server, n: int, loaded: bool) -> dict:
    stop = threading.Event()
    errors: list[str] = []

    def batch_client(k: int) -> None:
        i = 0
        while not stop.is_set() and not ABORT.is_set():
            body = {
                "messages": [{"role": "user", "content": f"Story {k}-{i}: write a long story about a lighthouse."}],
                "max_tokens": BATCH_MAX_TOKENS,
                "temperature": 0.7,
                **lane(server, "batch"),
            }
            try:
                r = server.chat(body)
                if r.status_code != 200:
                    errors.append(f"batch {r.status_code}: {r.text[:200]}")
            except httpx.HTTPError as exc:
                errors.append(f"batch {exc!r}")
            i += 1

    threads = [threading.Thread(target=batch_client, args=(k,), daemon=True) for k in range(SLOTS if loaded else 0)]
    for t in threads:
        t.start()
    if loaded:  # every slot busy before the first realtime request
        deadline = time.monotonic() + 120
        while busy_slots(server) < SLOTS and time.monotonic() < deadline:
            time.sleep(0.1)
    latencies: list[float] = []
    next_at = time.monotonic()
    for i in range(n):
        time.sleep(max(0.0, next_at - time.monotonic()))
        next_at += REALTIME_EVERY_S
        t0 = time.monotonic()
        r = server.chat(classify(server, i))
        if r.status_code != 200:
            errors.append(f"realtime {r.status_code}: {r.text[:200]}")
            continue
        latencies.append(time.monotonic() - t0)
    stop.set()
    for t in threads:
        t.join(600)
    return {"latencies_s": latencies, "errors": errors[:5], "n_errors": len(errors), **summary(latencies)}


def summary(values: list[float]) -> dict:
    if not values:
        return {}
    return {"p50_s": statistics.median(values), "p99_s": percentile(values, 0.99, "nearest"), "max_s": max(values)}


def run_watching(server: Server, bodies: list[dict], reading: Callable[[], int]) -> tuple[list[httpx.Response], int]:
    """Send `bodies` at once; the answers, and the most `reading()` gave while they ran (polled)."""
    most, done = 0, threading.Event()

    def watch() -> None:
        nonlocal most
        while not done.is_set():
            try:
                most = max(most, reading())
            except httpx.HTTPError:
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(server.chat, bodies))
    done.set()
    watcher.join(5)
    return answers, most


# -- (b) context ----------------------------------------------------------------------------------
def context_limits(server: Server) -> dict:
    settle(server)
    if server.name.startswith("edgellm"):
        info = httpx.get(server.base + "/status", timeout=10).json()["result"]["engine_info"]
        limit = int(info.get("seq_ctx") or 0) - 1
    else:
        props = httpx.get(server.base + "/props", timeout=10).json()
        limit = int(props.get("default_generation_settings", {}).get("n_ctx") or 0) - 1
    r = server.chat(
        {"messages": [{"role": "user", "content": text_of(server, 3000)}], "max_tokens": 4, "temperature": 0}
    )
    long_prompt = {"status": r.status_code}
    if r.status_code == 200:
        long_prompt["prompt_tokens"] = r.json()["usage"]["prompt_tokens"]
    else:
        long_prompt["error"] = r.text[:300]
    # 4 distinct ~2,000-token prompts at once: how many run together.
    bodies = [
        {
            "messages": [{"role": "user", "content": f"Log {k}. " + text_of(server, 2000)}],
            "max_tokens": 16,
            "temperature": 0,
        }
        for k in range(4)
    ]
    answers, seen = run_watching(server, bodies, lambda: busy_slots(server))
    codes = [r.status_code for r in answers]
    return {"longest_prompt": limit, "prompt_3000": long_prompt, "four_2k": {"statuses": codes, "most_at_once": seen}}


# -- (c) shared system prompt ---------------------------------------------------------------------
def shared_prompt_cells(server: Server) -> dict:
    settle(server)
    system = text_of(server, 900, SYSTEM_SENTENCE)
    bodies = [
        {
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Robot {k} reports a stuck wheel. What should it do?"},
            ],
            "max_tokens": 64,
            "temperature": 0,
            "logit_bias": {"2": -100},  # no end token: each runs its 64 tokens, so all 8 overlap
        }
        for k in range(SLOTS)
    ]
    # One first, alone: the shared prefix is then cached, as a system prompt is on a node that has served.
    first = server.chat(bodies[0])
    results, most = run_watching(server, bodies, lambda: held_cells(server) if busy_slots(server) == SLOTS else 0)
    prompt_tokens = first.json()["usage"]["prompt_tokens"] if first.status_code == 200 else None
    return {
        "prompt_tokens": prompt_tokens,
        "statuses": [r.status_code for r in results],
        "cells_held_all_8_running": most,
    }


# -- the run --------------------------------------------------------------------------------------
def report(results: dict) -> str:
    names = [n for n in ("edgellm", "edgellm-slots", "llama-server") if n in results]
    realtime = Table(
        "server", "unloaded p50 s", "unloaded p99 s", "loaded p50 s", "loaded p99 s", "loaded p99 / unloaded", "max s"
    )
    for name in names:
        a = results[name].get("realtime")
        if not a:
            continue
        idle, busy = a["unloaded"], a["loaded"]
        if not idle.get("p99_s") or not busy.get("p99_s"):
            realtime.add(name, *["-"] * 5, f"no answers ({busy.get('errors')})")
            continue
        realtime.add(
            name,
            f"{idle['p50_s']:.3f}",
            f"{idle['p99_s']:.3f}",
            f"{busy['p50_s']:.3f}",
            f"{busy['p99_s']:.3f}",
            f"{ratio(busy['p99_s'], idle['p99_s']):.1f}x",
            f"{busy['max_s']:.2f}",
        )
    context = Table("server", "longest prompt", "a 3,000-token prompt", "4 x 2,000-token: statuses", "ran at once")
    for name in names:
        b = results[name]["context"]
        p3 = b["prompt_3000"]
        answer = f"answered ({p3.get('prompt_tokens')} tokens)" if p3["status"] == 200 else f"refused {p3['status']}"
        context.add(name, b["longest_prompt"], answer, b["four_2k"]["statuses"], b["four_2k"]["most_at_once"])
    shared = Table("server", "cells held", "vs llama-server", "prompt tokens")
    llama_cells = results.get("llama-server", {}).get("shared", {}).get("cells_held_all_8_running")
    for name in names:
        c = results[name]["shared"]
        vs = f"{ratio(c['cells_held_all_8_running'], llama_cells):.2f}x" if llama_cells else "-"
        shared.add(name, c["cells_held_all_8_running"], vs, c["prompt_tokens"])
    return "\n\n".join(
        [
            "(a) realtime TTFT, 1-token answers every 0.5 s: unloaded, then with 8 batch clients\n" + str(realtime),
            "(b) context at -c 8192 -np 8\n" + str(context),
            "(c) 8 clients sharing a ~900-token system prompt: KV cells held while all 8 run\n" + str(shared),
        ]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--realtime", type=int, default=20, help="realtime requests per measurement")
    ap.add_argument("--model", default=None, help="GGUF (default: the bundled SmolLM2-135M)")
    ap.add_argument("--llama-server", default=None, help="a llama-server binary (default: build it)")
    ap.add_argument("--batched-bench", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--edgellm-env", action="append", default=[], metavar="KEY=VAL", help="extra edgellm environment")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    model, extra_env = model_and_env(ap, args)
    server_bin, _, build_info = llama_binaries(args.llama_server, args.batched_bench)
    results: dict = {"model": model, "threads": THREADS, "slots": SLOTS, "n_ctx": N_CTX, "llama_server": build_info}
    with tempfile.TemporaryDirectory(prefix="bench-lanes-") as tmp:
        tmpdir = Path(tmp)
        slots_env = {**extra_env, "EDGELLM_KV_UNIFIED": "false"}
        configs: list[tuple[str, Callable[[Path], Server]]] = [
            ("edgellm", lambda d: EdgellmNode.sized(d, model, THREADS, SLOTS, N_CTX, extra_env)),
            ("edgellm-slots", lambda d: EdgellmNode.sized(d, model, THREADS, SLOTS, N_CTX, slots_env)),
            ("llama-server", lambda d: LlamaServer(server_bin, model, THREADS, SLOTS, N_CTX, True, [], d)),
        ]
        for name, make in configs:
            folder = tmpdir / name
            folder.mkdir()
            server = make(folder)
            server.name = name
            print(f"{name}: starting", flush=True)
            server.start()
            try:
                part: dict = {"command": server.cmd}
                if name != "edgellm-slots":  # realtime lanes: edgellm's default layout against llama-server
                    part["realtime"] = {
                        "unloaded": realtime_ttft(server, args.realtime, loaded=False),
                        "loaded": realtime_ttft(server, args.realtime, loaded=True),
                    }
                    print(f"  (a) {json.dumps({k: summary(v['latencies_s']) for k, v in part['realtime'].items()})}")
                part["context"] = context_limits(server)
                print(f"  (b) {json.dumps(part['context'])[:400]}", flush=True)
                part["shared"] = shared_prompt_cells(server)
                print(f"  (c) {json.dumps(part['shared'])}", flush=True)
                results[name] = part
            finally:
                server.stop()
    write_results(results, report(results), args.out)
    return 0


if __name__ == "__main__":
    run_main(main)

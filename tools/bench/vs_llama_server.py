#!/usr/bin/env python
"""edgellm vs llama.cpp's own llama-server, side by side, through /v1/chat/completions.

Same model (the bundled SmolLM2-135M unless --model), 2 threads, 8 slots, 8192 KV cells laid out the same
on both: one pool (llama-server -np 8 -c 8192 --kv-unified, edgellm's default) or, with
--edgellm-env EDGELLM_KV_UNIFIED=false, each slot its share (--no-kv-unified),
128 max tokens, temperature 0.7 (top_p 1, top_k 0, min_p 0 sent explicitly: llama-server's own
defaults differ). llama-server is built once from the pinned llama-cpp-python's sdist with the
engine's flags (tools/llama_server_build.sh), or taken from --llama-server PATH.

Both servers are started first, one at a time, the other paused, each twice for the "ready" times
(process start to the first /health 200): a first start on an empty state dir, then a restart (edgellm
recorded its self-test's pass at the first, engine/start_record.py), then measured in turns A-B-A (edgellm,
llama-server, edgellm; `--turns 5` or 7 go on alternating, for a machine whose speed drifts, and
each llama-server turn is also compared with the edgellm turns either side of it): the idle one
is paused (SIGSTOP on its process group, SIGCONT before its turn), so the two never share the cores. Each turn runs:
  plain chat at 1 and 8 concurrent clients: tok/s = completion tokens (usage) / wall time
  schema-guided JSON (response_format json_schema) at 1 and 8 clients: valid objects per minute
    (parsed and validated against the schema) and how many were valid
and samples the RSS of the server's process tree. Then, with both servers stopped,
`llama-batched-bench -npp 128 -ntg 128 -npl 8` gives the text-generation limit of 8 sequences on
this machine (S_TG), the ceiling for plain c8.

    .venv/bin/python tools/bench/vs_llama_server.py [--requests 32] [--turns 3] [--quick] [--out results.json]
        [--edgellm-env EDGELLM_SPECULATIVE_DECODING=false] [--llama-server PATH] [--llama-server-arg ARG]

Run it on a quiet machine (on a shared one: flock /tmp/edgellm-cpu.lock ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from pydantic import TypeAdapter, ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgellm.runtime.supervision.child_process import die_with_parent  # noqa: E402
from tools.bench.prompts import PROMPTS  # noqa: E402  (the same chat prompts as the node benchmark)
from tools.bench.results import Table, bracket_ratios, times, turns, write_results  # noqa: E402
from tools.bench.servers import (  # noqa: E402
    ABORT,
    EdgellmNode,
    LlamaServer,
    Server,
    llama_binaries,
    model_and_env,
    rss_mb,
    run_main,
    stop_all,
)

THREADS = 2
SLOTS = 8
N_CTX = 8192
MAX_TOKENS = 128
TEMPERATURE = 0.7

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "active"],
    "additionalProperties": False,
}

try:  # the full check when jsonschema is installed, else the keys and their types
    import jsonschema

    _VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)

    def schema_ok(obj: object) -> bool:
        return _VALIDATOR.is_valid(obj)

except ImportError:  # pragma: no cover - jsonschema is in the dev extras
    _TYPES = {"string": str, "integer": int, "boolean": bool}

    def schema_ok(obj: object) -> bool:
        if not isinstance(obj, dict) or set(obj) != set(SCHEMA["required"]):
            return False
        for key, spec in SCHEMA["properties"].items():
            value = obj[key]
            if not isinstance(value, _TYPES[spec["type"]]):
                return False
            if spec["type"] == "integer" and (isinstance(value, bool) or not 0 <= value <= 120):
                return False
            if spec["type"] == "string" and len(value) > spec["maxLength"]:
                return False
        return True


# -- load -----------------------------------------------------------------------------------------
def request_body(model: str, i: int, schema: bool, max_tokens: int) -> dict:
    if schema:
        content = f"Create a fictional person, number {i}, as a JSON object with name, age, city and active."
    else:
        content = PROMPTS[i % len(PROMPTS)]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": TEMPERATURE,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "seed": 1000 + i,
    }
    if schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    return body


def run_load(server: Server, schema: bool, clients: int, n: int, max_tokens: int) -> dict:
    tokens, valid, failed, invalid = [0], [0], [0], [0]
    errors: list[str] = []
    lock = threading.Lock()
    rss: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.25):
            rss.append(rss_mb(server.pids()))

    def client(k: int) -> None:
        with httpx.Client(base_url=server.base, timeout=600) as http:
            for i in range(k, n, clients):
                if ABORT.is_set():
                    return
                try:
                    r = http.post("/v1/chat/completions", json=request_body(server.model_id, i, schema, max_tokens))
                except httpx.HTTPError as exc:
                    with lock:
                        failed[0] += 1
                        errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                with lock:
                    if r.status_code != 200:
                        failed[0] += 1
                        errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
                        continue
                    out = r.json()
                    tokens[0] += int(out.get("usage", {}).get("completion_tokens", 0))
                    if schema:
                        try:
                            ok = schema_ok(json.loads(out["choices"][0]["message"]["content"] or ""))
                        except (ValueError, KeyError, IndexError, TypeError):
                            ok = False
                        valid[0] += ok
                        invalid[0] += not ok

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    # Daemon threads, not a pool: on Ctrl-C the main thread goes on to stop the servers at once (the
    # clients' requests then fail and they end) instead of waiting for the whole load first.
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:
        ABORT.set()
        raise
    finally:
        stop.set()
    wall = time.perf_counter() - t0
    sampler.join()
    rss.append(rss_mb(server.pids()))
    res = {
        "clients": clients,
        "requests": n,
        "wall_s": wall,
        "completion_tokens": tokens[0],
        "tok_s": tokens[0] / wall,
        "failed": failed[0],
        "rss_mb_peak": max(rss),
        "errors": errors[:3],
    }
    if schema:
        res.update(valid=valid[0], invalid=invalid[0], valid_per_min=valid[0] / wall * 60)
    return res


def warm_up(server: Server) -> None:
    body = request_body(server.model_id, 0, False, 8)
    httpx.post(server.base + "/v1/chat/completions", json=body, timeout=120).raise_for_status()


def run_turn(server: Server, n_c1: int, n_c8: int, max_tokens: int) -> dict:
    """One server's turn: resumed, warmed up, the four loads, paused again."""
    turn = {}
    with server.turn():
        warm_up(server)
        for schema in (False, True):
            for clients, n in ((1, n_c1), (SLOTS, n_c8)):
                key = f"{'schema' if schema else 'plain'}_c{clients}"
                turn[key] = r = run_load(server, schema, clients, n, max_tokens)
                extra = f", {r['valid']}/{n} valid, {r['valid_per_min']:.1f}/min" if schema else ""
                print(
                    f"  {server.name:12s} {key:9s}: {r['tok_s']:6.1f} tok/s{extra}, {r['failed']} failed, "
                    f"{r['wall_s']:.1f} s, RSS {r['rss_mb_peak']:.0f} MB",
                    flush=True,
                )
                for e in r["errors"]:
                    print(f"    error: {e}", flush=True)
        try:  # edgellm's engine state (restarts, worker pid) after the turn: a pause must not have cost a restart
            server.health.append(httpx.get(server.base + "/health", timeout=10).json())
        except (httpx.HTTPError, ValueError) as exc:
            server.health.append({"error": str(exc)})
    return turn


# -- llama.cpp's own ceiling --------------------------------------------------------------------
def batched_bench(binary: Path, model: str, npl: int, npp: int, ntg: int) -> dict | None:
    cmd = [str(binary), "-m", model, "-c", str(N_CTX), "-t", str(THREADS), "-tb", str(THREADS), "-fa", "on"]
    cmd += ["-npp", str(npp), "-ntg", str(ntg), "-npl", str(npl)]
    print(f"\n{' '.join(cmd)}", flush=True)
    p = subprocess.run(
        cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900, preexec_fn=die_with_parent()
    )
    header, rows = None, []
    for line in (p.stdout + "\n" + p.stderr).splitlines():
        if not line.strip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells:
            header = cells
        elif header and len(cells) == len(header) and not set("".join(cells)) <= set("-: "):
            rows.append(dict(zip(header, cells, strict=True)))
    if not rows:
        print(f"llama-batched-bench gave no table (exit {p.returncode}):\n{(p.stdout + p.stderr)[-2000:]}")
        return None
    row = next((r for r in rows if r.get("B") == str(npl)), rows[-1])
    print("| " + " | ".join(header) + " |\n| " + " | ".join(row[h] for h in header) + " |", flush=True)
    return {"cmd": cmd, "row": row, "s_tg": float(row["S_TG t/s"]), "s_pp": float(row["S_PP t/s"])}


# -- report ---------------------------------------------------------------------------------------
def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def report(results: dict, bench: dict | None) -> str:
    e_turns, l_turns = results["edgellm"]["turns"], results["llama-server"]["turns"]

    def cell(turns: list[dict], key: str, field: str) -> tuple[float, str]:
        vals = [t[key][field] for t in turns]
        m = mean(vals)
        s = f"{m:.1f}" if len(vals) == 1 else f"{m:.1f} ({' / '.join(f'{v:.1f}' for v in vals)})"
        if field == "valid_per_min":
            s += f", {sum(t[key]['valid'] for t in turns)}/{sum(t[key]['requests'] for t in turns)} valid"
        return m, s

    table = Table("load", "edgellm", "llama-server", "ratio")
    for label, key, field in (
        ("plain c1 tok/s", "plain_c1", "tok_s"),
        (f"plain c{SLOTS} tok/s", f"plain_c{SLOTS}", "tok_s"),
        ("schema valid objects/min c1", "schema_c1", "valid_per_min"),
        (f"schema valid objects/min c{SLOTS}", f"schema_c{SLOTS}", "valid_per_min"),
    ):
        em, es = cell(e_turns, key, field)
        lm, ls = cell(l_turns, key, field)
        table.add(label, es, ls, times(em, lm))
    er, lr = results["edgellm"]["ready_first_s"], results["llama-server"]["ready_first_s"]
    table.add("ready after the first start (s)", f"{er:.1f}", f"{lr:.1f}", times(er, lr))
    er, lr = results["edgellm"]["ready_s"], results["llama-server"]["ready_s"]
    table.add("ready after a restart (s)", f"{er:.1f}", f"{lr:.1f}", times(er, lr))
    erss = max(r["rss_mb_peak"] for t in e_turns for r in t.values())
    lrss = max(r["rss_mb_peak"] for t in l_turns for r in t.values())
    table.add("RSS under load (MB, process tree, peak)", f"{erss:.0f}", f"{lrss:.0f}", times(erss, lrss))
    failed = {
        name: sum(r["failed"] for t in results[name]["turns"] for r in t.values())
        for name in ("edgellm", "llama-server")
    }
    out = str(table)
    out += (
        "\n\nEach server: the mean of its turns (each in parentheses); ratio = edgellm / llama-server. "
        f"Failed requests: edgellm {failed['edgellm']}, llama-server {failed['llama-server']}."
    )
    for key in ("plain_c1", f"plain_c{SLOTS}"):
        brackets = bracket_ratios([t[key]["tok_s"] for t in e_turns], [t[key]["tok_s"] for t in l_turns])
        if brackets:
            each = " / ".join(f"{b:.2f}" for b in brackets)
            out += f"\n{key} bracket ratios: {each} (median {statistics.median(brackets):.2f})"
    if bench:
        e8 = mean([t[f"plain_c{SLOTS}"]["tok_s"] for t in e_turns])
        l8 = mean([t[f"plain_c{SLOTS}"]["tok_s"] for t in l_turns])
        out += (
            f"\nllama-batched-bench TG at {SLOTS} sequences ({' '.join(bench['cmd'][-6:])}): "
            f"S_TG {bench['s_tg']:.1f} tok/s (S_PP {bench['s_pp']:.1f}); "
            f"edgellm c{SLOTS} / TG = {e8 / bench['s_tg']:.2f}, llama-server c{SLOTS} / TG = {l8 / bench['s_tg']:.2f}"
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32, help="requests per c8 load (c1 loads: half)")
    ap.add_argument("--quick", action="store_true", help="a smoke test: 8 requests at c8, 2 at c1")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--model", default=None, help="GGUF (default: the bundled SmolLM2-135M)")
    ap.add_argument("--llama-server", default=None, help="a llama-server binary (default: build it)")
    ap.add_argument("--batched-bench", default=None, help="llama-batched-bench (default: next to llama-server)")
    ap.add_argument("--llama-server-arg", action="append", default=[], help="extra llama-server argument")
    ap.add_argument(
        "--edgellm-env",
        action="append",
        default=[],
        metavar="KEY=VAL",
        help="extra environment for edgellm serve (e.g. EDGELLM_SPECULATIVE_DECODING=false)",
    )
    ap.add_argument(
        "--turns",
        type=int,
        default=3,
        help="turns in all, alternating and starting and ending with edgellm (odd, >= 3; noisy machines: 5-7)",
    )
    ap.add_argument("--no-batched-bench", action="store_true")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.turns < 3 or args.turns % 2 == 0:
        ap.error("--turns must be odd and at least 3 (edgellm, llama-server, edgellm, ...)")
    n_c8 = 8 if args.quick else args.requests
    n_c1 = 2 if args.quick else max(1, args.requests // 2)
    model, extra_env = model_and_env(ap, args)
    try:  # the node's own reading of the variable (pydantic's bool): llama-server gets the layout edgellm runs
        unified = TypeAdapter(bool).validate_python(extra_env.get("EDGELLM_KV_UNIFIED", True))
    except ValidationError:
        ap.error(f"EDGELLM_KV_UNIFIED={extra_env['EDGELLM_KV_UNIFIED']!r} is not a boolean")

    server_bin, bench_bin, build_info = llama_binaries(args.llama_server, args.batched_bench)
    print(
        f"model {Path(model).name}; {THREADS} threads, {SLOTS} slots, n_ctx {N_CTX}; {args.max_tokens} max tokens, "
        f"temperature {TEMPERATURE}; {n_c1} requests at c1, {n_c8} at c{SLOTS}; "
        f"{args.turns} turns alternating edgellm, llama-server, ..., edgellm",
        flush=True,
    )
    results: dict = {
        "model": model,
        "threads": THREADS,
        "slots": SLOTS,
        "n_ctx": N_CTX,
        "max_tokens": args.max_tokens,
        "temperature": TEMPERATURE,
        "requests": {"c1": n_c1, f"c{SLOTS}": n_c8},
        "edgellm_env": extra_env,
        "llama_server_build": build_info,
    }
    with tempfile.TemporaryDirectory(prefix="bench-vs-llama-server-") as tmp:
        tmpdir = Path(tmp)
        edgellm = EdgellmNode.sized(tmpdir, model, THREADS, SLOTS, N_CTX, extra_env)
        llama = LlamaServer(server_bin, model, THREADS, SLOTS, N_CTX, unified, args.llama_server_arg, tmpdir)
        results["commands"] = {"edgellm": edgellm.cmd, "llama-server": llama.cmd}
        try:
            first_start: dict[str, float] = {}
            for server in (edgellm, llama):  # started one at a time, the other paused
                # Twice: a first start on an empty state dir, then a restart as systemd or a reboot does
                # it (edgellm's self-test pass is recorded at the first; both have the model in the page cache).
                server.start()
                first_start[server.name] = server.ready_s
                server.stop()
                server.start()
                print(
                    f"{server.name} ready {first_start[server.name]:.2f} s after its first start, "
                    f"{server.ready_s:.2f} s after a restart ({server.base})",
                    flush=True,
                )
                server.pause()
            measured: dict[str, list[dict]] = {"edgellm": [], "llama-server": []}
            for turn in turns((edgellm, llama), args.turns):
                print(f"turn {turn.number}: {turn.side.name}", flush=True)
                measured[turn.side.name].append(run_turn(turn.side, n_c1, n_c8, args.max_tokens))
            workers = {h.get("result", {}).get("engine", {}).get("worker_pid") for h in edgellm.health}
            if len(workers) > 1:
                print(f"note: edgellm's engine worker changed between turns ({sorted(map(str, workers))})")
            for server in (edgellm, llama):
                results[server.name] = {
                    "ready_first_s": first_start[server.name],
                    "ready_s": server.ready_s,
                    "turns": measured[server.name],
                    "health": server.health,
                }
        except BaseException:
            for server in (edgellm, llama):
                if server.proc is not None and server.proc.poll() is not None:
                    print(f"--- {server.name} log ---\n{server.log_tail()}", file=sys.stderr)
            raise
        finally:
            stop_all()
    bench = None
    if bench_bin and not args.no_batched_bench:
        bench = batched_bench(bench_bin, model, SLOTS, 128, 128)
    results["batched_bench"] = bench
    write_results(results, report(results, bench), args.out)
    return 0


if __name__ == "__main__":
    run_main(main)

#!/usr/bin/env python
"""Guided JSON on real-world schemas, end to end: how many answers are valid, and what happens to the rest.

N schemas sampled (fixed seed: `--n`, `--seed`) from the corpus tests/fixtures/schemas/ (360 public
schemas: SchemaStore, Kubernetes, Berkeley function-calling tool parameters, Snowplow Iglu; see its
SOURCES.md) are sent, one request each, to an edgellm node and, with `--llama-server`, to llama.cpp's own
llama-server on the same model in the same run: interleaved schema by schema (the first server
alternating), the idle one paused (SIGSTOP on its process group), so the two never share the cores. Same
model (the bundled SmolLM2-135M unless --model), 2 threads, 1 slot of --slot-ctx tokens (8192, the model's
training context) on both, one request at a time. Each request:

    POST /v1/chat/completions  temperature 0, max_tokens 384 (--max-tokens),
    messages [{"role": "user", "content": "Produce a realistic example instance of this JSON schema: <schema>"}]
    response_format {"type": "json_schema", "json_schema": {"name": "x", "schema": <schema>, "strict": <--strict>}}

with the schema as the corpus file has it (compact JSON in the prompt). `strict` is false unless --strict:
edgellm then enforces what it can while generating and checks the whole schema after (`schema_valid`,
`schema_error`); with strict true it refuses a schema with parts it cannot enforce, listing them.

Each answer is judged here with the `jsonschema` library (no remote `$ref` is ever fetched: such a ref
cannot be resolved and the answer counts as "unchecked"; no `format` assertions), the draft chosen by the
schema's `$schema` (Snowplow's self-describing meta-schema: draft-04, which it is based on; none or an
unknown one: 2020-12). The Berkeley tool parameters use BFCL's type names (`dict`, `float`, `tuple`,
`String`, `any`, ...): they are sent as they are and validated as BFCL's harness reads them (`dict` ->
object, `float` -> number, `any` -> no type, ...). Classes:

  valid          200, the content parses and validates
  said so        200, it does not, and the server said so: `schema_valid: false` / `schema_error` (edgellm),
                 `guided_incomplete: true`, or finish_reason "length"
  silent         200, it does not, and nothing in the answer says so
  unchecked      200, it parses, but the validator could not judge it (an unresolvable $ref, a regex
                 Python cannot compile)
  refused        a 400 (or another 4xx): the error message's first 80 characters are kept
  no fit         400 because the prompt does not fit the slot's context (context_length_exceeded,
                 llama-server's exceed_context_size_error, or a message saying so)
  5xx, timeout   a server error, or no answer within --timeout s (or a broken connection)

Prints a table per server (counts, valid / schemas whose prompt fits, latency p50/p95 over the 200s), the
refusals grouped by message, and every other answer that is not valid (with its flags and what is wrong);
writes one JSON line per schema and server to --out (default: bench_schemas.jsonl in the temp folder). The
schemas run in the sample's order: a smaller --n with the same seed runs the first of a larger one's.

    flock /tmp/edgellm-cpu.lock .venv/bin/python tools/bench/schemas.py [--n 60] [--seed 0] [--strict]
        [--llama-server [PATH]] [--max-tokens 384] [--slot-ctx 8192] [--out results.jsonl]

llama-server is built once from the pinned llama-cpp-python's sdist with the engine's flags
(tools/llama_server_build.sh, 10-30 min on 2 cores the first time), or taken from --llama-server PATH.
Run it on a quiet machine (on a shared one: flock /tmp/edgellm-cpu.lock ...).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import jsonschema
import referencing
import referencing.exceptions

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.bench.results import Table, percentile  # noqa: E402
from tools.bench.servers import (  # noqa: E402
    ABORT,
    EdgellmNode,
    LlamaServer,
    Server,
    llama_binaries,
    model_and_env,
    run_main,
    stop_all,
)

CORPUS = REPO / "tests" / "fixtures" / "schemas"
THREADS = 2
SLOTS = 1
SLOT_CTX = 8192  # SmolLM2's training context; llama-server gets the same per slot
MAX_TOKENS = 384
TIMEOUT_S = 300.0
PROMPT = "Produce a realistic example instance of this JSON schema: "
CLASSES = ("valid", "said so", "silent", "unchecked", "refused", "no fit", "5xx", "timeout")
LABELS = {
    "said so": "invalid, said so",
    "silent": "invalid, silent",
    "refused": "refused (4xx)",
    "no fit": "prompt does not fit",
}

# $schema -> validator; matched as substrings, first match wins. Snowplow's self-describing meta-schema is
# draft-04 based (tests/fixtures/schemas/SOURCES.md); anything else unknown, or none: 2020-12.
DIALECTS = (
    ("json-schema.org/draft-04/", jsonschema.Draft4Validator),
    ("json-schema.org/draft-06/", jsonschema.Draft6Validator),
    ("json-schema.org/draft-07/", jsonschema.Draft7Validator),
    ("json-schema.org/draft/2019-09/", jsonschema.Draft201909Validator),
    ("json-schema.org/draft/2020-12/", jsonschema.Draft202012Validator),
    ("iglucentral.com/schemas/com.snowplowanalytics.self-desc/", jsonschema.Draft4Validator),
)
# BFCL's type names as its harness reads them ("any": no type constraint).
BFCL_TYPES = {
    "dict": "object", "float": "number", "double": "number", "long": "integer", "int": "integer",
    "short": "integer", "byte": "integer", "char": "string", "tuple": "array", "list": "array",
    "bool": "boolean", "str": "string", "String": "string", "Boolean": "boolean", "Integer": "integer",
    "Long": "integer", "Float": "number", "Double": "number", "Number": "number", "Object": "object",
    "Array": "array", "ArrayList": "array", "HashMap": "object", "Map": "object", "Set": "array",
    "Bigint": "integer", "Any": None, "any": None,
}  # fmt: skip
# A prompt that does not fit a slot's context: edgellm's code and words, llama-server's type and words.
NO_FIT_CODES = {"context_length_exceeded", "exceed_context_size_error"}
NO_FIT_WORDS = re.compile(
    r"context (size|length|window)|prompt is (over )?\d+ tokens|prompt is too long|too many tokens"
    r"|exceeds? the (available )?context|does not fit",
    re.IGNORECASE,
)


# -- the corpus -----------------------------------------------------------------------------------
def sample_schemas(n: int, seed: int) -> list[Path]:
    files = sorted(CORPUS.glob("*/*.json"))
    if not files:
        raise SystemExit(f"no schemas in {CORPUS}")
    # In the sample's order, which mixes the sources over the run; a smaller --n with the same seed is a prefix.
    return random.Random(seed).sample(files, min(n, len(files)))


def bfcl_types(node: object) -> object:
    """A BFCL tool-parameters tree with its type names read as JSON Schema's (the harness's mapping)."""
    if isinstance(node, list):
        return [bfcl_types(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "type" and isinstance(value, str) and value in BFCL_TYPES:
            if BFCL_TYPES[value] is not None:
                out[key] = BFCL_TYPES[value]
        elif key == "type" and isinstance(value, list):
            mapped = [BFCL_TYPES.get(t, t) if isinstance(t, str) else t for t in value]
            if None not in mapped:
                out[key] = mapped
        elif key == "properties" and isinstance(value, dict):  # names, not keywords
            out[key] = {name: bfcl_types(sub) for name, sub in value.items()}
        else:
            out[key] = bfcl_types(value)
    return out


def _no_fetch(uri: str) -> referencing.Resource:
    raise referencing.exceptions.NoSuchResource(ref=uri)


class Checker:
    """The validator of one corpus schema: its draft from $schema, remote refs never fetched."""

    def __init__(self, path: Path, schema: dict):
        judged = bfcl_types(schema) if path.parent.name == "gorilla" else schema
        meta = judged.get("$schema") if isinstance(judged.get("$schema"), str) else ""
        cls = next((v for key, v in DIALECTS if key in meta), jsonschema.Draft202012Validator)
        self.draft = cls.__name__.removesuffix("Validator")
        self.validator = cls(judged, registry=referencing.Registry(retrieve=_no_fetch))

    def problem(self, content: str | None) -> tuple[str | None, str | None]:
        """(kind, message): (None, None) when `content` parses and validates; kind "parse", "schema" or
        "unchecked" otherwise."""
        try:
            instance = json.loads(content or "")
        except ValueError as exc:
            return "parse", f"does not parse: {exc}"
        try:
            error = next(iter(self.validator.iter_errors(instance)), None)
        except (referencing.exceptions.Unresolvable, jsonschema.exceptions._WrappedReferencingError) as exc:
            return "unchecked", f"unresolvable $ref: {exc}"[:300]
        except Exception as exc:  # noqa: BLE001 - a pattern Python cannot compile, an odd keyword value
            return "unchecked", f"{type(exc).__name__}: {exc}"[:300]
        if error is None:
            return None, None
        where = "/" + "/".join(str(p) for p in error.absolute_path)
        return "schema", f"{error.message[:240]} (at {where})"


# -- one request ----------------------------------------------------------------------------------
def request_body(model: str, schema: dict, max_tokens: int, strict: bool) -> dict:
    compact = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT + compact}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}},
    }


def said_so(out: dict, choice: dict) -> list[str]:
    """What in an answer says that its content may not be a valid instance."""
    flags = []
    x = out.get("x_edgellm") or {}
    if choice.get("schema_valid") is False or out.get("schema_valid") is False or x.get("schema_valid") is False:
        flags.append("schema_valid false")
    if choice.get("schema_error") or out.get("schema_error"):
        flags.append("schema_error")
    if choice.get("guided_incomplete") or out.get("guided_incomplete") or x.get("guided_incomplete"):
        flags.append("guided_incomplete")
    if choice.get("finish_reason") == "length":
        flags.append("finish length")
    return flags


def error_of(r: httpx.Response) -> tuple[str, str]:
    """(code or type, message) of an error answer, whatever its shape."""
    try:
        err = r.json()
        err = err.get("error", err) if isinstance(err, dict) else err
        if isinstance(err, dict):
            return str(err.get("code") or err.get("type") or ""), str(err.get("message") or err)
        return "", str(err)
    except ValueError:
        return "", r.text


def run_one(server: Server, http: httpx.Client, path: Path, schema: dict, checker: Checker, args) -> dict:
    body = request_body(server.model_id, schema, args.max_tokens, args.strict)
    row: dict = {"server": server.name, "schema": str(path.relative_to(CORPUS)), "draft": checker.draft}
    row["schema_bytes"] = len(body["messages"][0]["content"]) - len(PROMPT)
    t0 = time.perf_counter()
    try:
        r = http.post(server.base + "/v1/chat/completions", json=body, timeout=args.timeout)
    except httpx.HTTPError as exc:
        row.update({"class": "timeout", "latency_s": time.perf_counter() - t0, "error": f"{type(exc).__name__}"})
        return row
    row["latency_s"] = time.perf_counter() - t0
    row["status"] = r.status_code
    if r.status_code >= 500:
        row.update({"class": "5xx", "error": error_of(r)[1][:300]})
        return row
    if r.status_code != 200:
        code, message = error_of(r)
        no_fit = r.status_code == 400 and (code in NO_FIT_CODES or NO_FIT_WORDS.search(message))
        row.update({"class": "no fit" if no_fit else "refused", "code": code, "error": message[:80]})
        row["error_full"] = message[:2000]
        return row
    out = r.json()
    choice = (out.get("choices") or [{}])[0]
    content = (choice.get("message") or {}).get("content")
    usage = out.get("usage") or {}
    flags = said_so(out, choice)
    kind, problem = checker.problem(content)
    row.update(
        {
            "finish_reason": choice.get("finish_reason"),
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "flags": flags,
            "problem": problem,
            "content": (content or "")[:600],
        }
    )
    for key in ("schema_valid", "schema_error", "guided_incomplete", "truncated_structure"):
        if key in out or key in choice:
            row[key] = choice.get(key, out.get(key))
    if "x_edgellm" in out:
        row["guide_notes"] = (out["x_edgellm"] or {}).get("guide_notes")
    if kind is None:
        row["class"] = "valid"
    elif kind == "unchecked":
        row["class"] = "unchecked"
    else:
        row["class"] = "said so" if flags else "silent"
    return row


# -- report ---------------------------------------------------------------------------------------
def table(rows: list[dict], names: list[str]) -> str:
    counted = Table("server", "schemas", *(LABELS.get(c, c) for c in CLASSES), "valid / prompt fits", "p50 s", "p95 s")
    lines = []
    for name in names:
        mine = [r for r in rows if r["server"] == name]
        counts = Counter(r["class"] for r in mine)
        fits = len(mine) - counts["no fit"]
        share = f"{counts['valid']}/{fits} = {100 * counts['valid'] / fits:.0f}%" if fits else "-"
        lat = [r["latency_s"] for r in mine if r.get("status") == 200]
        p50, p95 = percentile(lat, 0.5), percentile(lat, 0.95)
        cells = [name, str(len(mine)), *(str(counts[c]) for c in CLASSES), share]
        cells += ["-" if p50 is None else f"{p50:.1f}", "-" if p95 is None else f"{p95:.1f}"]
        counted.add(*cells)
    if len(names) > 1:  # latency on the same schemas: those every server answered with a 200
        answered = [{r["schema"] for r in rows if r["server"] == n and r.get("status") == 200} for n in names]
        common = set.intersection(*answered)
        each = []
        for name in names:
            lat = [r["latency_s"] for r in rows if r["server"] == name and r["schema"] in common]
            each.append(f"{name} p50 {percentile(lat, 0.5) or 0:.1f} s, p95 {percentile(lat, 0.95) or 0:.1f} s")
        lines.append(f"\nOn the {len(common)} schemas that every server answered with a 200: {'; '.join(each)}.")
    return "\n".join([str(counted), *lines])


def details(rows: list[dict], names: list[str]) -> str:
    out = []
    for name in names:
        mine = [r for r in rows if r["server"] == name]
        refusals = Counter(r["error"] for r in mine if r["class"] == "refused")
        for message, k in refusals.most_common():
            out.append(f"{name} refused {k}x: {message!r}")
        for r in mine:
            if r["class"] in ("silent", "said so", "unchecked", "5xx", "timeout"):
                why = r.get("problem") or r.get("error")
                flags = f" [{', '.join(r['flags'])}]" if r.get("flags") else ""
                out.append(f"{name} {r['class']}: {r['schema']}{flags}: {why}")
    return "\n".join(out)


# -- servers --------------------------------------------------------------------------------------
def engine_health(server: Server) -> dict:
    """edgellm's engine worker (pid, restarts) from /health; {} from a server that does not say."""
    try:
        body = httpx.get(server.base + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}
    engine = (body.get("result") or body).get("engine") if isinstance(body, dict) else None
    return {k: engine.get(k) for k in ("worker_pid", "restarts")} if isinstance(engine, dict) else {}


def warm_up(server: Server) -> None:
    server.chat({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, timeout=120).raise_for_status()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=60, help="schemas sampled from the corpus")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    ap.add_argument("--strict", action="store_true", help="send json_schema.strict true (default false)")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--slot-ctx", type=int, default=SLOT_CTX, help="context tokens of the one slot, both servers")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per request")
    ap.add_argument("--model", default=None, help="GGUF (default: the bundled SmolLM2-135M)")
    ap.add_argument(
        "--llama-server",
        nargs="?",
        const="build",
        default=None,
        metavar="PATH",
        help="also run llama-server (a binary, or none: build it with tools/llama_server_build.sh)",
    )
    ap.add_argument("--llama-server-arg", action="append", default=[], help="extra llama-server argument")
    ap.add_argument(
        "--edgellm-env", action="append", default=[], metavar="KEY=VAL", help="extra environment for edgellm serve"
    )
    ap.add_argument(
        "--out", default=str(Path(tempfile.gettempdir()) / "bench_schemas.jsonl"), help="per-schema JSON lines"
    )
    args = ap.parse_args()
    model, extra_env = model_and_env(ap, args)
    paths = sample_schemas(args.n, args.seed)
    schemas = [json.loads(p.read_text(encoding="utf-8")) for p in paths]
    checkers = [Checker(p, s) for p, s in zip(paths, schemas, strict=True)]
    llama_bin = None
    if args.llama_server:  # "build" (the flag alone): the build script's binary
        llama_bin = llama_binaries(None if args.llama_server == "build" else args.llama_server)[0]
    n_ctx = SLOTS * args.slot_ctx
    print(
        f"model {Path(model).name}; {len(paths)} schemas (seed {args.seed}) of {len(list(CORPUS.glob('*/*.json')))}; "
        f"{THREADS} threads, {SLOTS} slot of {args.slot_ctx} tokens; max_tokens {args.max_tokens}, temperature 0, "
        f"strict {str(args.strict).lower()}; {'edgellm and llama-server, interleaved' if llama_bin else 'edgellm'}",
        flush=True,
    )
    rows: list[dict] = []
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-schemas-") as tmp:
        tmpdir = Path(tmp)
        servers: list[Server] = [EdgellmNode.sized(tmpdir, model, THREADS, SLOTS, n_ctx, extra_env)]
        if llama_bin:  # one slot: its KV layout (a share or the pool) is the same cells
            servers.append(LlamaServer(llama_bin, model, THREADS, SLOTS, n_ctx, False, args.llama_server_arg, tmpdir))
        names = [s.name for s in servers]
        try:
            for server in servers:  # started one at a time, the other paused
                server.start()
                warm_up(server)
                if server is servers[0]:
                    health_before = engine_health(server)
                print(f"{server.name} ready in {server.ready_s:.1f} s ({' '.join(server.cmd[:3])} ...)", flush=True)
                if len(servers) > 1:
                    server.pause()
            with httpx.Client() as http:
                for i, (path, schema, checker) in enumerate(zip(paths, schemas, checkers, strict=True)):
                    order = servers if i % 2 == 0 else servers[::-1]
                    for server in order:
                        if ABORT.is_set():
                            raise KeyboardInterrupt("aborted")
                        with server.turn(pause_after=len(servers) > 1):
                            row = run_one(server, http, path, schema, checker, args)
                        rows.append(row)
                        what = row.get("problem") or row.get("error") or ""
                        print(
                            f"[{i + 1}/{len(paths)}] {server.name:12s} {row['schema']:60s} {row['class']:9s} "
                            f"{row['latency_s']:6.1f} s  {what[:90]}",
                            flush=True,
                        )
            if servers[0].paused:
                servers[0].resume()
            health_after = engine_health(servers[0])
            if health_before != health_after:
                print(f"note: edgellm's engine worker changed during the run: {health_before} -> {health_after}")
        except BaseException:
            for server in servers:
                if server.proc is not None and server.proc.poll() is not None:
                    print(f"--- {server.name} log ---\n{server.log_tail()}", file=sys.stderr)
            raise
        finally:
            stop_all()
            if rows:
                with open(args.out, "w", encoding="utf-8") as f:
                    for row in rows:
                        f.write(json.dumps(row, ensure_ascii=False) + "\n")
    wall = time.monotonic() - t_start
    print(f"\n{table(rows, names)}\n")
    print(details(rows, names))
    print(f"\n{len(rows)} requests in {wall / 60:.1f} min; per-schema results: {args.out}")
    return 0


if __name__ == "__main__":
    run_main(main)

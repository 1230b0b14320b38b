"""`edgellm synth`: the thin command over `generator.generate` (arguments, progress bar, exit codes)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_synth_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schema", required=True, help="JSON schema file each record must match")
    p.add_argument("--count", type=int, required=True, help="valid, unique records wanted in OUTPUT")
    p.add_argument("-o", "--output", required=True, help="JSONL file (one record a line); a rerun resumes it")
    p.add_argument("--endpoint", default="http://127.0.0.1:8765", help="the node's base URL (default %(default)s)")
    p.add_argument(
        "--prompt",
        help="prompt template; {index} (record number), {fields} (the schema's fields) and {schema} are "
        "replaced (default: 'Create one synthetic record #{index} ... with these fields: {fields} ...')",
    )
    p.add_argument("--temperature", type=float, default=0.9, help="sampling temperature, 0-1.5 (default 0.9)")
    p.add_argument("--seed", type=int, default=0, help="per-record seeds derive from it (a rerun: the same records)")
    p.add_argument("--max-tokens", type=int, default=512, help="token budget per record, 16-4096 (default 512)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--max-attempts", type=int, help="attempts this run may make (default 3 x COUNT)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per HTTP request (default 600)")
    p.add_argument("--token", default=os.environ.get("INFERENCE_API_TOKEN"), help="bearer token ($INFERENCE_API_TOKEN)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--summary-json", action="store_true", help="print the summary as one JSON line on stdout")


def _fail(message: str) -> int:
    print(f"edgellm synth: {message}", file=sys.stderr)
    return 2


def run_synth_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from edgellm.synth.generator import SynthOptions, SynthProgress, generate
    from edgellm.synth.schema import SynthInputError, load_schema

    opts = SynthOptions(
        count=args.count,
        endpoint=args.endpoint,
        prompt_template=args.prompt,
        temperature=args.temperature,
        seed=args.seed,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        token=args.token or None,
        timeout_s=args.timeout,
        max_attempts=args.max_attempts,
    )
    try:
        opts.check()
        schema = load_schema(args.schema)
    except SynthInputError as exc:
        return _fail(exc.message)
    bar = None if args.quiet else tqdm(total=opts.count, unit="rec", desc="synth", dynamic_ncols=True)

    def on_progress(p: SynthProgress) -> None:
        if bar is None:
            return
        bar.n = min(p.valid, opts.count)
        bar.set_postfix(invalid=p.invalid, dup=p.duplicates, failed=p.failed, refresh=False)
        bar.refresh()

    try:
        summary = generate(schema, args.output, opts, on_progress=on_progress)
    except SynthInputError as exc:
        if bar is not None:
            bar.close()
        return _fail(exc.message)
    except OSError as exc:  # disk full, permissions: what was written is kept and journaled
        if bar is not None:
            bar.close()
        print(f"edgellm synth: {exc}", file=sys.stderr)
        return 1
    if bar is not None:
        bar.close()
    line = (
        f"{summary.valid}/{summary.count} valid records in {summary.output} ({summary.new_valid} new; "
        f"{summary.invalid} invalid, {summary.duplicates} duplicates, {summary.failed} failed requests; "
        f"{summary.records_per_min:.1f} records/min)"
    )
    print(line, file=sys.stderr)
    if args.summary_json:
        print(json.dumps(summary.to_dict()))
    if summary.error:
        print(f"edgellm synth: stopped: {summary.error}", file=sys.stderr)
        if summary.last_failure and summary.last_failure not in summary.error:
            print(f"edgellm synth: last failure: {summary.last_failure}", file=sys.stderr)
    if summary.interrupted:
        sys.stderr.flush()
        os._exit(130)  # do not wait for requests still in flight
    if summary.refused:
        return 2
    return 0 if summary.complete else 1

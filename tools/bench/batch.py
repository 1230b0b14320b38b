#!/usr/bin/env python
"""Throughput of `edgellm batch-run` against a local node at several concurrencies (same run).

python tools/bench/batch.py [--requests 32] [--max-tokens 128] [--concurrency 1,8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.results import Table  # noqa: E402
from tools.bench.servers import EdgellmNode, run_main  # noqa: E402

PROMPTS = [
    "Describe a city at night.",
    "Explain how rain forms.",
    "Write a short poem about trains.",
    "List some uses of copper.",
    "Tell a story about a cat.",
    "Explain what a compiler does.",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,8")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        node = EdgellmNode(tmp / "node", "--log-level", "warning").start()
        try:
            reqs = [
                {
                    "id": f"r{i}",
                    "model": node.model_id,
                    "max_tokens": args.max_tokens,
                    "temperature": 0.7,
                    "seed": i,
                    "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                }
                for i in range(args.requests)
            ]
            src = tmp / "requests.json"
            src.write_text(json.dumps({"requests": reqs}))
            table = Table("concurrency", "requests", "wall s", "requests/s", "completion tok/s", "failed")
            for c in (int(x) for x in args.concurrency.split(",")):
                out = tmp / f"results-{c}.jsonl"
                t0 = time.perf_counter()
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "edgellm",
                        "batch-run",
                        str(src),
                        "-o",
                        str(out),
                        "--endpoint",
                        node.base + "/v1",
                        "--concurrency",
                        str(c),
                        "-q",
                    ],
                    check=False,
                )
                wall = time.perf_counter() - t0
                lines = [json.loads(x) for x in out.read_text().splitlines()]
                toks = sum(x["response"]["usage"]["completion_tokens"] for x in lines if x["status"] == "ok")
                failed = sum(x["status"] != "ok" for x in lines)
                table.add(c, len(lines), f"{wall:.1f}", f"{len(lines) / wall:.2f}", f"{toks / wall:.1f}", failed)
            table.print()  # at the end: batch-run prints a line of its own after each run
        finally:
            node.stop()
    return 0


if __name__ == "__main__":
    run_main(main)

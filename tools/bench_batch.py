#!/usr/bin/env python
"""Throughput of `edgellm batch-run` against a local node at several concurrencies (same run).

python tools/bench_batch.py [--requests 32] [--max-tokens 128] [--concurrency 1,8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.nodeproc import NodeProcess  # noqa: E402

PROMPTS = [
    "Describe a city at night.",
    "Explain how rain forms.",
    "Write a short poem about trains.",
    "List some uses of copper.",
    "Tell a story about a cat.",
    "Explain what a compiler does.",
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,8")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        node = NodeProcess(tmp / "state", "--log-level", "warning").start()
        try:
            model = json.loads(subprocess.check_output(["curl", "-s", node.base + "/v1/models"]))["data"][0]["id"]
            reqs = [
                {
                    "id": f"r{i}",
                    "model": model,
                    "max_tokens": args.max_tokens,
                    "temperature": 0.7,
                    "seed": i,
                    "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                }
                for i in range(args.requests)
            ]
            src = tmp / "requests.json"
            src.write_text(json.dumps({"requests": reqs}))
            print("| concurrency | requests | wall s | requests/s | completion tok/s | failed |")
            print("|---|---|---|---|---|---|")
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
                print(f"| {c} | {len(lines)} | {wall:.1f} | {len(lines) / wall:.2f} | {toks / wall:.1f} | {failed} |")
        finally:
            node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Speculative decoding (prompt-lookup drafts) vs none, single stream, in one run.

Three tasks on the in-process engine (the node's scheduler): extract fields of a given paragraph into
JSON (schema-guided), summarise / restate a given text, and free-form generation (nothing to copy: the
no-loss check). Each runs 3 times without drafts (request flag), 3 times with the adaptive rule (drafts
sent only where this device's measured decode costs say they pay: engine/decode_cost.py) and 3 times
with every proposal sent (the rule off), interleaved, temperature 0; prints median tokens/s, the
ratios to no drafts, and the share of draft tokens accepted. The outputs of all three are compared
too: they must be identical.

    python tools/bench/speculative.py [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgellm.engine.config import ModelConfig  # noqa: E402
from edgellm.engine.types import EngineRequest, GuideKind, GuideSpec, SamplingParams  # noqa: E402
from edgellm.offline import OfflineEngine  # noqa: E402
from edgellm.runtime.model_sizing import bundled_model_path  # noqa: E402
from tools.bench.prompts import REPORT  # noqa: E402
from tools.bench.results import Table, times, turns  # noqa: E402
from tools.bench.servers import run_main  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "operator": {"type": "string"},
        "valve": {"type": "string"},
        "row": {"type": "integer"},
        "part_number": {"type": "string"},
        "moisture_before": {"type": "integer"},
        "moisture_after": {"type": "integer"},
        "next_inspection": {"type": "string"},
        "follow_up": {"type": "string"},
    },
    "required": [
        "operator",
        "valve",
        "row",
        "part_number",
        "moisture_before",
        "moisture_after",
        "next_inspection",
        "follow_up",
    ],
    "additionalProperties": False,
}
TASKS = {
    "extract to JSON (schema)": (
        f"Extract the fields from this log as JSON.\n\n{REPORT}",
        GuideSpec(GuideKind.JSON_SCHEMA, SCHEMA),
    ),
    "restate a given text": (
        f"Rewrite this log as a clear report for the farm manager, keeping every detail.\n\n{REPORT}",
        None,
    ),
    "free-form (nothing to copy)": ("Write a short story about a robot that learns to grow tomatoes.", None),
}


def run(engine: OfflineEngine, task: str, mode: str, max_tokens: int, i: int) -> tuple[float, str]:
    """mode: "off" (no drafts), "adaptive" (the cost rule) or "always" (every proposal verified)."""
    content, guide = TASKS[task]
    speculative = mode != "off"
    engine.scheduler.speculation.adaptive_drafts = mode != "always"
    request = EngineRequest(
        f"{task[:8]}-{mode}-{i}",
        [{"role": "user", "content": content}],
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        guide=guide,
        cache_lookup=False,
        speculative=speculative,
    )
    outs, stats = engine.generate([request])
    # A guided output cut by max_tokens still counts: its tokens were generated the same way.
    return outs[0].completion_tokens / stats.wall_s, outs[0].text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=bundled_model_path())
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    config = ModelConfig(path=args.model, n_ctx=4096, n_slots=1)
    table = Table(
        "task",
        "tok/s off",
        "adaptive",
        "ratio",
        "always",
        "ratio",
        "accepted (adaptive / always)",
        "same text",
        stream=True,
    )
    with OfflineEngine(config) as engine:
        run(engine, "free-form (nothing to copy)", "adaptive", 8, -1)  # warm-up
        stats = engine.scheduler.stats
        print("decode cost (ms by tokens):", engine.scheduler.decode_cost.table())
        modes = ("off", "adaptive", "always")  # "off" first: the baseline
        for task in TASKS:
            rates: dict[str, list[float]] = {mode: [] for mode in modes}
            shares = {"adaptive": [0, 0], "always": [0, 0]}
            texts = set()
            for turn in turns(modes, args.runs * len(modes)):
                drafted0, accepted0 = stats.drafted_tokens, stats.accepted_tokens
                rate, text = run(engine, task, turn.side, args.max_tokens, turn.round)
                rates[turn.side].append(rate)
                texts.add(text)
                if turn.side in shares:
                    shares[turn.side][0] += stats.accepted_tokens - accepted0
                    shares[turn.side][1] += stats.drafted_tokens - drafted0
            off, adaptive, always = (statistics.median(rates[m]) for m in modes)
            accepted = " / ".join(f"{a}/{d}" if d else "-" for a, d in shares.values())
            table.add(
                task,
                f"{off:.1f}",
                f"{adaptive:.1f}",
                times(adaptive, off),
                f"{always:.1f}",
                times(always, off),
                accepted,
                len(texts) == 1,
            )
    return 0


if __name__ == "__main__":
    run_main(main)

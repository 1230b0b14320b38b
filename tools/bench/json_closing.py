#!/usr/bin/env python
"""Seed 003's "JSON-only output" example: the share of outputs that parse, without vs with closing steering.

The example (system "Return a JSON object only.", user "Generate a simple profile.", response_format
json_object) at temperature 0.2, max_tokens 200 and 64, for 20 seeds, on the in-process engine. "before" turns
the steering off (what the engine did until now: the object is cut at max_tokens and the request fails),
"after" is the default. Also reports how many outputs were steered (truncated_structure) and the mean tokens.

    python tools/bench/json_closing.py [--seeds 20]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgellm.engine.config import ModelConfig  # noqa: E402
from edgellm.engine.types import EngineRequest, GuideKind, GuideSpec, SamplingParams  # noqa: E402
from edgellm.offline import OfflineEngine  # noqa: E402
from edgellm.runtime.model_sizing import bundled_model_path  # noqa: E402
from tools.bench.results import Table  # noqa: E402
from tools.bench.servers import run_main  # noqa: E402

MESSAGES = [
    {"role": "system", "content": "Return a JSON object only."},
    {"role": "user", "content": "Generate a simple profile."},
]


def parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=bundled_model_path())
    p.add_argument("--seeds", type=int, default=20)
    args = p.parse_args()
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    table = Table("max_tokens", "steering", "parse", "steered", "mean tokens", stream=True)
    with OfflineEngine(ModelConfig(path=args.model, n_ctx=4096, n_slots=4)) as engine:
        for max_tokens in (200, 64):
            for steer in (False, True):
                engine.scheduler.token_step.close_json = steer
                requests = [
                    EngineRequest(
                        f"{max_tokens}-{steer}-{seed}",
                        MESSAGES,
                        SamplingParams(temperature=0.2, seed=seed, max_tokens=max_tokens),
                        guide=GuideSpec(GuideKind.JSON_OBJECT),
                        cache_lookup=False,
                    )
                    for seed in range(args.seeds)
                ]
                outs, _ = engine.generate(requests)
                ok = sum(1 for o in outs if o.error is None and parses(o.text))
                steered = sum(1 for o in outs if o.truncated_structure)
                mean = sum(o.completion_tokens for o in outs) / len(outs)
                label = "after" if steer else "before"
                table.add(max_tokens, label, f"{ok}/{len(outs)}", steered, f"{mean:.1f}")
    return 0


if __name__ == "__main__":
    run_main(main)

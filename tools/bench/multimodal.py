#!/usr/bin/env python
"""Images inside the continuous batch: 8 text requests vs 1 image request among 7 text requests, in one run.

The engine (edgellm/offline.py: the node's scheduler, in-process) runs 8 chat requests together, each
generating up to --max-tokens tokens, three times: text only (the baseline), then with request 0 carrying
an image through a tiny test projector (16 image tokens), then through a ViT-S-sized projector
(224 px, patch 14, 6 layers of width 384: 256 image tokens, about what LLaVA-1.5 / Gemma 3 feed a model).
Both projectors have random weights (tools/build_mmproj.py): the outputs mean nothing, the costs are real.

Prints generated tokens/s and its ratio to the baseline, the image's encode+decode time per chunk
(scheduler stats), and the image request's time to first token.

    python tools/bench/multimodal.py [--max-tokens 96] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgellm.engine.config import ModelConfig  # noqa: E402
from edgellm.engine.types import EngineRequest, SamplingParams  # noqa: E402
from edgellm.media.types import ImageInput  # noqa: E402
from edgellm.offline import OfflineEngine  # noqa: E402
from edgellm.runtime.model_sizing import bundled_model_path  # noqa: E402
from tools.bench.prompts import PROMPTS  # noqa: E402
from tools.bench.results import Table, times  # noqa: E402
from tools.bench.servers import run_main  # noqa: E402
from tools.build_mmproj import build_vision_mmproj, text_model_n_embd  # noqa: E402


def photo(seed: int) -> ImageInput:
    """A 640x480 camera-sized frame (the projector resizes it)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    return ImageInput.of(640, 480, pixels.tobytes())


def requests(round_: int, with_image: bool, max_tokens: int) -> list[EngineRequest]:
    out = []
    for i in range(8):
        sampling = SamplingParams(temperature=0.7, top_p=0.95, seed=100 * round_ + i, max_tokens=max_tokens)
        text = PROMPTS[i % len(PROMPTS)]
        media = []
        if with_image and i == 0:
            content: str | list = [{"type": "media", "index": 0}, {"type": "text", "text": "Describe this picture."}]
            media = [photo(round_)]
        else:
            content = text
        rid = f"r{round_}-{i}"
        out.append(
            EngineRequest(rid, [{"role": "user", "content": content}], sampling, media=media, cache_lookup=False)
        )
    return out


def run(engine: OfflineEngine, rounds: int, with_image: bool, max_tokens: int) -> dict:
    stats = engine.scheduler.stats
    chunks0, media0, enc0 = stats.media_chunks, stats.media_s, stats.media_encode_s
    tok_s, ttft = [], []
    for r in range(rounds):
        outs, run_stats = engine.generate(requests(r, with_image, max_tokens))
        errors = [o.error for o in outs if o.error]
        if errors:
            raise SystemExit(f"a request failed: {errors[0]}")
        tok_s.append(sum(o.completion_tokens for o in outs) / run_stats.wall_s)
        ttft.append(outs[0].timings.get("ttft_ms", 0.0))
    chunks = stats.media_chunks - chunks0
    return {
        "tok_s": statistics.median(tok_s),
        "ttft_ms": statistics.median(ttft),
        "media_ms": 1000 * (stats.media_s - media0) / chunks if chunks else 0.0,
        "encode_ms": 1000 * (stats.media_encode_s - enc0) / chunks if chunks else 0.0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=bundled_model_path())
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    n_embd = text_model_n_embd(args.model)
    folder = Path(tempfile.mkdtemp(prefix="bench-mm-"))
    tiny = build_vision_mmproj(folder / "tiny.gguf", n_embd_text=n_embd)
    vits = build_vision_mmproj(
        folder / "vit-s.gguf", n_embd_text=n_embd, image_size=224, patch_size=14, hidden=384, layers=7, heads=6
    )
    rows = []
    for label, mmproj, with_image in (
        ("8 text (baseline)", tiny, False),
        ("1 image (16 tok) + 7 text", tiny, True),
        ("1 image (256 tok, ViT-S) + 7 text", vits, True),
    ):
        config = ModelConfig(path=args.model, n_ctx=8192, n_slots=8, n_threads=args.threads, mmproj_path=str(mmproj))
        with OfflineEngine(config) as engine:
            engine.generate(requests(99, with_image, 4))  # warm-up (lazy init, first encode)
            t0 = time.perf_counter()
            result = run(engine, args.rounds, with_image, args.max_tokens)
            result["wall"] = time.perf_counter() - t0
        rows.append((label, result))
    base = rows[0][1]["tok_s"]
    table = Table("run", "tok/s", "ratio", "encode ms", "enc+decode ms", "req0 TTFT ms")
    for label, r in rows:
        enc = f"{r['encode_ms']:.1f}" if r["media_ms"] else "-"
        media = f"{r['media_ms']:.1f}" if r["media_ms"] else "-"
        table.add(label, f"{r['tok_s']:.1f}", times(r["tok_s"], base), enc, media, f"{r['ttft_ms']:.0f}")
    table.print()
    return 0


if __name__ == "__main__":
    run_main(main)

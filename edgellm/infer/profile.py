"""`edgellm infer`'s profile document: per batch (wall, prefill and generation time, tokens and rates, the
median time to first token, steps) and for the whole job (model load, warm-up, totals, peak RSS).

Separate from runner.py (which runs the batches and builds the output document): the profile's figures
and names change on their own, as the benchmarks read them, not with how the batches are run.
"""

from __future__ import annotations

import resource
from typing import Any

from edgellm.api.text_state import RequestOutput
from edgellm.infer.contract import InferBatch, InferJob
from edgellm.offline import RunStats


def batch_profile(batch: InferBatch, n_items: int, outputs: list[RequestOutput], stats: RunStats) -> dict[str, Any]:
    generation_s = max(0.0, stats.decode_s - stats.prefill_s)
    ttfts = sorted(o.timings.get("ttft_ms", 0.0) for o in outputs if o.timings)
    return {
        "batch_idx": batch.batch_idx,
        "requests": n_items,
        "lora_name": batch.lora_name,
        "num_logprobs": batch.num_logprobs,
        "wall_ms": round(1000 * stats.wall_s, 2),
        "prefill_ms": round(1000 * stats.prefill_s, 2),
        "generation_ms": round(1000 * generation_s, 2),
        "prefill_tokens": stats.prompt_tokens,
        "reused_prefix_tokens": stats.reused_tokens,
        "generated_tokens": stats.generated_tokens,
        "prefill_tokens_per_s": rate(stats.prompt_tokens, stats.prefill_s),
        "generation_tokens_per_s": rate(stats.generated_tokens, generation_s),
        "ttft_ms_median": round(ttfts[len(ttfts) // 2], 2) if ttfts else None,
        "steps": stats.steps,
    }


def rate(tokens: int, seconds: float) -> float | None:
    return round(tokens / seconds, 2) if seconds > 0 else None


def job_profile(
    job: InferJob,
    batches: list[dict[str, Any]],
    model_info: dict[str, Any],
    load_s: float,
    warmup_s: float,
    total_s: float,
    failed: int,
) -> dict[str, Any]:
    prefill_ms = sum(b.get("prefill_ms", 0.0) for b in batches)
    generation_ms = sum(b.get("generation_ms", 0.0) for b in batches)
    prefill_tokens = sum(b.get("prefill_tokens", 0) for b in batches)
    generated = sum(b.get("generated_tokens", 0) for b in batches)
    run_ms = sum(b.get("wall_ms", 0.0) for b in batches)
    return {
        "input_file": job.input_file,
        "model": model_info,
        "requests": len(job.items),
        "failed": failed,
        "batch_size": job.batch_size,
        "batches": batches,
        "totals": {
            "model_load_ms": round(1000 * load_s, 2),
            "warmup_ms": round(1000 * warmup_s, 2),
            "run_ms": round(run_ms, 2),
            "total_ms": round(1000 * total_s, 2),
            "prefill_ms": round(prefill_ms, 2),
            "generation_ms": round(generation_ms, 2),
            "prefill_tokens": prefill_tokens,
            "reused_prefix_tokens": sum(b.get("reused_prefix_tokens", 0) for b in batches),
            "generated_tokens": generated,
            "prefill_tokens_per_s": rate(prefill_tokens, prefill_ms / 1000),
            "generation_tokens_per_s": rate(generated, generation_ms / 1000),
            "end_to_end_tokens_per_s": rate(generated, run_ms / 1000),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        },
    }

"""Size the context to the board's memory, from the GGUF's header alone (nothing is loaded).

On a Jetson the CPU and GPU share one pool of memory, so the weights, the KV cache, llama.cpp's compute
buffers and the node's own processes all come out of the same MemAvailable. The plan adds them up before
llama.cpp is asked for a context: a context that does not fit would otherwise be found out by the OOM
killer (or a failed cudaMalloc) minutes into serving, not by a clear refusal at start.

This module holds the plan (MemoryPlan, plan_memory: the context and slot count chosen, its refusal in
words, the table) and the command line; what each part costs is memory_costs.py, the budget's sources
memory_budget.py.

Usage: python -m edgellm.engine.memory_plan MODEL.gguf [--budget 6GiB] [--kv q8_0] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from typing import Literal

from edgellm.engine.memory_budget import default_budget_bytes, parse_size
from edgellm.engine.memory_costs import (
    CELL_ALIGN,
    DEFAULT_CUDA_CONTEXT_BYTES,
    GIB,
    KV_BYTES_PER_ELEMENT,
    MIB,
    compute_bytes,
    cuda_device_present,
    draft_bytes,
    embedding_bytes,
    kv_bytes_per_token,
    kv_cells,
    projector_bytes,
    round_up,
)
from edgellm.engine.shape import ModelShape

# An edge board serves a few clients at once. With a unified pool more slots cost no KV, only batch width;
# "auto" still sizes the pool as this many requests of min(n_ctx_train, max_slot_ctx) tokens each.
AUTO_SLOTS = 4
# The node's own processes (API + engine worker: Python, FastAPI, numpy, tokenizer and grammar caches) measure
# ~70 + ~50 MiB idle; 150 MiB leaves room for request state. The OS and other programs are covered by the
# share of MemAvailable that default_budget_bytes leaves outside the budget; the CUDA runtime is planned for
# on its own (cuda_bytes) when layers go to a GPU.
DEFAULT_OVERHEAD_BYTES = 150 * MIB


@dataclass(frozen=True)
class MemoryPlan:
    """What the node will hold in memory for one model and context; `fits` says whether that is within
    the budget. Sizes in bytes."""

    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    overhead_bytes: int
    budget_bytes: int
    n_ctx: int
    n_slots: int
    kv_type: str
    kv_cells: int  # the pool llama.cpp allocates for n_ctx (padded to 256), what kv_bytes counts
    n_batch: int = 512
    flash_attn: bool = True
    auto_ctx: bool = False  # n_ctx was chosen here ("auto"), not given
    # The embedding context (engine/embedder.py, made on the first /v1/embeddings request) and a dedicated
    # embedding model's weights: see embedding_bytes().
    embedding_bytes: int = 0
    # A draft model (engine/draft_model.py): its weights and compute buffers (draft_bytes), and its own KV
    # pool, as many cells as the target's (draft_kv_bytes): see draft_bytes().
    draft_bytes: int = 0
    draft_kv_bytes: int = 0
    # The CUDA runtime (context, cuBLAS, llama.cpp's pools: DEFAULT_CUDA_CONTEXT_BYTES), counted only when
    # layers go to a GPU; and the multimodal projector (its weights and compute buffer: projector_bytes()).
    cuda_bytes: int = 0
    projector_bytes: int = 0
    n_ctx_train: int = 0  # the model's trained context (0: unknown): no request holds more
    kv_unified: bool = True  # one pool (False: each slot owns kv_cells / n_slots)

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.kv_bytes
            + self.compute_bytes
            + self.overhead_bytes
            + self.embedding_bytes
            + self.draft_bytes
            + self.draft_kv_bytes
            + self.cuda_bytes
            + self.projector_bytes
        )

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes

    @property
    def base_bytes(self) -> int:
        """Everything but the KV caches: what the model costs before any context."""
        return (
            self.weights_bytes
            + self.compute_bytes
            + self.overhead_bytes
            + self.embedding_bytes
            + self.draft_bytes
            + self.cuda_bytes
            + self.projector_bytes
        )

    @property
    def seq_ctx(self) -> int:
        """The most tokens one request may hold: the whole pool (a slot's share without kv_unified), capped
        at the model's trained context."""
        cells = self.kv_cells if self.kv_unified else self.kv_cells // self.n_slots
        return min(cells, self.n_ctx_train) if self.n_ctx_train > 0 else cells

    def refusal(self) -> str | None:
        """None when the plan fits; else why not and what to change, for the node to refuse to start with."""
        if self.fits:
            return None
        budget = f"memory_budget is {_size(self.budget_bytes)}"
        if self.base_bytes > self.budget_bytes:
            return (
                f"the model's weights ({_size(self.weights_bytes)}) plus compute buffers "
                f"({_size(self.compute_bytes)}), "
                + (
                    f"embeddings ({_size(self.embedding_bytes)}: embedding_ctx 0 turns them off), "
                    if self.embedding_bytes
                    else ""
                )
                + (f"the draft model ({_size(self.draft_bytes)}), " if self.draft_bytes else "")
                + (
                    f"the projector ({_size(self.projector_bytes)}: weights and compute buffer), "
                    if self.projector_bytes
                    else ""
                )
                + (
                    f"the CUDA runtime ({_size(self.cuda_bytes)}: cuda_context_mib; n_gpu_layers 0 runs without it), "
                    if self.cuda_bytes
                    else ""
                )
                + f"and the runtime reserve ({_size(self.overhead_bytes)}) need "
                f"{_size(self.base_bytes)} before any context, but {budget}; use a smaller model or quant, "
                "or raise memory_budget"
            )
        fixes = ["lower n_ctx"] if not self.auto_ctx else ["lower n_slots (auto sizes the pool by it)"]
        if self.kv_type != "q8_0":
            fixes.append("set kv_cache_type to q8_0")
        fixes.append("use a smaller quant or raise memory_budget")
        what = (
            f"even the smallest pool ({self.kv_cells} cells for {self.n_slots} slot(s))"
            if self.auto_ctx
            else f"a KV pool of n_ctx={self.n_ctx} cells"
        )
        draft_kv = f" (and {_size(self.draft_kv_bytes)} for the draft model's)" if self.draft_kv_bytes else ""
        extras = [
            name for name, n in (("the projector", self.projector_bytes), ("the CUDA runtime", self.cuda_bytes)) if n
        ]
        base_what = "weights, compute buffers, " + (", ".join(extras) + " and " if extras else "") + "runtime"
        return (
            f"{what} needs {_size(self.kv_bytes)} of {self.kv_type} KV cache{draft_kv} on top of "
            f"{_size(self.base_bytes)} "
            f"for {base_what}: {_size(self.total_bytes)} in all, but {budget}; " + ", ".join(fixes)
        )

    def to_dict(self) -> dict[str, object]:
        """For /status: sizes in MiB (0.1) and in bytes, and the context the node runs with."""
        sizes = {
            "weights": self.weights_bytes,
            "kv": self.kv_bytes,
            "compute": self.compute_bytes,
            "overhead": self.overhead_bytes,
            "embedding": self.embedding_bytes,
            "draft": self.draft_bytes + self.draft_kv_bytes,
            "cuda": self.cuda_bytes,
            "projector": self.projector_bytes,
            "total": self.total_bytes,
            "budget": self.budget_bytes,
        }
        out: dict[str, object] = {f"{k}_mib": round(v / MIB, 1) for k, v in sizes.items()}
        out.update({f"{k}_bytes": v for k, v in sizes.items()})
        out.update(
            n_ctx=self.n_ctx,
            n_slots=self.n_slots,
            seq_ctx=self.seq_ctx,
            kv_unified=self.kv_unified,
            kv_cells=self.kv_cells,
            kv_type=self.kv_type,
            n_batch=self.n_batch,
            flash_attn=self.flash_attn,
            auto_ctx=self.auto_ctx,
            fits=self.fits,
        )
        return out


def plan_memory(
    shape: ModelShape,
    *,
    budget_bytes: int,
    n_ctx: int | Literal["auto"] = "auto",
    n_slots: int | Literal["auto"] = "auto",
    kv_type: str = "f16",
    n_batch: int = 512,
    max_slot_ctx: int = 4096,
    min_slot_ctx: int = 512,
    flash_attn: bool = True,
    kv_unified: bool = True,
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
    embedding_ctx: int = 0,
    embedding_model: ModelShape | None = None,
    draft_model: ModelShape | None = None,
    cuda_bytes: int = 0,
    projector_bytes: int = 0,
) -> MemoryPlan:
    """The context and slot count to run with, and what they cost. Never raises for a plan that does not
    fit: the caller reads `fits` and refuses to start with `refusal()`.

    n_ctx is the KV cache's cells, n_slots how many requests decode at once: with kv_unified (the default)
    they are one pool any one request may use whole (up to n_ctx_train), else each slot owns n_ctx / n_slots
    (engine/llama_load.py). n_slots "auto": 4,
    fewer (down to 1) when the budget (or an explicit n_ctx) cannot give each of them min_slot_ctx cells at
    once. n_ctx "auto": the largest pool that fits, sized as n_slots requests of a multiple of 256 tokens
    each, at most min(n_ctx_train, max_slot_ctx) each; when even min_slot_ctx each does not fit, the plan
    reports that minimum with fits False. Explicit ints are kept as given.

    cuda_bytes: the CUDA runtime, when layers go to a GPU (DEFAULT_CUDA_CONTEXT_BYTES; the caller decides
    whether it applies); projector_bytes: the multimodal projector (projector_bytes()). Both come out of
    the budget before the context is sized.
    """
    if budget_bytes <= 0:
        raise ValueError("budget_bytes must be positive")
    kv_bytes_per_token(shape, kv_type)  # validates kv_type
    if n_batch < 1:
        raise ValueError("n_batch must be >= 1")
    for name, value in (("n_ctx", n_ctx), ("n_slots", n_slots)):
        if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive integer or 'auto', got {value!r}")

    embedding = embedding_bytes(shape, embedding_ctx, embedding_model)

    def make(slots: int, ctx: int, auto_ctx: bool) -> MemoryPlan:
        cells = kv_cells(ctx, 1 if kv_unified else slots)
        draft, draft_kv = (
            draft_bytes(draft_model, ctx, slots, n_batch, kv_unified) if draft_model is not None else (0, 0)
        )
        return MemoryPlan(
            weights_bytes=shape.file_bytes,
            kv_bytes=math.ceil(cells * kv_bytes_per_token(shape, kv_type)),
            compute_bytes=compute_bytes(shape, n_batch, slots, ctx, flash_attn=flash_attn, unified=kv_unified),
            overhead_bytes=overhead_bytes,
            budget_bytes=budget_bytes,
            n_ctx=ctx,
            n_slots=slots,
            kv_type=kv_type,
            kv_cells=cells,
            n_batch=n_batch,
            flash_attn=flash_attn,
            auto_ctx=auto_ctx,
            embedding_bytes=embedding,
            draft_bytes=draft,
            draft_kv_bytes=draft_kv,
            cuda_bytes=cuda_bytes,
            projector_bytes=projector_bytes,
            n_ctx_train=shape.n_ctx_train,
            kv_unified=kv_unified,
        )

    slot_cap = max(CELL_ALIGN, _round_down(min(shape.n_ctx_train, max_slot_ctx), CELL_ALIGN))
    slot_min = min(max(CELL_ALIGN, round_up(min_slot_ctx, CELL_ALIGN)), slot_cap)

    if n_ctx != "auto":
        if n_slots == "auto":
            # The largest slot count (up to 4) that still gives each slot min_slot_ctx of the given n_ctx.
            n_slots = next((s for s in range(AUTO_SLOTS, 0, -1) if n_ctx // s >= min_slot_ctx), 1)
        return make(n_slots, n_ctx, False)

    slot_choices = range(AUTO_SLOTS, 0, -1) if n_slots == "auto" else [n_slots]
    for slots in slot_choices:
        if not make(slots, slots * slot_min, True).fits:
            continue
        for per_slot in range(slot_cap, slot_min - 1, -CELL_ALIGN):
            plan = make(slots, slots * per_slot, True)
            if plan.fits:
                return plan
    slots = slot_choices[-1]
    return make(slots, slots * slot_min, True)  # does not fit: report the minimum it would need


def _round_down(n: int, step: int) -> int:
    return n // step * step


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def format_plan(plan: MemoryPlan, shape: ModelShape | None = None) -> str:
    """A human-readable table of the plan."""
    rows = [
        ("weights", plan.weights_bytes),
        (f"KV cache ({plan.kv_type}, {plan.kv_cells} cells)", plan.kv_bytes),
        (f"compute buffers (n_batch {plan.n_batch})", plan.compute_bytes),
        ("runtime reserve", plan.overhead_bytes),
        ("embeddings (context, dedicated model)", plan.embedding_bytes),
        ("draft model (weights, buffers, KV)", plan.draft_bytes + plan.draft_kv_bytes),
        ("projector (weights, compute buffer)", plan.projector_bytes),
        ("CUDA runtime (context, cuBLAS, pools)", plan.cuda_bytes),
        ("total", plan.total_bytes),
        ("budget", plan.budget_bytes),
    ]
    lines = []
    if shape is not None:
        lines.append(
            f"model: {shape.n_layer} layers, {shape.n_head} heads ({shape.n_head_kv} KV), n_embd {shape.n_embd}, "
            f"head dim {shape.head_dim_k}/{shape.head_dim_v}, vocab {shape.n_vocab}, n_ctx_train {shape.n_ctx_train}"
        )
    n_ctx = f"n_ctx {plan.n_ctx}{' auto' if plan.auto_ctx else ''}"
    layout = (
        f"a KV pool of {plan.kv_cells} cells ({n_ctx}) for {plan.n_slots} slot(s)"
        if plan.kv_unified
        else f"{plan.kv_cells} KV cells ({n_ctx}), each of {plan.n_slots} slot(s) owning its share"
    )
    lines.append(f"context: {layout}; one request up to {plan.seq_ctx} tokens")
    lines += [f"  {name:<38} {n / MIB:>10.1f} MiB" for name, n in rows]
    lines.append(f"fits: {'yes' if plan.fits else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m edgellm.engine.memory_plan", description="Plan the memory a GGUF model needs here."
    )
    parser.add_argument("model", help="GGUF model file")
    parser.add_argument("--budget", help="memory budget, e.g. 6GiB (default: 75%% of MemAvailable)")
    parser.add_argument("--kv", default="f16", choices=sorted(KV_BYTES_PER_ELEMENT), help="KV cache type")
    parser.add_argument("--n-ctx", default="auto", help="total context tokens, or auto")
    parser.add_argument("--n-slots", default="auto", help="parallel slots, or auto")
    parser.add_argument("--n-batch", type=int, default=512)
    parser.add_argument(
        "--kv-unified",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan one KV pool (the default; --no-kv-unified: a share per slot)",
    )
    parser.add_argument("--no-flash-attn", action="store_true", help="plan for attention without flash attention")
    parser.add_argument("--mmproj", help="a multimodal projector GGUF to plan for")
    parser.add_argument(
        "--cuda-context-mib",
        type=int,
        help="the CUDA runtime's share when layers go to a GPU (default: 300 where a CUDA device shows, else 0)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    try:
        budget = parse_size(args.budget) if args.budget else default_budget_bytes()
        shape = ModelShape.from_gguf(args.model)
        if args.cuda_context_mib is not None:
            cuda = max(0, args.cuda_context_mib) * MIB
        else:
            cuda = DEFAULT_CUDA_CONTEXT_BYTES if cuda_device_present() else 0
        plan = plan_memory(
            shape,
            budget_bytes=budget,
            n_ctx=args.n_ctx if args.n_ctx == "auto" else int(args.n_ctx),
            n_slots=args.n_slots if args.n_slots == "auto" else int(args.n_slots),
            kv_type=args.kv,
            n_batch=args.n_batch,
            flash_attn=not args.no_flash_attn,
            kv_unified=args.kv_unified,
            cuda_bytes=cuda,
            projector_bytes=projector_bytes(args.mmproj),
        )
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan, shape))
    if not plan.fits:
        print(plan.refusal(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

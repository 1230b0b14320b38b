"""Counters of the engine's step loop, reported with each PONG (the node's /status and /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    steps: int = 0
    decode_s: float = 0.0
    prefill_decode_s: float = 0.0  # of decode_s: steps that decoded prompt chunks
    guide_s: float = 0.0  # mask fill + apply + advance, all slots
    sample_s: float = 0.0
    prompt_tokens: int = 0  # prompt tokens decoded
    reused_tokens: int = 0  # prompt tokens skipped thanks to a cached prefix
    restored_tokens: int = 0  # of those, loaded from the prefix files on disk (engine/prefix_store.py)
    shared_prompt_tokens: int = 0  # prompt tokens taken from another running sequence's cells (shared)
    preemptions: int = 0  # running requests paused to free KV cells (each resumed later, nothing lost)
    refed_tokens: int = 0  # generated tokens fed again when a preempted request resumed
    evicted_cells: int = 0  # cells of idle sequences' cached prefixes freed for running work
    generated_tokens: int = 0
    drafted_tokens: int = 0  # speculative draft tokens verified
    accepted_tokens: int = 0  # of those, kept (each one a decode step saved)
    media_chunks: int = 0  # images / audio windows encoded and decoded into a sequence
    media_s: float = 0.0  # their encode + decode time
    media_encode_s: float = 0.0  # of media_s: the projector's encoder alone
    embedded_inputs: int = 0  # embedding inputs computed (engine/tasks.py; cancelled ones stop counting)
    finished: dict[str, int] = field(default_factory=dict)
    # A decode's estimated ms by tokens decoded (engine/decode_cost.py): what drafts are weighed against.
    decode_cost_ms: dict[str, float] = field(default_factory=dict)
    prefix_cache: dict[str, object] = field(default_factory=dict)  # PrefixStore.stats(); {} when off

    def as_dict(self) -> dict:
        per = max(1, self.steps)
        return {
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "restored_tokens": self.restored_tokens,
            "shared_prompt_tokens": self.shared_prompt_tokens,
            "preemptions": self.preemptions,
            "refed_tokens": self.refed_tokens,
            "evicted_cells": self.evicted_cells,
            "generated_tokens": self.generated_tokens,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "media_chunks": self.media_chunks,
            "embedded_inputs": self.embedded_inputs,
            "media_ms_per_chunk": 1000 * self.media_s / max(1, self.media_chunks),
            "media_encode_ms_per_chunk": 1000 * self.media_encode_s / max(1, self.media_chunks),
            "decode_ms_per_step": 1000 * self.decode_s / per,
            "guide_ms_per_step": 1000 * self.guide_s / per,
            "sample_ms_per_step": 1000 * self.sample_s / per,
            "finished": dict(self.finished),
            "decode_cost_ms": dict(self.decode_cost_ms),
            "prefix_cache": dict(self.prefix_cache),
        }

"""Guided decoding with llguidance: the only module that imports it.

Two levels, as in vLLM's structured-output backends: `grammar_for(spec)` turns a request's
`GuideSpec` into an llguidance grammar (validated, cached; usable without a model, so the API
process can reject bad specs with a 400), and `GuideBackend.compile(spec)` builds a per-request
`Guide` (one LLMatcher) against the model's tokenizer.
"""

from __future__ import annotations

import json
import warnings
from functools import lru_cache

import llguidance
import numpy as np
from llguidance import LLMatcher
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from edgellm.engine.types import GuideKind, GuideSpec
from edgellm.errors import GuideError

MAX_GUIDE_BYTES = 128 * 1024
# Compact JSON: a small model given free whitespace tends to pad output with newlines forever.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _spec_text(spec: GuideSpec) -> str:
    if spec.kind is GuideKind.JSON_OBJECT:
        return json.dumps({"type": "object"})
    if spec.kind is GuideKind.JSON_SCHEMA:
        if not isinstance(spec.spec, dict):
            raise GuideError("json_schema must be a JSON object (a dict)")
        return json.dumps(spec.spec, sort_keys=True)
    if spec.kind is GuideKind.CHOICE:
        if not isinstance(spec.spec, list) or not spec.spec or not all(isinstance(c, str) and c for c in spec.spec):
            raise GuideError("choice must be a non-empty list of non-empty strings")
        return json.dumps(spec.spec)
    if not isinstance(spec.spec, str) or not spec.spec.strip():
        raise GuideError(f"{spec.kind.value} must be a non-empty string")
    return spec.spec


def grammar_for(spec: GuideSpec) -> str:
    """The llguidance grammar for a spec; raises GuideError with llguidance's message if unusable."""
    text = _spec_text(spec)
    if len(text.encode("utf-8")) > MAX_GUIDE_BYTES:
        raise GuideError(f"{spec.kind.value} guide is {len(text.encode())} bytes; the limit is {MAX_GUIDE_BYTES}")
    return _compile_cached(spec.kind, text)


@lru_cache(maxsize=256)
def _compile_cached(kind: GuideKind, text: str) -> str:
    try:
        if kind in (GuideKind.JSON_OBJECT, GuideKind.JSON_SCHEMA):
            grammar = LLMatcher.grammar_from_json_schema(text, overrides=_JSON_OPTIONS)
        elif kind is GuideKind.REGEX:
            grammar = llguidance.grammar_from("regex", text)
        elif kind is GuideKind.CHOICE:
            grammar = llguidance.grammar_from("choice", text)
        else:
            grammar = llguidance.grammar_from("grammar", text)
    except Exception as exc:  # llguidance raises ValueError/RuntimeError with a readable message
        raise GuideError(f"invalid {kind.value} guide: {exc}") from exc
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GuideError(f"invalid {kind.value} guide: {messages[0] if messages else 'rejected'}")
    return grammar


class Guide:
    """One request's matcher: mask the next token, accept the sampled one."""

    def __init__(self, matcher: LLMatcher):
        self.matcher = matcher

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept(self, token: int) -> bool:
        return self.matcher.consume_token(token)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows no alternative to (e.g. the next JSON key): fed without sampling."""
        return self.matcher.compute_ff_tokens()

    def is_done(self) -> bool:
        return self.matcher.is_stopped()

    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GuideBackend:
    """Per engine: the llguidance tokenizer (built once, ~0.3 s) and the mask buffers."""

    def __init__(self, vocab, n_vocab: int, eog_tokens: list[int], max_rows: int):
        from llguidance.llamacpp import lltokenizer_from_vocab  # imports llama_cpp: engine side only

        self.n_vocab = n_vocab
        with warnings.catch_warnings():  # llguidance calls a llama.cpp function deprecated upstream
            warnings.simplefilter("ignore", DeprecationWarning)
            self.tokenizer = lltokenizer_from_vocab(vocab, eos_token=eog_tokens)
        self.bitmask = allocate_token_bitmask(max_rows, n_vocab)
        # Bit positions of one 32-bit word, to unpack masks with numpy (llguidance's own
        # apply_token_bitmask_inplace was ~20x slower here).
        self._bits = (np.uint32(1) << np.arange(32, dtype=np.uint32)).astype(np.uint32)

    def compile(self, spec: GuideSpec) -> Guide:
        matcher = LLMatcher(self.tokenizer, grammar_for(spec), log_level=0)
        if matcher.is_error():
            raise GuideError(f"invalid {spec.kind.value} guide: {matcher.get_error()}")
        return Guide(matcher)

    def allowed(self, row: int) -> np.ndarray:
        """Boolean mask of allowed tokens for bitmask row `row` (after Guide.fill_mask)."""
        words = self.bitmask[row].view(np.uint32)
        bits = (words[:, None] & self._bits[None, :]) != 0
        return bits.reshape(-1)[: self.n_vocab]

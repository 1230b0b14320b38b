"""One request's guide at generation time: its llguidance matcher against the model's own tokenizer.

`GuideBackend` (one an engine) builds the llguidance tokenizer from the model's vocabulary (once, off the
step loop) and the token mask buffers; `GuideBackend.compile(spec)` makes a request's `Guide`, which masks
each next token, accepts the sampled one and says which tokens are forced. The grammar it compiles is
engine/guide_llguidance.py's (checked at submit there, cached); this module is the per-token side, the
one that needs the model (vLLM's structured-output backends draw the same line).
"""

from __future__ import annotations

import logging
import threading
import warnings
from concurrent.futures import Executor, Future

import llguidance
import numpy as np
from llguidance import LLMatcher
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from edgellm.engine.guide_llguidance import after_thinking, checked_text, compile_cached, guide_notes, short_error
from edgellm.engine.types import GuideKind, GuideSpec, ThinkingSpec
from edgellm.errors import GuideError

log = logging.getLogger(__name__)


class Guide:
    """One request's matcher: mask the next token, accept the sampled one."""

    def __init__(
        self,
        matcher: LLMatcher,
        notes: list[str] | None = None,
        tokenizer: llguidance.LLTokenizer | None = None,
        checked_against: str | None = None,
    ):
        self.matcher = matcher
        self._tokenizer = tokenizer
        # What of its JSON schema this guide does not enforce (guide_notes): the answer is checked after,
        # against `checked_against` (the schema's text as compiled; engine/schema_check.py).
        self.notes = notes or []
        self.checked_against = checked_against

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        fill_next_token_bitmask(self.matcher, bitmask, row)
        if self.matcher.is_error():
            # llguidance leaves EOS allowed in an error state; sampled, it would end the request as a
            # success with whatever text there is (`""` for `{"$ref": "#"}`). An empty mask makes the
            # scheduler report the dead end instead.
            bitmask[row].fill(0)

    def accept(self, token: int) -> bool:
        return self.matcher.consume_token(token)

    def count_tokens(self, data: bytes) -> int:
        """Tokens the model's tokenizer splits `data` into (the closing plan counts keys with it)."""
        if self._tokenizer is None:
            return len(data) // 2 + 1
        return len(self._tokenizer.tokenize_bytes(data))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar would accept from here (nothing is consumed)."""
        return self.matcher.validate_tokens(tokens)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows no alternative to (e.g. the next JSON key): fed without sampling."""
        return self.matcher.compute_ff_tokens()

    def is_done(self) -> bool:
        return self.matcher.is_stopped()

    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    def error(self) -> str | None:
        """The matcher's error, first line only: the rest is a parser state dump, not for clients."""
        return short_error(self.matcher.get_error()) if self.matcher.is_error() else None


class GuideBackend:
    """Per engine: the llguidance tokenizer (built once, ~0.45 s on a 2-core CPU) and the mask buffers.

    The tokenizer is only needed by a guided request's compile, so it is not built on the way to ready:
    `build_tokenizer_in(pool)` starts it on a prepare thread once the engine has started, and a compile
    waits for it (or builds it, when nothing started it)."""

    def __init__(self, vocab, n_vocab: int, eog_tokens: list[int], max_rows: int):
        self.n_vocab = n_vocab
        self._vocab, self._eog_tokens = vocab, eog_tokens
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_job: Future | None = None
        self._tokenizer_lock = threading.Lock()
        self.bitmask = allocate_token_bitmask(max_rows, n_vocab)
        # Bit positions of one 32-bit word, to unpack masks with numpy (llguidance's own
        # apply_token_bitmask_inplace was ~20x slower here).
        self._bits = (np.uint32(1) << np.arange(32, dtype=np.uint32)).astype(np.uint32)

    def build_tokenizer_in(self, pool: Executor) -> None:
        """Start building the tokenizer as a job of `pool`, unless it is begun or built. The pool must be
        shut down (waiting) before the model is freed: the job reads its vocabulary."""
        with self._tokenizer_lock:
            if self._tokenizer is None and self._tokenizer_job is None:
                self._tokenizer_job = pool.submit(self._build_tokenizer)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is not None:
            return self._tokenizer
        with self._tokenizer_lock:  # the job takes no lock: waiting for it here is safe, and others wait too
            if self._tokenizer is None:
                job = self._tokenizer_job
                # A job still waiting for a thread (maybe behind this very caller's, in the same pool) is
                # taken back: built here instead, as when nothing started it.
                if job is not None and not job.cancel():
                    try:
                        self._tokenizer = job.result()
                    except Exception:  # a failed build is tried once more here, not re-raised to every request
                        log.exception("the guide tokenizer's build failed; building it again here")
                if self._tokenizer is None:
                    self._tokenizer = self._build_tokenizer()
        return self._tokenizer

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        from llguidance.llamacpp import lltokenizer_from_vocab  # imports llama_cpp: engine side only

        # llguidance calls a llama.cpp function deprecated upstream, once per token. catch_warnings swaps
        # the process-wide filters while it lasts (~0.45 s, on a prepare thread): another thread's
        # DeprecationWarning in that time is not shown either, which is all it can cost.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return lltokenizer_from_vocab(self._vocab, eos_token=self._eog_tokens)

    def compile(self, spec: GuideSpec, *, thinking: ThinkingSpec | None = None, opened: bool = False) -> Guide:
        """`thinking`: the guide applies after a reasoning block (`opened`: the prompt opened it)."""
        # grammar_for's walk ran at submit, in the API process; it is not repeated on the step loop's side.
        text = checked_text(spec)
        grammar, warnings = compile_cached(spec.kind, text)
        if thinking is not None and (opened or thinking.optional):
            grammar = after_thinking(grammar, thinking, opened)
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GuideError(f"invalid {spec.kind.value} guide: {short_error(matcher.get_error())}")
        notes = guide_notes(spec, warnings)
        checked = text if notes and spec.kind is GuideKind.JSON_SCHEMA else None
        return Guide(matcher, notes, self.tokenizer, checked)

    def allowed(self, row: int) -> np.ndarray:
        """Boolean mask of allowed tokens for bitmask row `row` (after Guide.fill_mask)."""
        words = self.bitmask[row].view(np.uint32)
        bits = (words[:, None] & self._bits[None, :]) != 0
        return bits.reshape(-1)[: self.n_vocab]

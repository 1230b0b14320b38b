"""Following a thinking model's reasoning block in one slot's output.

The block is open from the first byte when the prompt opened it (`opened`: the template's generation
prompt ends inside `<think>`), or when the output starts with the start marker (`spec.optional`). It
ends at the end marker. The slot asks `due()` after each sampled token: true once the budget is spent
or what is left of max_tokens is what the answer needs, and then the engine feeds `spec.message` and
the end marker as forced tokens, so the answer (and its guide) still gets its turn.
"""

from __future__ import annotations

from edgellm.engine.types import ThinkingSpec

_WHITESPACE = b" \t\r\n"


def prompt_opens(tail: bytes, spec: ThinkingSpec) -> bool:
    """Whether a prompt ending with `tail` leaves the reasoning block open (its last start marker has
    no end marker after it)."""
    start, end = spec.start.encode(), spec.end.encode()
    at = tail.rfind(start)
    return at >= 0 and tail.find(end, at) < 0


class ThinkState:
    def __init__(self, spec: ThinkingSpec, opened: bool):
        self.spec = spec
        self._start, self._end = spec.start.encode(), spec.end.encode()
        self.opened_by_prompt = opened
        self.inside = opened
        self.decided = opened  # whether the output has a block is known
        self.body_from = 0  # where, in the slot's bytes, the block's text starts
        self.answer_from: int | None = None  # where the answer starts, once known
        self.tokens = 0  # reasoning tokens, markers included
        self.message_sent = False  # the budget message was forced once (a cut close only repeats the marker)

    def feed(self, data: bytearray) -> None:
        """After a token was added to `data` (all the slot's bytes so far)."""
        if not self.decided:
            head = bytes(data).lstrip(_WHITESPACE)
            if self.spec.optional and head.startswith(self._start):
                self.decided, self.inside = True, True
                self.body_from = len(data) - len(head) + len(self._start)
            elif self.spec.optional and self._start.startswith(head):
                self.tokens += 1  # whitespace or part of the marker so far: counted if the block comes
                return
            else:
                self.decided, self.answer_from, self.tokens = True, 0, 0  # no block: all of it is answer
                return
        if not self.inside:
            return
        self.tokens += 1
        at = data.find(self._end, max(self.body_from, len(data) - 64 - len(self._end)))
        if at >= 0:
            self.inside = False
            self.answer_from = at + len(self._end)

    @property
    def answered(self) -> bool:
        """The answer has started (after the block, or at once when there is none)."""
        return self.answer_from is not None

    def due(self, tokens_left: int, answer_reserve: int) -> bool:
        """Whether the block must be closed now: its budget is spent, or max_tokens has only the
        answer's room left."""
        if not self.inside:
            return False
        budget = self.spec.budget
        return (budget is not None and self.tokens >= budget) or tokens_left <= answer_reserve

    def closing_text(self) -> tuple[str, str]:
        """(the budget message, the end marker and the newlines after it), tokenized apart: the marker
        may be one special token."""
        message = self.spec.message
        if message and not message.endswith("\n"):
            message += "\n"
        return message, self.spec.end + "\n\n"

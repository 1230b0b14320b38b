"""Property: a JSON-schema-guided answer closes validly whatever ends it, for any schema and any budget.

Random schemas (nested arrays of objects, required keys at depth, enums, patterns, formats, minItems,
minLength, anyOf, `$ref` recursion with a base case) x random budgets from 1 to 512 tokens, the budget
ending either at max_tokens or at the slot's context end (a long prompt). For every one: the output
never reaches a dead end, never exceeds its budget; when the guide accepts it, it parses and validates
(the `jsonschema` library judges); and whenever the budget holds the schema's shortest instance (as
engine/json_cursor.shortest_tokens counts it) plus the closing slack, the guide does accept it (but for
an email string, see the test).

The grammar (llguidance, compiled by the engine's own GuideBackend), the vocabulary, the closing steering
and the budget (TokenStep.advance on a real Slot) are the engine's. What is not real, and why: the
logits are random rows instead of the model's forward pass. A decode is ~10-50 ms a token here, and
thousands of schema x budget pairs would take hours; a random "model" is also the adversarial one
(it prefers nothing, so only the steering ends a string or an array). The real model's closing is tested
in test_json_closing.py.
"""

from __future__ import annotations

import json
import os
import string
from concurrent.futures import Future

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from edgellm.engine.json_cursor import SLACK_TOKENS, shortest_tokens
from edgellm.engine.prepared import PreparedRequest
from edgellm.engine.slot import Slot
from edgellm.engine.types import EngineRequest, FinishReason, GuideKind, GuideSpec, SamplingParams

pytestmark = pytest.mark.slow

# 1000 schema x budget pairs in CI (~25 s on 2 cores, a fixed seed); EDGELLM_CLOSING_EXAMPLES=20000 for a
# deeper search after a change to the closing (engine/json_cursor.py, token_step.py).
EXAMPLES = int(os.environ.get("EDGELLM_CLOSING_EXAMPLES", "1000"))
BANK_ROWS = 256  # random logits rows, drawn from per step (a fresh 49k-row draw costs more than the step)

_names = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=12)

_leaves = st.one_of(
    st.builds(lambda lo: {"type": "string", "minLength": lo}, st.integers(0, 12)),
    st.builds(
        lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
        st.integers(0, 6),
        st.integers(0, 20),
    ),
    st.just({"type": "string"}),
    st.sampled_from(
        [
            {"type": "string", "pattern": "^[a-z]{2,6}$"},
            {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
            {"type": "string", "format": "date"},
            {"type": "string", "format": "date-time"},
            {"type": "string", "format": "email"},
            {"type": "string", "format": "uuid"},
        ]
    ),
    st.builds(lambda lo: {"type": "integer", "minimum": lo}, st.integers(-5, 100000)),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(
        lambda vs: {"enum": vs},
        st.lists(st.one_of(_names, st.integers(-9, 999), st.booleans()), min_size=1, max_size=4, unique=True),
    ),
    st.builds(lambda vs: {"type": "string", "enum": vs}, st.lists(_names, min_size=1, max_size=5, unique=True)),
)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    @st.composite
    def build(draw) -> dict:
        props = draw(st.dictionaries(_names, children, min_size=1, max_size=5))
        names = sorted(props)
        required = draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names)))
        schema = {"type": "object", "properties": props, "required": required}
        if draw(st.booleans()):
            schema["additionalProperties"] = False
        return schema

    return build()


def _array(children: st.SearchStrategy) -> st.SearchStrategy:
    @st.composite
    def build(draw) -> dict:
        schema = {"type": "array", "items": draw(children)}
        low = draw(st.integers(0, 3))
        if low:
            schema["minItems"] = low
        if draw(st.booleans()):
            schema["maxItems"] = low + draw(st.integers(0, 4))
        return schema

    return build()


def _extend(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        _object(children),
        _array(children),
        st.builds(lambda a, b: {"anyOf": [a, b]}, children, children),
    )


_bodies = st.recursive(_leaves, _extend, max_leaves=10)


@st.composite
def schemas(draw) -> dict:
    """A root object (what response_format asks for); sometimes a recursive `$defs` node with a base
    case (its children array may be empty) reached from one of the root's properties."""
    root = draw(_object(_bodies))
    if draw(st.booleans()):
        node = draw(_object(_bodies))
        node["properties"]["children"] = {"type": "array", "items": {"$ref": "#/$defs/node"}}
        if draw(st.booleans()):
            node["required"] = sorted({*node["required"], "children"})
        root["$defs"] = {"node": node}
        root["properties"]["tree"] = {"$ref": "#/$defs/node"}
        if draw(st.booleans()):
            root["required"] = sorted({*root["required"], "tree"})
    return root


@pytest.fixture(scope="module")
def driver(engine):
    """Runs one guided answer through the engine's own token step with random logits."""
    scheduler = engine.scheduler
    step, guides, model = scheduler.token_step, scheduler.guides, scheduler.model
    bank = np.random.default_rng(0).standard_normal((BANK_ROWS, model.n_vocab)).astype(np.float32) * 4
    prompt_ready: Future = Future()
    prompt_ready.set_result(None)

    def drive(schema: dict, budget: int, at_context_end: bool, seed: int) -> tuple[FinishReason, bytes, bool, int, int]:
        """(why it ended, the text, whether the guide accepts it, tokens generated, the budget that must
        be enough: the shortest instance, keys counted by the model's tokenizer, plus the slack)"""
        spec = GuideSpec(GuideKind.JSON_SCHEMA, schema)
        guide = guides.compile(spec)
        max_tokens = 4096 if at_context_end else budget
        request = EngineRequest("prop", [], SamplingParams(temperature=0.0, max_tokens=max_tokens), guide=spec)
        slot = Slot(0)
        slot.start(PreparedRequest(request, prompt_ready, prompt=[0]), guide)
        if at_context_end:  # a prompt that leaves `budget` cells of the slot (the last one stays free)
            slot.n_past = model.seq_ctx - 1 - budget
        rng = np.random.default_rng(seed)
        while True:
            row = bank[rng.integers(BANK_ROWS)].copy()
            finish, _ = step.advance(slot, [row], 0)
            slot.n_past += len(slot.pending) if finish is None else 0  # as the decode would
            if finish is not None:
                enough = shortest_tokens(schema, guide.count_tokens) + SLACK_TOKENS
                return finish.reason, bytes(slot.data), guide.is_accepting(), len(slot.generated), enough

    return drive


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(schema=schemas(), budget=st.integers(1, 512), at_context_end=st.booleans(), seed=st.integers(0, 2**16))
def test_a_guided_answer_closes_validly_within_any_budget(driver, schema, budget, at_context_end, seed):
    reason, data, accepting, generated, enough = driver(schema, budget, at_context_end, seed)
    note(f"schema {json.dumps(schema)}\nbudget {budget} at_context_end {at_context_end} seed {seed}")
    note(f"{reason} accepting {accepting} after {generated} tokens: {data!r}")
    event(f"budget {'under 64' if budget < 64 else 'under 256' if budget < 256 else '256 to 512'}")
    event("valid" if accepting else "cut (budget below the shortest ending)" if budget < enough else "cut")
    assert reason in (FinishReason.STOP, FinishReason.LENGTH), (reason, data[-80:])  # never a dead end
    # At the context's end the last token sampled is never decoded, and the closing plans for one cell
    # fewer than the slot holds (TokenStep._budget_left): up to two tokens past `budget`.
    assert generated <= budget + (2 if at_context_end else 0)
    if accepting:
        jsonschema.Draft202012Validator(schema).validate(json.loads(data))
    # An email's local part ends only where the model writes `@`, which the steering (a preference for
    # closers, not a search) cannot know to pick: a model that never writes it runs out of budget there.
    # That output is still reported as cut (not accepting: guided_incomplete), never as valid.
    steerable = '"email"' not in json.dumps(schema)
    assert accepting or not steerable or budget < enough, (budget, enough, data[-120:])


def test_the_deadline_bounds_the_closing_budget(engine):
    """The closing plans for whichever ends the answer first: with a deadline, the tokens this slot's own
    pace so far fits before it (with a margin), when that is fewer than max_tokens leaves."""
    import time

    from edgellm.engine.token_step import DEADLINE_MARGIN

    step = engine.scheduler.token_step
    request = EngineRequest("deadline", [], SamplingParams(max_tokens=200))
    done: Future = Future()
    done.set_result(None)
    slot = Slot(0)
    slot.start(PreparedRequest(request, done, prompt=[0]), None)
    slot.generated = [0] * 11
    slot.first_token_at = time.monotonic() - 1.0  # 10 tokens a second so far
    assert step._budget_left(slot) == 200 - 11  # no deadline: max_tokens decides
    request.deadline = time.time() + 2.0
    assert 0 < step._budget_left(slot) <= int(2.0 * 10 * DEADLINE_MARGIN)
    request.deadline = time.time() - 1.0
    assert step._budget_left(slot) <= 0  # past it: close at once


def test_a_model_looping_on_digits_gets_its_number_ended(engine):
    """A "model" that only ever wants the digit 9 (a small model in a loop): the grammar allows an integer
    of any length; past MAX_NUMBER_CHARS the steering ends the number where the grammar lets it end."""
    from edgellm.engine.json_cursor import MAX_NUMBER_CHARS

    scheduler = engine.scheduler
    step, guides, model = scheduler.token_step, scheduler.guides, scheduler.model
    (nine,) = model.tokenize("9", special=False)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    spec = GuideSpec(GuideKind.JSON_SCHEMA, schema)
    guide = guides.compile(spec)
    request = EngineRequest("nines", [], SamplingParams(temperature=0.0, max_tokens=300), guide=spec)
    done: Future = Future()
    done.set_result(None)
    slot = Slot(0)
    slot.start(PreparedRequest(request, done, prompt=[0]), guide)
    loop = np.zeros(model.n_vocab, dtype=np.float32)
    loop[nine] = 20.0
    finish = None
    while finish is None:
        finish, _ = step.advance(slot, [loop.copy()], 0)
    number = json.loads(bytes(slot.data))["n"]
    assert guide.is_accepting() and MAX_NUMBER_CHARS <= len(str(number)) <= MAX_NUMBER_CHARS + 2, slot.data

"""Guide checks under a budget (api/guide_pool.py): the hostile shapes issue 41 measured, each a clear 400
within the request's CPU and memory budget, in a child process, with the API process's memory unmoved."""

from __future__ import annotations

import asyncio
import resource
import threading

import pytest

from edgellm.api.dialects.openai_chat import parse_openai_request
from edgellm.api.guide_pool import Check, GuideBudget, GuidePool, request_checks, shared_pool
from edgellm.engine.types import GuideKind, GuideSpec
from edgellm.errors import GuideError, InvalidRequest


def _schema(schema: dict) -> GuideSpec:
    return GuideSpec(GuideKind.JSON_SCHEMA, schema)


# anyOf of counted strings: llguidance's lexer builds ~9 states a byte (issue 41: N=80 took 1.6 GB, 15 s).
COUNTED_ANY_OF = {"anyOf": [{"type": "string", "minLength": 9000, "maxLength": 9000 + i} for i in range(80)]}
# 128 tools, each a required string with a large minLength (issue 41: froze every route for 39.6 s).
LONG_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "minLength": 5000}},
                "required": ["text"],
            },
        },
    }
    for i in range(128)
]


def _rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.fixture
def pool():
    p = GuidePool(GuideBudget(cpu_s=2.0, memory_bytes=512 * 1024 * 1024, workers=2))
    yield p
    p.close()


def test_hostile_shapes_are_400s_within_the_budget_and_the_api_memory_does_not_move(pool):
    before = _rss_peak_mb()
    with pytest.raises(GuideError) as info:
        pool.check_now([Check("the json_schema guide", _schema(COUNTED_ANY_OF))])
    message = info.value.message
    assert info.value.http_status == 400
    assert "of CPU" in message or "MB" in message, message
    assert "80 anyOf/oneOf alternatives" in message, message  # what costs, named
    assert pool.counts["over_cpu"] + pool.counts["over_memory"] == 1
    # The compile ran in the child: this process's peak resident memory is where it was (+200 MB at most).
    assert _rss_peak_mb() - before < 200


def test_patternproperties_past_the_limit_are_refused_up_front(pool):
    schema = {"type": "object", "patternProperties": {f"^p{i}_[a-z]+$": {"type": "string"} for i in range(320)}}
    with pytest.raises(GuideError) as info:
        pool.check_now([Check("the json_schema guide", _schema(schema))])
    assert "320 patterns; the limit is 64" in info.value.message
    assert pool.counts["over_cpu"] == 0  # known up front: no compile was started


def test_many_costly_tools_are_one_job_under_one_budget(pool):
    """Answered (here: accepted, each tool has a 5 KB shortest instance) by one job in a child, not 128
    compiles on the caller's thread; the budget bounds it whichever way it goes."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": LONG_TOOLS}
    request, _ = parse_openai_request(body, "m")
    try:
        pool.check_now(request_checks(request))
    except InvalidRequest as exc:
        assert exc.http_status == 400 and "of CPU" in exc.message, exc.message
    assert pool.counts["jobs"] == 1


def test_a_repeated_guide_is_answered_from_the_cache_refusals_included(pool):
    bad = [Check("the json_schema guide", _schema(COUNTED_ANY_OF))]
    for _ in range(2):
        with pytest.raises(GuideError):
            pool.check_now(bad)
    good = [Check("the json_schema guide", _schema({"type": "object", "properties": {"a": {"type": "integer"}}}))]
    pool.check_now(good)
    pool.check_now(good)
    assert pool.counts["jobs"] == 2 and pool.counts["cached"] == 2


def test_a_tool_schema_refusal_names_the_tool_and_a_strict_one_lists_every_gap(pool):
    tools = [
        {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}},
        },
    ]
    request, _ = parse_openai_request(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools}, "m"
    )
    with pytest.raises(InvalidRequest) as info:
        pool.check_now(request_checks(request))
    assert info.value.param == "tools" and "tools[1].function.parameters is not a usable schema" in info.value.message

    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "kind": {"type": "string", "not": {"const": "x"}},
        },
        "dependentRequired": {"tags": ["kind"]},
    }
    strict = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": strict}
    request, _ = parse_openai_request(body, "m")
    with pytest.raises(GuideError) as info:
        pool.check_now(request_checks(request))
    message = info.value.message
    for gap in ("uniqueItems at /properties/tags", "not at /properties/kind", "dependentRequired at /"):
        assert gap in message, message
    # Not strict: the same schema is accepted (its gaps are checked after generation).
    lenient = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    request, _ = parse_openai_request({**body, "response_format": lenient}, "m")
    pool.check_now(request_checks(request))


def test_one_of_and_unknown_formats_are_served(pool):
    one_of = {
        "oneOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]},
        ]
    }
    pool.check_now([Check("the json_schema guide", _schema(one_of))])
    pool.check_now([Check("the json_schema guide", _schema({"type": "string", "format": "made-up-format"}))])


def test_a_cancelled_check_kills_its_child_and_is_not_cached(pool):
    cancelled = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            pool.check_now([Check("the json_schema guide", _schema(COUNTED_ANY_OF))], cancelled)
        except GuideError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    cancelled.set()
    thread.join(60)
    assert not thread.is_alive()
    assert pool.counts["cancelled"] == 1 and "cancelled" in errors[0].message
    assert pool.counts["cached"] == 0


def test_the_async_check_stops_when_the_client_is_gone(pool):
    async def gone() -> bool:
        return True

    async def main() -> None:
        with pytest.raises(GuideError, match="disconnected"):
            await pool.check([Check("the json_schema guide", _schema(COUNTED_ANY_OF))], gone)

    asyncio.run(main())


def test_the_shared_pool_is_one_per_process():
    assert shared_pool() is shared_pool()

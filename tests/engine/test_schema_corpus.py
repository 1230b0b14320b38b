"""Real-world JSON schemas (tests/fixtures/schemas: SchemaStore, Kubernetes, Berkeley function-calling
tool parameters, Snowplow Iglu; licenses in SOURCES.md), each checked as a request's guide is: compiled and
proved completable, or refused with a clear message. No model: what llguidance and the completion check
say. The acceptance floor is this corpus's measured count (2026-12-06: 337 of 360; the rest refer to
other documents, use look-around patterns llguidance cannot build, or overlap patternProperties)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from edgellm.engine.guide_llguidance import grammar_for, guide_notes
from edgellm.engine.schema_size import shortest_instance_bytes
from edgellm.engine.types import GuideKind, GuideSpec
from edgellm.errors import GuideError

CORPUS = sorted((Path(__file__).parents[1] / "fixtures" / "schemas").glob("*/*.json"))
ACCEPTED_FLOOR = 330


def test_the_corpus_is_there():
    assert len(CORPUS) >= 300, "tests/fixtures/schemas holds the real-world corpus (tools/collect_schemas.py)"


def test_real_world_schemas_compile_or_are_refused_clearly():
    accepted, refused, times = 0, {}, []
    for path in CORPUS:
        spec = GuideSpec(GuideKind.JSON_SCHEMA, json.loads(path.read_text()))
        started = time.perf_counter()
        try:
            grammar_for(spec)
            guide_notes(spec)
            accepted += 1
        except GuideError as exc:
            refused[path.name] = exc.message
            assert "\n" not in exc.message and len(exc.message) < 1000, exc.message
        times.append(time.perf_counter() - started)
    times.sort()
    print(
        f"\n{accepted} of {len(CORPUS)} accepted; compile + check p50 {times[len(times) // 2]:.3f} s, "
        f"p95 {times[int(0.95 * len(times))]:.3f} s, max {times[-1]:.3f} s"
    )
    for name, message in sorted(refused.items()):
        print(f"  refused {name}: {message[:160]}")
    assert accepted >= ACCEPTED_FLOOR, refused
    # Nothing in the corpus is refused as "no short output" any more: every such refusal must be proved
    # by the shortest instance (a recursion without a base case, or minimum counts past the budget).
    for name, message in refused.items():
        assert "no output shorter" not in message, (name, message)


@pytest.mark.parametrize("path", [p for p in CORPUS if "winutil" in p.name or "kubernetes" in str(p)][:8], ids=str)
def test_finite_schemas_have_a_finite_shortest_instance(path):
    size, stuck = shortest_instance_bytes(json.loads(path.read_text()))
    assert size < float("inf") and not stuck

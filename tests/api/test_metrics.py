"""Prometheus instruments of the service (issue 8, defect 21): real Counter/Histogram types, no model.

On the previous main, latency percentiles were computed by hand from a list and the exposition had
no histogram at all (no `_bucket`/`_count`/`_sum` series), so these tests fail there.
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from edgellm.api.auth import Authenticator
from edgellm.api.metrics import LATENCY_BUCKETS_S, ServiceMetrics, histogram_quantile, live_state
from edgellm.api.registry import Registry
from edgellm.api.service import Service
from edgellm.api.submission import ServiceConfig
from edgellm.engine.info import EngineStats
from edgellm.engine.interface import EngineHealth, EngineState
from edgellm.engine.types import EngineOutput, FinishReason
from edgellm.runtime.server.prometheus import prometheus_text
from tests.api.test_service import engine_info, engine_stats


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_histogram_series_count_every_observation():
    m = ServiceMetrics()
    latencies_s = [0.04, 0.3, 0.3, 0.9, 1.2, 2.5, 4.0, 11.0, 700.0]  # the last one is past every finite bound
    for i, lat in enumerate(latencies_s):
        m.count("submitted")
        ttft_ms = 20.0 + i
        m.finished(
            "completed",
            prompt_tokens=12,
            completion_tokens=7,
            timings={"ttft_ms": ttft_ms, "decode_ms": 1000 * lat - ttft_ms},
        )
    m.finished("timeout", prompt_tokens=3, timings={"ttft_ms": 5.0, "decode_ms": 1.0})  # not a latency sample
    m.count("rejected")
    s = samples(m.prometheus_text())

    name = "edgellm_request_latency_seconds"
    assert s[(f"{name}_count", ())] == len(latencies_s)
    assert s[(f"{name}_sum", ())] == pytest.approx(sum(latencies_s))
    for bound in LATENCY_BUCKETS_S:
        le = "+Inf" if math.isinf(bound) else repr(float(bound))
        assert s[(f"{name}_bucket", (("le", le),))] == sum(1 for x in latencies_s if x <= bound), le
    ttft = "edgellm_time_to_first_token_seconds"
    assert s[(f"{ttft}_count", ())] == len(latencies_s)
    assert s[(f"{ttft}_sum", ())] == pytest.approx(sum(20.0 + i for i in range(len(latencies_s))) / 1000)
    assert s[(f"{ttft}_bucket", (("le", "0.025"),))] == 6  # 20..25 ms

    assert s[("edgellm_requests_total", (("outcome", "completed"),))] == len(latencies_s)
    assert s[("edgellm_requests_total", (("outcome", "timeout"),))] == 1
    assert s[("edgellm_requests_total", (("outcome", "rejected"),))] == 1
    assert s[("edgellm_requests_total", (("outcome", "failed"),))] == 0  # present before the first one
    assert s[("edgellm_prompt_tokens_total", ())] == 12 * len(latencies_s) + 3
    assert s[("edgellm_generated_tokens_total", ())] == 7 * len(latencies_s)

    view = m.as_dict()
    assert view["requests"] == {"submitted": 9, "completed": 9, "failed": 0, "timeout": 1, "rejected": 1}
    assert view["latency_ms"]["count"] == len(latencies_s)
    assert view["latency_ms"]["mean"] == pytest.approx(1000 * sum(latencies_s) / len(latencies_s), abs=0.1)
    # p50: rank 4.5 of 9 lies in (1.0, 1.5] (4 at or below 1.0, 5 at or below 1.5): interpolated 1.25 s.
    assert view["latency_ms"]["p50"] == 1250.0
    # p95: rank 8.55 lies past the last finite bound, whose value (600 s) is the answer, as in PromQL.
    assert view["latency_ms"]["p95"] == 600_000.0
    assert view["tokens"] == {"prompt": 12 * 9 + 3, "generated": 7 * 9}


def test_unknown_outcome_counts_as_failed():
    m = ServiceMetrics()
    m.finished("error")
    assert m.counts()["failed"] == 1


def test_histogram_quantile_matches_promql():
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.5, [(1.0, 0), (math.inf, 0)]) is None
    buckets = [(0.1, 10), (0.5, 30), (1.0, 40), (math.inf, 40)]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)  # rank 10: top of the first bucket
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 10 / 20)
    assert histogram_quantile(1.0, buckets) == pytest.approx(1.0)
    assert histogram_quantile(0.99, [(1.0, 1), (math.inf, 10)]) == 1.0


class FakeEngine:
    """The parts of an EngineClient the gauges read (the rest is tests/api/test_service.RecordingEngine's)."""

    def __init__(self) -> None:
        self.info = engine_info(n_slots=8)
        self.stats: EngineStats | None = engine_stats(8, slots_busy=3, waiting=2, steps=40, decode_s=0.2)
        self.restarts = 0

    def health(self) -> EngineHealth:
        return EngineHealth(EngineState.READY, restarts=self.restarts)

    def in_flight(self) -> int:
        return 5


def test_gauges_are_read_at_scrape_time():
    engine = FakeEngine()
    m = ServiceMetrics(live=lambda: live_state(engine, engine.in_flight(), 64))
    s = samples(m.prometheus_text())
    assert s[("edgellm_in_flight", ())] == 5 and s[("edgellm_in_flight_limit", ())] == 64
    assert (s[("edgellm_slots_total", ())], s[("edgellm_slots_busy", ())], s[("edgellm_waiting", ())]) == (8, 3, 2)
    assert s[("edgellm_engine_restarts_total", ())] == 0 and s[("edgellm_engine_steps_total", ())] == 40
    engine.restarts, engine.stats = 2, engine_stats(8, slots_busy=7, waiting=2, steps=40, decode_s=0.2)
    s = samples(m.prometheus_text())
    assert s[("edgellm_engine_restarts_total", ())] == 2 and s[("edgellm_slots_busy", ())] == 7
    engine.stats = None  # before the worker's first pong: slot count from the engine info, no load gauges
    s = samples(m.prometheus_text())
    assert s[("edgellm_slots_total", ())] == 8 and ("edgellm_slots_busy", ()) not in s
    types = {f.name: f.type for f in text_string_to_metric_families(m.prometheus_text().decode())}
    assert types["edgellm_request_latency_seconds"] == "histogram"
    assert types["edgellm_requests"] == "counter" and types["edgellm_engine_restarts"] == "counter"
    assert types["edgellm_in_flight"] == "gauge"


def make_service(tmp_path, name: str) -> Service:
    return Service(ServiceConfig(model_name="m"), Registry(tmp_path / f"{name}.db", 60), Authenticator([]))


def test_services_keep_separate_registries(tmp_path):
    """Several services in one process (as in tests) must neither clash nor share counts."""
    a, b = make_service(tmp_path, "a"), make_service(tmp_path, "b")
    a.on_engine_outputs(
        [
            EngineOutput(
                "r1",
                True,
                data=b"hi",
                finish_reason=FinishReason.STOP,
                prompt_tokens=9,
                completion_tokens=2,
                timings={"ttft_ms": 30.0, "decode_ms": 70.0},
            )
        ]
    )
    sa, sb = samples(prometheus_text(a)), samples(prometheus_text(b))
    assert sa[("edgellm_request_latency_seconds_count", ())] == 1
    assert sa[("edgellm_request_latency_seconds_sum", ())] == pytest.approx(0.1)
    assert sa[("edgellm_requests_total", (("outcome", "completed"),))] == 1
    assert sa[("edgellm_generated_tokens_total", ())] == 2
    assert sb[("edgellm_request_latency_seconds_count", ())] == 0
    assert a.metrics()["latency_ms"]["count"] == 1 and b.metrics()["latency_ms"]["count"] == 0
    assert a.metrics()["requests"]["completed"] == 1
    assert REGISTRY.get_sample_value("edgellm_request_latency_seconds_count") is None  # never the global one

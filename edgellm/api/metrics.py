"""Prometheus instruments of one Service: request outcomes, latency and TTFT histograms, token counts,
HTTP responses by route and status code.

Each Service owns a `CollectorRegistry` of its own rather than prometheus_client's global default: a
process may hold several services (tests do), and the global registry would refuse the second
service's instruments (duplicate names) or mix their counts. Nothing here knows FastAPI or the
engine's implementations (only engine/interface.py's EngineClient): the service reports what happened,
and a `live` callback supplies what is true right now (in flight, slots, queue), read at scrape time.

The JSON /metrics view is derived from the same instruments. Its latency p50/p95 are estimated from
the histogram buckets exactly as PromQL's `histogram_quantile` does (linear within the bucket that
holds the rank), over every request since the node started; their precision is the bucket width.
Count and mean are exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from edgellm.engine.interface import EngineClient

OUTCOMES = ("submitted", "completed", "failed", "timeout", "rejected")

# Whole requests: a short answer on a Jetson takes ~0.1 s, a 4096-token one on a CPU minutes.
LATENCY_BUCKETS_S = (
    0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0,
    120.0, 180.0, 300.0, 600.0, math.inf,
)  # fmt: skip
# Time to first token: queueing for a slot plus prefill; seconds only when the queue is deep.
TTFT_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0,
    60.0, math.inf,
)  # fmt: skip


def live_state(engine: EngineClient | None, in_flight: int, max_queued: int) -> dict[str, Any]:
    """The point-in-time values behind the gauges (and the JSON view), from the engine client."""
    if engine is None:
        return {"in_flight": in_flight, "max_queued": max_queued, "engine": {}, "engine_restarts": 0}
    # The stats arrive with the worker's answer to each ping (every ~2 s); the slots are known from the start.
    stats = engine.stats.as_dict() if engine.stats is not None else {}
    if "slots_total" not in stats and engine.info is not None:
        stats["slots_total"] = engine.info.n_slots
    return {
        "in_flight": in_flight,
        "max_queued": max_queued,
        "engine": stats,
        "engine_restarts": engine.health().restarts,
    }


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """PromQL's histogram_quantile over (upper bound, cumulative count) pairs, +Inf last."""
    pairs = sorted(buckets)
    if not pairs or pairs[-1][1] == 0:
        return None
    rank = q * pairs[-1][1]
    lower, below = 0.0, 0.0
    for upper, cumulative in pairs:
        if cumulative >= rank:
            if math.isinf(upper):  # the rank lies past the last finite bound: that bound is the answer
                return lower
            if cumulative == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (cumulative - below)
        lower, below = upper, cumulative
    return lower


class _LiveCollector:
    """Gauges (and the engine's own counters) read at scrape time from the `live` callback."""

    def __init__(self, live: Callable[[], Mapping[str, Any]]):
        self.live = live

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration: the service may not be wired to an engine yet

    def collect(self) -> Iterable[Metric]:
        state = self.live()
        yield GaugeMetricFamily("edgellm_in_flight", "Requests accepted and not finished", value=state["in_flight"])
        yield GaugeMetricFamily(
            "edgellm_in_flight_limit", "In-flight requests before new ones get 429", value=state["max_queued"]
        )
        # The supervisor counts restarts over the life of the API process, so this is monotonic.
        yield CounterMetricFamily(
            "edgellm_engine_restarts", "Engine worker restarts", value=state.get("engine_restarts", 0)
        )
        engine = state.get("engine") or {}
        for key, help_text in (
            ("slots_total", "Generation slots"),
            ("slots_busy", "Slots holding a request"),
            ("waiting", "Requests waiting for a slot"),
            ("kv_cells", "Cells in the engine's KV pool"),
            ("kv_used", "KV pool cells in use"),
            ("kv_shared", "KV pool cells more than one sequence shares (a common prefix stored once)"),
            ("paused", "Requests paused by a preemption, waiting for KV cells to resume"),
            ("embedding_jobs", "Embedding requests queued or running"),
        ):
            if key in engine:
                yield GaugeMetricFamily(f"edgellm_{key}", help_text, value=engine[key])
        # The worker's step statistics start from zero when it restarts (rate() treats that as a reset).
        for key, help_text in (
            ("steps", "Engine decode steps"),
            ("reused_tokens", "Prompt tokens skipped thanks to a cached prefix"),
            ("shared_prompt_tokens", "Prompt tokens shared from another running sequence's KV cells"),
            ("preemptions", "Running requests paused to free KV cells (resumed later, nothing lost)"),
            ("embedded_inputs", "Embedding inputs computed"),
        ):
            if key in engine:
                yield CounterMetricFamily(f"edgellm_engine_{key}", help_text, value=engine[key])
        for key in ("decode_ms_per_step", "guide_ms_per_step", "sample_ms_per_step"):
            if key in engine:
                yield GaugeMetricFamily(f"edgellm_engine_{key}", f"Mean {key.replace('_', ' ')}", value=engine[key])
        yield from _board_gauges(state.get("board") or [])
        yield from _board_gauges(state.get("memory_pressure") or [])  # the same (name, help, labels, value) form
        if "energy_joules" in state:  # only on a board with a power monitor (runtime/board/energy.py)
            yield CounterMetricFamily(
                "edgellm_energy_joules",
                "Energy drawn by the board (its input rail, or the sum of its rails) since the node started",
                value=state["energy_joules"],
            )


def _board_gauges(samples: list[tuple[str, str, dict[str, str], float]]) -> Iterable[Metric]:
    """Board telemetry samples (runtime/board/telemetry.py) as gauge families, one per metric name."""
    families: dict[str, GaugeMetricFamily] = {}
    for name, help_text, labels, value in samples:
        family = families.get(name)
        if family is None:
            family = families[name] = GaugeMetricFamily(name, help_text, labels=sorted(labels))
        family.add_metric([labels[k] for k in sorted(labels)], value)
    return families.values()


class _EnergyCollector:
    """The requests' energy: a counter of their summed shares and the last completed one's joules per token."""

    def __init__(self, metrics: ServiceMetrics):
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        if self.metrics.last_joules_per_token is None and not self.metrics.request_energy_j:
            return
        yield CounterMetricFamily(
            "edgellm_request_energy_joules",
            "Energy attributed to finished requests (each step's energy shared by the tokens it fed)",
            value=self.metrics.request_energy_j,
        )
        if self.metrics.last_joules_per_token is not None:
            yield GaugeMetricFamily(
                "edgellm_energy_joules_per_token",
                "Joules per generated token of the last completed request (its energy_j / completion tokens)",
                value=self.metrics.last_joules_per_token,
            )


class ServiceMetrics:
    """The instruments the service updates, in a registry of its own."""

    def __init__(self, live: Callable[[], Mapping[str, Any]] | None = None):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "edgellm_requests", "Requests by outcome (submitted = accepted)", ["outcome"], registry=self.registry
        )
        for outcome in OUTCOMES:  # every outcome is a series from the start, so rate() sees the first one
            self.requests.labels(outcome)
        self.latency = Histogram(
            "edgellm_request_latency_seconds",
            "Completed requests: from entering the engine queue to the last token",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "edgellm_time_to_first_token_seconds",
            "Completed requests: from entering the engine queue to the first generated token",
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "edgellm_prompt_tokens",
            "Prompt tokens of finished requests (cached prefix included)",
            registry=self.registry,
        )
        self.generated_tokens = Counter(
            "edgellm_generated_tokens", "Tokens generated for finished requests", registry=self.registry
        )
        # Every HTTP response by route template ("other" for a path no route serves) and status code:
        # runtime/http_guard.CountResponses reports each one.
        self.http = Counter(
            "edgellm_http_requests",
            "HTTP responses by route template and status code",
            ["route", "code"],
            registry=self.registry,
        )
        self.live = live
        if live is not None:
            self.registry.register(_LiveCollector(live))
        # Per-request energy (timings energy_j): plain floats, exposed only once a request carried one,
        # so a node without a power monitor has no energy series at all (never a 0).
        self.request_energy_j = 0.0
        self.last_joules_per_token: float | None = None
        self.registry.register(_EnergyCollector(self))

    # -- what happened (any thread) ----------------------------------------------------------------
    def count(self, outcome: str) -> None:
        self.requests.labels(outcome if outcome in OUTCOMES else "failed").inc()

    def count_http(self, route: str, code: int) -> None:
        """One HTTP response sent; `route` must come from a bounded set (the app's path templates)."""
        self.http.labels(route, str(code)).inc()

    def finished(
        self,
        outcome: str,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        timings: Mapping[str, float] | None = None,
    ) -> None:
        """One request ended; latency and TTFT are observed for completed requests that carry timings."""
        timings = timings or {}
        self.count(outcome)
        self.prompt_tokens.inc(max(0, prompt_tokens))
        self.generated_tokens.inc(max(0, completion_tokens))
        if outcome == "completed" and "ttft_ms" in timings:
            ttft_s = timings["ttft_ms"] / 1000
            self.ttft.observe(ttft_s)
            self.latency.observe(ttft_s + timings.get("decode_ms", 0.0) / 1000)
        if "energy_j" in timings:  # every finished request's share counts, a failed one's too
            self.request_energy_j += max(0.0, timings["energy_j"])
            if outcome == "completed" and "joules_per_token" in timings:
                self.last_joules_per_token = timings["joules_per_token"]

    # -- views -----------------------------------------------------------------------------------
    @staticmethod
    def totals(counter: Counter) -> dict[tuple[str, ...], int]:
        """A counter's `_total` values by label values, read through the public collect()."""
        return {
            tuple(sample.labels.values()): int(sample.value)
            for metric in counter.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        }

    def counts(self) -> dict[str, int]:
        return {**dict.fromkeys(OUTCOMES, 0), **{key[0]: n for key, n in self.totals(self.requests).items()}}

    def http_counts(self) -> dict[str, dict[str, int]]:
        """HTTP responses as {route: {code: n}}, routes and codes sorted."""
        by_route: dict[str, dict[str, int]] = {}
        for (route, code), n in sorted(self.totals(self.http).items()):
            by_route.setdefault(route, {})[code] = n
        return by_route

    @staticmethod
    def summary_ms(histogram: Histogram) -> dict[str, Any]:
        """p50/p95 (bucket estimates, see the module doc), exact count and mean, in milliseconds."""
        buckets: list[tuple[float, float]] = []
        count = total = 0.0
        for metric in histogram.collect():
            for sample in metric.samples:
                if sample.name.endswith("_bucket"):
                    buckets.append((float(sample.labels["le"]), sample.value))
                elif sample.name.endswith("_count"):
                    count = sample.value
                elif sample.name.endswith("_sum"):
                    total = sample.value

        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else round(1000 * seconds, 1)

        return {
            "p50": ms(histogram_quantile(0.5, buckets)),
            "p95": ms(histogram_quantile(0.95, buckets)),
            "mean": ms(total / count) if count else None,
            "count": int(count),
        }

    def as_dict(self) -> dict[str, Any]:
        """The JSON /metrics body: counts, latency summaries, and the live values."""
        live = dict(self.live()) if self.live is not None else {}
        return {
            "requests": self.counts(),
            "in_flight": live.get("in_flight", 0),
            "latency_ms": self.summary_ms(self.latency),
            "ttft_ms": self.summary_ms(self.ttft),
            "tokens": {
                "prompt": self.totals(self.prompt_tokens).get((), 0),
                "generated": self.totals(self.generated_tokens).get((), 0),
            },
            "engine": live.get("engine", {}),
            "engine_restarts": live.get("engine_restarts", 0),
            "http_requests": self.http_counts(),
            **({"energy": energy} if (energy := self.energy_view(live)) else {}),
        }

    def energy_view(self, live: Mapping[str, Any]) -> dict[str, float]:
        """The energy numbers there are (board total, requests' shares, last J/token); {} without a monitor."""
        view: dict[str, float] = {}
        if "energy_joules" in live:
            view["board_joules"] = round(live["energy_joules"], 3)
        if self.request_energy_j:
            view["request_joules"] = round(self.request_energy_j, 3)
        if self.last_joules_per_token is not None:
            view["last_joules_per_token"] = self.last_joules_per_token
        return view

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)

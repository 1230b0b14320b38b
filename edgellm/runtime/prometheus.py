"""Prometheus text exposition of the service metrics (prometheus-client collectors)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from edgellm.api.service import Service


class _ServiceCollector:
    def __init__(self, service: Service):
        self.service = service

    def collect(self):
        m = self.service.metrics()
        requests = CounterMetricFamily("edgellm_requests", "Requests by outcome", labels=["outcome"])
        for outcome, n in m["requests"].items():
            requests.add_metric([outcome], n)
        yield requests
        yield GaugeMetricFamily("edgellm_in_flight", "Requests queued or generating", value=m["in_flight"])
        yield CounterMetricFamily("edgellm_engine_restarts", "Engine worker restarts", value=m["engine_restarts"])
        engine = m["engine"]
        for key, help_text in (("slots_busy", "Slots generating"), ("waiting", "Requests waiting for a slot")):
            if key in engine:
                yield GaugeMetricFamily(f"edgellm_{key}", help_text, value=engine[key])
        for key in ("prompt_tokens", "generated_tokens", "steps"):
            if key in engine:
                yield CounterMetricFamily(f"edgellm_{key}", f"Engine {key.replace('_', ' ')}", value=engine[key])
        for key in ("decode_ms_per_step", "guide_ms_per_step", "sample_ms_per_step"):
            if key in engine:
                yield GaugeMetricFamily(f"edgellm_{key}", f"Mean {key.replace('_', ' ')}", value=engine[key])


def prometheus_text(service: Service) -> bytes:
    registry = CollectorRegistry()
    registry.register(_ServiceCollector(service))
    return generate_latest(registry)

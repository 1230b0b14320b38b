"""Prometheus text exposition of a service's metrics.

The instruments live in the service's own registry (edgellm/api/metrics.py): real Counter and
Histogram types, so rate() and histogram_quantile() work on the scraped series.
"""

from __future__ import annotations

from edgellm.api.service import Service


def prometheus_text(service: Service) -> bytes:
    return service.instruments.prometheus_text()

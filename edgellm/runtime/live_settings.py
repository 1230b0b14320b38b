"""Which settings a running node takes at once, which need its engine rebuilt, which it cannot take.

A Ratio1 pipeline update (deeploy, UPDATE_CONFIG) changes an instance's config while it serves. The
request rules (sampling bounds, timeouts, the body shape, tokens, the rate limit, the records' TTL)
are read per request, so they change at once (`LIVE`). The engine is built from the model, its
context and slots, its threads and GPU layers, and so is everything sized from them at start (the
memory plan, the queue bound the worker enforces): those need
a drained restart of the app and its engine (in-flight work finishes, pending async work waits in the
durable registry, requests that arrive meanwhile wait for the new app). The listening address, the body
limit and the IPC wait are the node's own web server's (its uvicorn runs a main.py rendered at start):
this process cannot change them, so such an update is refused, said, and the running config kept
(`REFUSED`).
"""

from __future__ import annotations

from dataclasses import dataclass

from edgellm.runtime.settings import Settings

LIVE: frozenset[str] = frozenset(
    {
        "response_format",
        "request_timeout",
        "request_ttl",
        "temperature_min",
        "temperature_max",
        "min_completion_tokens",
        "max_completion_tokens",
        "max_messages",
        "tokens",
        "token_lanes",
        "rate_limit_per_minute",
        "log_level",
        "model_aliases",
        "unknown_model",
    }
)
# Held by the node's own web server, rendered and started once (its main.py: the bind address, the body
# limit, the IPC wait derived from the longest request timeout).
REFUSED: frozenset[str] = frozenset({"host", "port", "max_body_bytes", "max_request_timeout"})


@dataclass(frozen=True)
class SettingsChange:
    live: tuple[str, ...] = ()  # applied to the running app
    restart: tuple[str, ...] = ()  # need the app and its engine rebuilt (drained)
    refused: tuple[str, ...] = ()  # cannot change while running

    @property
    def empty(self) -> bool:
        return not (self.live or self.restart or self.refused)


def changed_fields(old: Settings, new: Settings) -> list[str]:
    """The settings fields whose values differ (in declaration order)."""
    return [name for name in type(old).model_fields if getattr(old, name) != getattr(new, name)]


def classify(old: Settings, new: Settings) -> SettingsChange:
    changed = changed_fields(old, new)
    return SettingsChange(
        live=tuple(f for f in changed if f in LIVE),
        restart=tuple(f for f in changed if f not in LIVE and f not in REFUSED),
        refused=tuple(f for f in changed if f in REFUSED),
    )


__all__ = ["LIVE", "REFUSED", "SettingsChange", "changed_fields", "classify"]

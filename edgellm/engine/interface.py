"""The engine as the API service sees it (vLLM's EngineCoreClient idea, reduced)."""

from __future__ import annotations

from typing import Any, Protocol

from edgellm.engine.types import EngineRequest


class EngineClient(Protocol):
    info: dict[str, Any]  # model name, slots, offload... (after start)
    stats: dict[str, Any]  # latest load and step statistics

    def submit(self, request: EngineRequest) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def in_flight(self) -> int: ...
    def health(self) -> dict[str, Any]: ...
    def close(self) -> None: ...

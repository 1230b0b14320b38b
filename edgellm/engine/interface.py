"""The engine as its users see it (vLLM's EngineCoreClient idea, reduced): one protocol, two clients.

- `runtime.supervisor.WorkerEngine`: the engine core in its own worker process (the node's API);
  outputs arrive from its reader thread.
- `offline.OfflineEngine`: the engine core in the caller's process (`infer`, `batch-run --local`, the
  Ratio1 serving plugin, the engine tests); outputs arrive in the caller's thread while it drives the
  engine (`run()`, or `generate()` for a whole list).

Both take an `on_output(list[EngineOutput])` sink when built and are told requests by `submit`;
`info` and `stats` are `EngineInfo.as_dict()` / `EngineStats.as_dict()` (the keys /health, /status
and /metrics show), empty until known.
"""

from __future__ import annotations

from typing import Any, Protocol

from edgellm.engine.types import EngineRequest


class EngineClient(Protocol):
    # Read-only here: the worker client keeps them as attributes it updates, the in-process one computes them.
    @property
    def info(self) -> dict[str, Any]: ...  # model name, slots, offload... (after start)
    @property
    def stats(self) -> dict[str, Any]: ...  # latest load and step statistics

    def submit(self, request: EngineRequest) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def in_flight(self) -> int: ...
    def health(self) -> dict[str, Any]: ...
    def close(self) -> None: ...

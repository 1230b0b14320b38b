"""How a stored request reads back to a caller: whose record it is, what it says, the /request_status body.

A caller reads its own records (ids scoped by owner: request_ids.request_key) and anonymous ones;
another token's request is as unknown as a missing one. A result still held in memory (the disk was
full when it finished: api/answers.py) is laid over its pending row, so a read never goes back in
time. Apart from the Service's writes (submit, answers) because it is the read side of the registry:
it changes with what a caller may see, not with how a request runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from edgellm.api.registry import Registry, RequestRecord, RequestStatus
from edgellm.api.request_ids import public_id, request_key
from edgellm.api.request_state import RequestTable


def find_record(registry: Registry, request_id: str, owner: str | None) -> RequestRecord | None:
    """The record `owner` may read under `request_id`: the caller's own id first (its key), then the id
    itself (a generated id, an anonymous caller's, or one registered before ids were scoped by owner).
    Blocking (SQLite): call it off the event loop."""
    keys = dict.fromkeys((request_key(request_id, owner), request_id))
    for key in keys:
        rec = registry.get(key)
        if rec is not None and (rec.owner is None or rec.owner == owner):
            return rec
    return None


def with_unsaved(rec: RequestRecord, requests: RequestTable) -> RequestRecord:
    """`rec` with the result this process still holds in memory for it (disk full) laid over a pending row."""
    unsaved = requests.unsaved_of(rec.request_id)
    if unsaved is not None and rec.status is RequestStatus.PENDING:
        rec = dataclasses.replace(
            rec, status=unsaved.status, result=unsaved.result, error=unsaved.error, error_type=unsaved.error_type
        )
    return rec


def status_body(rec: RequestRecord, *, return_full: bool) -> dict[str, Any]:
    """The /request_status body of a record: its status and result or error; with `return_full`, the
    request as stored too (params, seed, metadata, attempts, times, its delegation)."""
    body: dict[str, Any] = {"request_id": public_id(rec.request_id), "status": rec.status.value}
    if rec.status is RequestStatus.COMPLETED:
        body["result"] = rec.result
    elif rec.status.is_finished:
        body["error"] = rec.error
        body["error_type"] = str(rec.error_type) if rec.error_type is not None else None
    if return_full:
        body.update(
            {
                "mode": rec.mode,
                "params": rec.params,
                "seed": rec.seed,
                "metadata": rec.metadata,
                "attempts": rec.attempts,
                "created_at": rec.created_at,
                "finished_at": rec.finished_at,
                "expires_at": rec.expires_at,
            }
        )
        if rec.delegation is not None:
            body["delegation"] = rec.delegation
        if rec.result is not None:
            body["result"] = rec.result
    return body

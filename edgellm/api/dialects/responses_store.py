"""A /v1/responses response as the registry holds it: its id, its record, the conversation it continues.

A response is a request like any other in the registry. Its record's `metadata` holds, under
`META_KEY`, what the response object echoes and the chat body does not keep (instructions, the
client's metadata, text, tool_choice, previous_response_id, store...). The record's params hold the
messages it ran (instructions first, when given) and its result the assistant message it produced, so
a later `previous_response_id` rebuilds the conversation from the record alone (`history`), after a
restart too. Apart from the request mapping (responses.py) and the response object
(responses_object.py) because it changes with what the registry keeps, not with the API's shapes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from edgellm.api.display import kind_of, show
from edgellm.api.request_ids import public_id
from edgellm.errors import InvalidRequest, UnknownRequest

META_KEY = "openai_response"  # the record metadata key that marks a request as a /v1/responses one
ID_PREFIX = "resp_"
ID_PATTERN = r"^resp_[0-9a-f]{32}$"
_ID_RE = re.compile(r"^resp_([0-9a-f]{32})$")


@dataclass(frozen=True)
class StoredResponse:
    """A response's record, as the registry holds it (params: the normalised chat request)."""

    key: str  # the request key it ran under
    response_id: str  # "resp_<hex>"
    status: str  # the record's status: pending | completed | failed | timeout
    meta: dict[str, Any]
    params: dict[str, Any]
    result: dict[str, Any] | None
    error: str | None
    error_type: str | None


# -- ids --------------------------------------------------------------------------------------------
def response_id(public: str) -> str:
    return f"{ID_PREFIX}{public}"


def request_id_of(value: Any, param: str | None = None) -> str:
    """The request id a response id names; a 404 for anything that is not one."""
    match = _ID_RE.match(value) if isinstance(value, str) else None
    if match is None:
        raise not_found(value, param)
    return match.group(1)


def not_found(value: Any, param: str | None = None) -> UnknownRequest:
    """A response id this caller cannot read: unknown, expired, deleted, stored with store=false, or
    another token's (all alike: which one is not the caller's to know)."""
    shown = show(value) if isinstance(value, str) else kind_of(value)
    err = UnknownRequest(f"No response with id {shown} found")
    err.param = param  # error_body() reports it
    return err


# -- stored responses and the conversation they continue -------------------------------------------
def stored_response(record: Any) -> StoredResponse | None:
    """A registry record as a stored response; None when it is not one this API may show (another
    route's request, or one created with store=false)."""
    meta = (getattr(record, "metadata", None) or {}).get(META_KEY)
    if not isinstance(meta, dict) or meta.get("store") is not True:
        return None
    status = getattr(record.status, "value", record.status)
    error_type = None if record.error_type is None else str(record.error_type)
    return StoredResponse(
        record.request_id,
        response_id(public_id(record.request_id)),
        status,
        meta,
        record.params,
        record.result,
        record.error,
        error_type,
    )


def history(prev: StoredResponse) -> list[dict[str, Any]]:
    """The conversation a response continues: the messages the previous one ran (its instructions
    left out: they are not carried over), then the assistant turn it produced."""
    if prev.status == "pending":
        raise InvalidRequest(
            f"previous response {prev.response_id} is still in progress; continue it once it has finished",
            param="previous_response_id",
        )
    message = _message_of(prev.result)
    if message is None:
        raise InvalidRequest(
            f"previous response {prev.response_id} failed; it has no output to continue from",
            param="previous_response_id",
        )
    stored = list(prev.params.get("messages") or [])
    if prev.meta.get("instructions_message") and stored:
        stored = stored[1:]
    turn: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]
    return [_replayed(m) for m in stored] + [turn]


def _replayed(msg: dict[str, Any]) -> dict[str, Any]:
    """A stored message (media/parts.py's stored form) as a client would send it, so that it reads
    back to the same stored message."""
    out = {k: msg[k] for k in ("role", "content", "tool_calls", "tool_call_id") if k in msg}
    content = msg.get("content")
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for part in content:
            if part.get("type") == "text":
                if parts and parts[-1]["type"] == "text":  # stored adjacent texts carry their "\n"
                    parts[-1] = {"type": "text", "text": parts[-1]["text"] + part["text"]}
                else:
                    parts.append({"type": "text", "text": part["text"]})
            elif part.get("type") == "image":
                parts.append({"type": "image", "image": part["source"], "do_resize": part.get("do_resize", True)})
            elif part.get("type") == "audio":
                parts.append({"type": "audio", "audio": part["source"]})
        out["content"] = parts
    return out


def _message_of(result: dict[str, Any] | None) -> dict[str, Any] | None:
    try:
        return result["FULL_OUTPUT"][0]["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return None

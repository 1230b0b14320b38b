"""The whole JSON schema, checked on a finished answer: what generation did not enforce (llguidance's
lenient parts: uniqueItems, not, if/then/else, dependentRequired, contains, a oneOf generated as anyOf)
is judged here by a real validator, so that an answer that fails them is never presented as valid.

jsonschema-rs (Rust): its regex engine bounds backtracking, so a hostile `pattern` cannot hold the step
loop the way Python's `re` could; remote `$ref`s are never fetched (the node is offline by design).
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache

import jsonschema_rs

log = logging.getLogger(__name__)
_MESSAGE_CHARS = 300


def _no_fetch(uri: str) -> object:
    raise ValueError(f"remote $ref {uri[:100]} is not fetched")


@lru_cache(maxsize=64)
def _validator(schema_text: str):
    """The validator of a schema (draft from its $schema), or None where jsonschema-rs cannot build one."""
    try:
        return jsonschema_rs.validator_for(json.loads(schema_text), retriever=_no_fetch)
    except Exception as exc:  # noqa: BLE001 - a schema llguidance took and jsonschema-rs does not: unchecked
        log.info("schema not checked after generation: %s", str(exc)[:200])
        return None


# How an answer the validator itself failed on is reported (nothing a second draw would change).
SCHEMA_UNCHECKED = "the schema could not be checked"


def schema_error(schema_text: str, text: str) -> str | None:
    """Why `text` fails the schema whose JSON text is `schema_text` (its first error, with the instance
    path), or None when it passes or cannot be judged (the text is not JSON: that is the guide's to
    report; the validator cannot be built). The schema comes as text, the one its guide was compiled
    from (Guide.checked_against): made once per request off the step loop, and the validators' cache key."""
    validator = _validator(schema_text)
    if validator is None:
        return None
    try:
        instance = json.loads(text)
    except ValueError:
        return None
    try:
        for error in validator.iter_errors(instance):
            where = "/" + "/".join(str(p) for p in error.instance_path)
            return f"{error.message} (at {where})"[:_MESSAGE_CHARS]
    except Exception as exc:  # noqa: BLE001 - a validator's own failure is reported, not raised on the step loop
        return f"{SCHEMA_UNCHECKED}: {str(exc)[:200]}"
    return None

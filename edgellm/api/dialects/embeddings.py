"""OpenAI's /v1/embeddings and llama-server's tokenizer routes (/tokenize, /detokenize): body rules and
answer shapes. The work is done by engine tasks (engine/tasks.py) through `Service.run_task`.

Every refusal is an InvalidRequest naming its param; client values in messages are shown escaped.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgellm.api.dialects.openai_chat import check_model, read_flag, refuse_unknown
from edgellm.api.display import show
from edgellm.api.validation import priority
from edgellm.engine.types import EngineRequest, EngineTask
from edgellm.errors import InvalidRequest, PayloadTooLarge

MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request
ENCODINGS = ("float", "base64")
# priority: edgellm's lanes (engine/types.Priority), as on the chat routes.
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user", "priority"})


@dataclass(frozen=True)
class EmbeddingsCall:
    request: EngineRequest
    encoding: str
    n_inputs: int
    priority: str | None = None  # as asked; None: the caller's lane (api/auth.py)


def parse_embeddings(body: Any, model_id: str | tuple[str, ...], *, n_embd: int, max_bytes: int) -> EmbeddingsCall:
    """An OpenAI embeddings body -> the EMBED task; `input` is a string, a list of strings, a list of
    token ids or a list of such lists."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    refuse_unknown(body, EMBEDDING_FIELDS)
    check_model(body, model_id)
    encoding = body.get("encoding_format", "float") or "float"
    if encoding not in ENCODINGS:
        raise InvalidRequest(
            f"encoding_format must be 'float' or 'base64', got {show(encoding)}", param="encoding_format"
        )
    dims = body.get("dimensions")
    if dims is not None:
        if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
            raise InvalidRequest(f"dimensions must be a positive integer, got {show(dims)}", param="dimensions")
        if dims != n_embd:
            raise InvalidRequest(
                f"dimensions={dims} is not supported: this model's embeddings have {n_embd} dimensions and are "
                "not trained to be shortened; omit dimensions",
                param="dimensions",
            )
    if "user" in body and body["user"] is not None and not isinstance(body["user"], str):
        raise InvalidRequest("user must be a string", param="user")
    inputs = _inputs(body.get("input"), max_bytes)
    request = EngineRequest("", [], task=EngineTask.EMBED, payload={"inputs": inputs, "normalize": True})
    return EmbeddingsCall(request, encoding, len(inputs), priority(body.get("priority")))


def _inputs(value: Any, max_bytes: int) -> list[str | list[int]]:
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_id(v) for v in value):
        items = [value]  # one input given as token ids
    elif isinstance(value, list) and value:
        items = value
    elif isinstance(value, list):
        raise InvalidRequest("input must not be an empty array", param="input")
    else:
        raise InvalidRequest("input must be a string, an array of strings, or token ids", param="input")
    if len(items) > MAX_INPUTS:
        raise InvalidRequest(f"input holds {len(items)} items; the limit is {MAX_INPUTS}", param="input")
    size = 0
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"input[{i}] is an empty string", param="input")
            if "\x00" in item:
                raise InvalidRequest(f"input[{i}] contains a NUL character", param="input")
            try:
                size += len(item.encode("utf-8"))
            except UnicodeEncodeError:
                raise InvalidRequest(f"input[{i}] contains a lone surrogate (invalid UTF-16)", param="input") from None
        elif isinstance(item, list) and item and all(_is_id(v) for v in item):
            size += 4 * len(item)
        else:
            raise InvalidRequest(
                f"input[{i}] must be a non-empty string or a non-empty array of token ids, got {show(item)}",
                param="input",
            )
        if size > max_bytes:
            raise PayloadTooLarge(f"input is over {max_bytes} bytes in all; send fewer or shorter inputs")
    return items


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def embeddings_body(matrix: np.ndarray, call: EmbeddingsCall, model: str, prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's answer: one `embedding` per input, in input order; base64 is the float32 little-endian bytes."""
    rows = np.asarray(matrix, dtype="<f4")
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(row.tobytes()).decode("ascii") if call.encoding == "base64" else row.tolist(),
        }
        for i, row in enumerate(rows)
    ]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


# -- llama-server's tokenizer routes -----------------------------------------------------------
def _only(body: Any, allowed: frozenset[str]) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    refuse_unknown(body, allowed)
    return body


def parse_tokenize(body: Any, max_bytes: int) -> EngineRequest:
    """/tokenize {content, add_special (false), parse_special (true), with_pieces (false)}."""
    body = _only(body, frozenset({"content", "add_special", "parse_special", "with_pieces"}))
    content = body.get("content")
    if not isinstance(content, str):
        raise InvalidRequest("content must be a string", param="content")
    try:
        size = len(content.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRequest("content contains a lone surrogate (invalid UTF-16)", param="content") from None
    if size > max_bytes:
        raise PayloadTooLarge(f"content is {size} bytes; the limit is {max_bytes}")
    payload = {
        "content": content,
        "add_special": read_flag(body, "add_special", False),
        "parse_special": read_flag(body, "parse_special", True),
        "with_pieces": read_flag(body, "with_pieces", False),
    }
    return EngineRequest("", [], task=EngineTask.TOKENIZE, payload=payload)


def parse_detokenize(body: Any, max_tokens: int) -> EngineRequest:
    """/detokenize {tokens: [int]}; the ids are checked against the vocabulary by the engine."""
    body = _only(body, frozenset({"tokens"}))
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_id(t) for t in tokens):
        raise InvalidRequest("tokens must be an array of non-negative integers", param="tokens")
    if len(tokens) > max_tokens:
        raise InvalidRequest(f"tokens holds {len(tokens)} ids; the limit is {max_tokens}", param="tokens")
    return EngineRequest("", [], task=EngineTask.DETOKENIZE, payload={"tokens": tokens})

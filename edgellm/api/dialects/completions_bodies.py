"""OpenAI's legacy text completions (`POST /v1/completions`): the response bodies.

The stored results keep the chat shape every route stores (api/results.py); these functions turn them
into OpenAI's `text_completion` objects (whole, or one streamed chunk), with the legacy `logprobs` shape
(tokens, token_logprobs, top_logprobs as {token: logprob}, text_offset). Apart from the request mapping
(completions.py) because it changes with OpenAI's response shapes, not with the body's rules.
"""

from __future__ import annotations

from typing import Any

from edgellm.api.dialects.completions import CompletionOptions


def legacy_logprobs(entries: list[dict[str, Any]], top: int, offset: int = 0) -> dict[str, Any]:
    """OpenAI's legacy choice.logprobs for token entries (TokenLogprob.to_dict()): top_logprobs cut to
    `top` per token, as {token: logprob} (the best kept when two ids spell the same text), and each
    token's offset in the choice's text (from `offset`)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e["token"])
        token_logprobs.append(e["logprob"])
        best: dict[str, float] = {}
        for t in e.get("top_logprobs", [])[:top]:
            best.setdefault(t["token"], t["logprob"])
        tops.append(best)
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _choice(index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}


def completion_response(
    results: list[dict[str, Any]], opts: CompletionOptions, model: str, echoes: list[str] | None = None
) -> dict[str, Any]:
    """The text_completion body for the stored results of a body's prompts (in prompt order); `echoes`:
    each prompt's text, with `echo`. Usage is summed over the prompts."""
    choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached = 0
    created = None
    for p, result in enumerate(results):
        full = result["FULL_OUTPUT"][0]
        created = created if created is not None else full.get("created")
        for j, choice in enumerate(full["choices"]):
            text = (choice.get("message") or {}).get("content") or ""
            lp = None
            if opts.logprobs is not None:
                lp = legacy_logprobs((choice.get("logprobs") or {}).get("content", []), opts.logprobs)
            lead = echoes[p] if opts.echo and echoes is not None else ""
            choices.append(_choice(p * opts.n + j, lead + text, choice.get("finish_reason"), lp))
        u = full.get("usage") or {}
        for key in usage:
            usage[key] += int(u.get(key) or 0)
        cached += int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "id": f"cmpl-{results[0]['REQUEST_ID']}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": "edgellm",
        "choices": choices,
        "usage": {**usage, "prompt_tokens_details": {"cached_tokens": cached}},
    }


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    text: str,
    *,
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """One streamed text_completion chunk (one choice's new text)."""
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": "edgellm",
        "choices": [_choice(index, text, finish_reason, logprobs)],
    }


def usage_chunk(request_id: str, model: str, created: int, usage: dict[str, Any]) -> dict[str, Any]:
    """The last chunk with stream_options.include_usage: no choices, the usage summed over the prompts."""
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": "edgellm",
        "choices": [],
        "usage": usage,
    }


def summed_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's usage for several prompts' usage objects (api/results.usage_of)."""
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    out: dict[str, Any] = {k: sum(int(u.get(k) or 0) for u in usages) for k in keys}
    cached = sum(int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for u in usages)
    out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out

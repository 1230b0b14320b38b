"""The Ollama dialect (`POST /api/chat`, `/api/generate`): the request mapping.

An Ollama body is translated into an OpenAI chat-completions body (then `Service.parse_openai` applies
every rule, limit and guide of that route) or, for `/api/generate` with `raw` or `suffix`, into a
`/v1/completions` body (no chat template, fill-in-the-middle). Only what Ollama spells differently is
read here: `options` (its sampling names), `format` (guided decoding), `think`, `keep_alive`, `stream`
(true unless said otherwise); its messages (images as base64, tool calls with arguments as objects,
`tool_name`) are in ollama_messages.py. Refusals are InvalidRequest (400) naming the Ollama field; the
answers (bodies, NDJSON chunks, the error body) are in ollama_answer.py, the model listings in
ollama_models.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from edgellm.api.dialects.ollama_messages import Origins, chat_messages, images_content
from edgellm.api.dialects.openai_chat import read_flag
from edgellm.api.display import kind_of, show
from edgellm.api.fields import MAX_REPEAT_LAST_N
from edgellm.errors import EdgeLLMError, InvalidRequest

# Ollama's `options` this node maps onto its own sampling fields (same meaning, Ollama's names).
SAMPLING_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "repeat_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "stop": "stop",
}
# Read by their own rules below.
OWN_OPTIONS = frozenset({"num_predict", "repeat_last_n", "num_ctx"})
# Accepted and ignored, as Ollama ignores what its runner does not use: load-time knobs (the node's
# settings decide them once for every request) and samplers this node does not have (docs/api/ollama.md).
IGNORED_OPTIONS = frozenset(
    {
        "numa",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "f16_kv",
        "logits_all",
        "vocab_only",
        "use_mmap",
        "use_mlock",
        "embedding_only",
        "num_thread",
        "num_keep",
        "tfs_z",
        "typical_p",
        "mirostat",
        "mirostat_tau",
        "mirostat_eta",
        "penalize_newline",
    }
)
COMMON_FIELDS = frozenset({"model", "stream", "format", "options", "keep_alive", "think", "logprobs", "top_logprobs"})
# tool_choice: edgellm's ("required", "none" or a named function, as OpenAI's); Ollama always lets the model choose.
CHAT_FIELDS = COMMON_FIELDS | {"messages", "tools", "tool_choice"}
GENERATE_FIELDS = COMMON_FIELDS | {"prompt", "suffix", "system", "template", "context", "raw", "images"}
# edgellm's own fields, as on the other routes (lanes and deadlines); Ollama has none of them.
EDGELLM_FIELDS = frozenset({"priority", "deadline_ms"})
THINK_LEVELS = ("low", "medium", "high")
MAX_TOP_LOGPROBS = 20
FOREVER = -1.0  # keep_alive: keep the model loaded
MAX_KEEP_ALIVE_S = 365 * 24 * 3600.0  # longer is forever (a date that far out would not even print)
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class OllamaCall:
    """What the answer needs besides the result: how it is sent and what it carries."""

    model: str  # the name the caller sent (Ollama echoes it)
    stream: bool = True
    keep_alive_s: float | None = None  # None: not given (the node's own rule); -1: forever; 0: unload after
    logprobs: bool = False
    top_logprobs: int = 0
    raw: bool = False  # /api/generate as a text completion (raw or suffix): no chat template
    load_only: bool = False  # no prompt: Ollama's way to load (or, keep_alive 0, unload) a model


def chat_to_openai(body: Any, *, max_tokens_cap: int) -> tuple[dict[str, Any], OllamaCall, Origins]:
    """An /api/chat body -> (an OpenAI chat body, the call's options, where each message came from).
    `max_tokens_cap`: the node's largest max_tokens (num_predict -1, "until the context is full")."""
    body = _object(body, CHAT_FIELDS)
    call = _call(body)
    origins = Origins()
    messages = body.get("messages")
    if messages is None or messages == []:
        return {}, _replace(call, load_only=True), origins
    out = _common(body, max_tokens_cap)
    out["messages"] = chat_messages(messages, origins)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequest(f"tools must be an array of tools, got {kind_of(tools)}", param="tools")
        if tools:
            out["tools"] = tools  # Ollama's tools are OpenAI's function tools: checked by the shared rules
    if body.get("tool_choice") is not None:
        out["tool_choice"] = body["tool_choice"]
    return out, call, origins


def generate_to_openai(body: Any, *, max_tokens_cap: int) -> tuple[dict[str, Any], OllamaCall]:
    """An /api/generate body -> (an OpenAI chat body, or with `raw`/`suffix` a /v1/completions body; the
    call's options). A body without a prompt (and without images) only loads or unloads its model."""
    body = _object(body, GENERATE_FIELDS)
    call = _call(body)
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidRequest(f"prompt must be a string, got {kind_of(prompt)}", param="prompt")
    if body.get("context") not in (None, []):
        raise InvalidRequest(
            "context (the token ids of an earlier answer) is not supported: this server does not return them; "
            "send the conversation to /api/chat as messages instead",
            param="context",
        )
    template = body.get("template")
    if template not in (None, ""):
        raise InvalidRequest(
            "template is not supported: this server renders prompts with the model's own chat template; "
            "send raw: true with the prompt as the model should see it instead",
            param="template",
        )
    raw = read_flag(body, "raw", False)
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise InvalidRequest(f"suffix must be a string, got {kind_of(suffix)}", param="suffix")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise InvalidRequest(f"system must be a string, got {kind_of(system)}", param="system")
    images = body.get("images")
    if not prompt and not images and not suffix:
        return {}, _replace(call, load_only=True)
    if raw or suffix:
        return _completion_body(body, call, prompt or "", suffix, max_tokens_cap), _replace(call, raw=True)
    out = _common(body, max_tokens_cap)
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": images_content(prompt or "", images, "images")})
    out["messages"] = messages
    return out, call


def _completion_body(
    body: dict[str, Any], call: OllamaCall, prompt: str, suffix: str | None, max_tokens_cap: int
) -> dict[str, Any]:
    """/api/generate with `raw` or `suffix` -> a /v1/completions body: the prompt as written (no chat template,
    so no system, images or thinking), `suffix` filled in the middle where the model has FIM tokens."""
    mode = "raw" if body.get("raw") else "suffix"
    for name in ("images", "system", "think"):
        if body.get(name) not in (None, [], ""):
            raise InvalidRequest(
                f"{name} is not supported with {mode}: the prompt is the model's input as written (no chat template)",
                param=name,
            )
    if call.top_logprobs > 5:
        raise InvalidRequest(f"top_logprobs must be at most 5 with {mode}", param="top_logprobs")
    out: dict[str, Any] = {"model": body["model"], "prompt": prompt}
    out.update(options(body.get("options"), max_tokens_cap))
    out.setdefault("max_tokens", min(512, max_tokens_cap))  # the chat route's default, not completions' 16
    rf = response_format(body.get("format"))
    if rf is not None:
        out["response_format"] = rf
    if suffix:
        out["suffix"] = suffix
    if call.logprobs:
        out["logprobs"] = call.top_logprobs
    for name in EDGELLM_FIELDS:
        if body.get(name) is not None:
            out[name] = body[name]
    return out


def _object(body: Any, known: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {kind_of(body)}")
    # Fields this node does not know are ignored, as Ollama's server ignores them: its clients send fields
    # of newer Ollama releases (truncate, shift, ...) that an older server skips. Only the known ones are read.
    body = {k: v for k, v in body.items() if k in known or k in EDGELLM_FIELDS}
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required (a model name, a string)", param="model")
    return body


def _call(body: dict[str, Any]) -> OllamaCall:
    stream = read_flag(body, "stream", True)  # Ollama streams unless told not to
    logprobs = read_flag(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is None:
        top = 0
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {show(top)}", param="top_logprobs"
        )
    if top and not logprobs:
        raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
    return OllamaCall(
        model=body["model"],
        stream=stream,
        keep_alive_s=keep_alive_seconds(body.get("keep_alive")),
        logprobs=logprobs,
        top_logprobs=top,
    )


def _common(body: dict[str, Any], max_tokens_cap: int) -> dict[str, Any]:
    """What /api/chat and /api/generate share: the model, options, format, think, logprobs, edgellm's fields."""
    out: dict[str, Any] = {"model": body["model"]}
    out.update(options(body.get("options"), max_tokens_cap))
    rf = response_format(body.get("format"))
    if rf is not None:
        out["response_format"] = rf
    out.update(think(body.get("think")))
    if body.get("logprobs"):
        out["logprobs"] = True
        if body.get("top_logprobs"):
            out["top_logprobs"] = body["top_logprobs"]
    for name in EDGELLM_FIELDS:
        if body.get(name) is not None:
            out[name] = body[name]
    return out


def options(value: Any, max_tokens_cap: int) -> dict[str, Any]:
    """Ollama's `options` -> the OpenAI body's sampling fields. Types and bounds are the shared rules'
    (their errors are renamed `options.<name>` by rename_error); unknown keys are ignored, as Ollama does."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"options must be an object, got {kind_of(value)}", param="options")
    out: dict[str, Any] = {}
    for name, target in SAMPLING_OPTIONS.items():
        if value.get(name) is not None:
            out[target] = value[name]
    if isinstance(out.get("stop"), list) and not out["stop"]:
        del out["stop"]
    if isinstance(out.get("seed"), int) and not isinstance(out["seed"], bool) and out["seed"] < 0:
        out["seed"] = None  # Ollama: a negative seed is a random one
    predict = value.get("num_predict")
    if predict is not None:
        if isinstance(predict, bool) or not isinstance(predict, int):
            raise InvalidRequest(f"options.num_predict must be an integer, got {show(predict)}", param="options")
        if predict in (-1, -2):  # until the end (-1) or the context is full (-2): the node's most
            out["max_tokens"] = max_tokens_cap
        elif predict < 1:
            raise InvalidRequest(
                f"options.num_predict must be -1, -2 or at least 1, got {show(predict)}", param="options"
            )
        else:
            out["max_tokens"] = predict
    last = value.get("repeat_last_n")
    if last is not None:
        if isinstance(last, bool) or not isinstance(last, int) or last < -1:
            raise InvalidRequest(f"options.repeat_last_n must be an integer >= -1, got {show(last)}", param="options")
        if last == 0:  # Ollama: 0 turns the repeat penalty off
            out["repeat_penalty"] = 1.0
        else:  # -1: the whole context
            out["repeat_last_n"] = MAX_REPEAT_LAST_N if last == -1 else min(last, MAX_REPEAT_LAST_N)
    ctx = value.get("num_ctx")
    if ctx is not None and (isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 1):
        raise InvalidRequest(f"options.num_ctx must be a positive integer, got {show(ctx)}", param="options")
    # num_ctx within the node's limits: each request may use up to the context the node was started with
    # (/api/show's context_length); a larger num_ctx cannot be given, a smaller one is not needed.
    return out


def response_format(value: Any) -> dict[str, Any] | None:
    """`format`: "json" (any JSON object) or a JSON schema -> the guided decoding of response_format."""
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise InvalidRequest(f'format must be "json" or a JSON schema (an object), got {show(value)}', param="format")


def think(value: Any) -> dict[str, Any]:
    """`think`: true (the model's reasoning, in `thinking`), false (none: the template told
    `enable_thinking: false` and the block closed at once), "low"/"medium"/"high" (a reasoning budget).
    Absent: the model's own default."""
    if value is None:
        return {}
    if value is True:
        return {}
    if value is False:
        return {"chat_template_kwargs": {"enable_thinking": False}, "thinking_budget_tokens": 0}
    if isinstance(value, str) and value in THINK_LEVELS:
        return {"reasoning_effort": value}
    raise InvalidRequest(f'think must be true, false, "low", "medium" or "high", got {show(value)}', param="think")


def keep_alive_seconds(value: Any) -> float | None:
    """`keep_alive` in seconds: a number (seconds), or a duration ("5m", "1h30m", "300ms", "-1"); a negative
    one is forever (-1.0), 0 unloads after the answer; None when not given."""
    if value is None or value == "":
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _duration(value)
    else:
        raise InvalidRequest(
            f"keep_alive must be a duration or a number of seconds, got {show(value)}", param="keep_alive"
        )
    if math.isnan(seconds) or math.isinf(seconds) or seconds > MAX_KEEP_ALIVE_S:
        return FOREVER  # a year or more: as long as the node runs
    return FOREVER if seconds < 0 else seconds


def _duration(text: str) -> float:
    """Go's time.ParseDuration as Ollama reads keep_alive ("5m", "-1m", "1h30m", "2.5s"), or a bare number
    of seconds ("300", "-1")."""
    s = text.strip()
    if len(s) > 64:
        _bad_duration(text)
    try:
        value = float(s)
    except ValueError:
        pass
    else:
        return value if not math.isnan(value) else _bad_duration(text)
    sign = -1.0 if s.startswith("-") else 1.0
    s = s.lstrip("+-")
    total, pos = 0.0, 0
    while pos < len(s):
        m = _DURATION.match(s, pos)
        if m is None:
            _bad_duration(text)
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if not s:
        _bad_duration(text)
    return sign * total


def _bad_duration(text: str) -> float:
    raise InvalidRequest(
        f'keep_alive must be a duration such as "5m", "30s", "1h" or "-1" (or a number of seconds), got {show(text)}',
        param="keep_alive",
    )


def _replace(call: OllamaCall, **changes: Any) -> OllamaCall:
    return OllamaCall(**{**call.__dict__, **changes})


# The OpenAI/seed parameter a shared rule names -> where it came from in an Ollama body.
PARAM_NAMES = {
    **{target: f"options.{name}" for name, target in SAMPLING_OPTIONS.items()},
    "max_tokens": "options.num_predict",
    "repeat_last_n": "options.repeat_last_n",
    "response_format": "format",
    "guided_decoding": "format",
    "thinking_budget_tokens": "think",
    "chat_template_kwargs": "think",
    "reasoning_effort": "think",
}
_WHERE = re.compile(r"messages\[(\d+)\]")


def rename_error(exc: EdgeLLMError, origins: Origins | None = None) -> EdgeLLMError:
    """An error of the shared rules, renamed for an Ollama caller: the Ollama field (`options.top_k`,
    `format`, `think`) for the OpenAI one, and message indexes as the caller sent them."""
    if not isinstance(exc, InvalidRequest):
        return exc
    message = exc.message
    if origins is not None:
        message = _WHERE.sub(lambda m: origins.where(int(m.group(1))), message)
    param = exc.param
    if param in PARAM_NAMES:
        name = PARAM_NAMES[param]
        if not message.startswith(name):
            message = f"{name}: {message}"
        exc.param = name
    exc.message = message
    exc.args = (message,)
    return exc

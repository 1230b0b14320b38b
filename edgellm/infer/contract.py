"""The TensorRT-Edge-LLM `llm_inference` input JSON (seeds 000 and 001), read into engine requests.

`load_job(path)` / `parse_job(data, input_file)` turn an input file into an `InferJob`: one
`InferItem` (an `EngineRequest` plus what the output echoes) per request and one `InferBatch` per
consecutive `batch_size` requests. Nothing here loads a model.

Two kinds of problem, as `llm_inference` has them:
- the file is wrong (not JSON, an unknown field, a value out of range): `InferInputError`, one message
  naming the JSON path of the field (`requests[2].logit_bias["12"]: ...`); nothing runs;
- one request cannot run here (image/audio/video content, a guide llguidance rejects, a batch mixing
  LoRA adapters): its item carries `error` and the rest of the file runs.

Checks run in three passes: the JSON reader (duplicate keys, NaN, over-long numbers, lone surrogates,
depth: what Python's json would accept or crash on), the pydantic models (shape, types, ranges; every
model forbids unknown fields), then the cross-field rules (lora_name, batches, guides). One module on
purpose: the format is one concept, and its rules read best next to each other.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

from pydantic import BaseModel, BeforeValidator, ConfigDict, PrivateAttr, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from edgellm.api.validation import MAX_LOGIT_BIAS, MAX_SEED, MAX_STOP_STRINGS, MAX_TOKEN_ID, has_surrogate
from edgellm.engine.types import CacheCommit, EngineRequest, GuideKind, GuideSpec, SamplingParams
from edgellm.errors import EdgeLLMError, GuideError, InvalidRequest
from edgellm.media.parts import parse_content

MAX_FILE_BYTES = 64 * 1024 * 1024
# Containers nested deeper than this are refused (a json_schema nests a few levels in practice; the
# file's own structure takes five). Python's json gives up on its own at ~1000 levels.
MAX_JSON_DEPTH = 100
# A number written with more digits than this is refused before Python converts it (int() of a
# 5000-digit string raises; float() of one is inf).
MAX_NUMBER_DIGITS = 1000
MAX_GENERATE_LENGTH = 32768
MAX_NUM_LOGPROBS = 50
MAX_BIAS = 100.0
MAX_TOP_K = MAX_TOKEN_ID
GUIDE_MODES = ("json_object", "json_schema", "regex", "ebnf", "structural_tag", "choice")  # the seed's order
MIXED_LORA_ERROR = "Different LoRA weights within the same batch are not supported"
VIDEO_ERROR = "video content is not supported by edgellm infer"
UNKNOWN_FIELD = "unknown field (not in the TensorRT-Edge-LLM input format)"
# Defaults of the current format (seed 000).
DEFAULTS: dict[str, Any] = {
    "batch_size": 1,
    "temperature": 1.0,
    "top_p": 0.8,
    "top_k": 50,
    "sampling_seed": None,
    "spec_proposal_sampling": "auto",
    "logit_bias": {},
    "max_generate_length": 256,
    "num_logprobs": 0,
    "apply_chat_template": True,
    "add_generation_prompt": True,
    "enable_thinking": False,
    "context_cache_lookup_policy": "use_cache",
    "context_cache_commit_policy": "including_generated_tokens",
    "available_lora_weights": {},
    "guided_decoding": None,
}


class InferInputError(EdgeLLMError):
    """The input file cannot run at all; `path` is the JSON path of the field at fault (None: the file)."""

    http_status = 400
    error_type = "infer_input"

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


@dataclass
class InferItem:
    request_idx: int
    batch_idx: int
    messages: list[dict]  # as given in the file, echoed in the output
    request: EngineRequest  # request_id f"infer-{request_idx}"
    lora_name: str | None
    error: str | None  # set: this request does not run (its own problem, or its batch's)
    seed: int = 0  # the sampling seed used (also request.sampling.seed): the file's, or drawn here
    seed_drawn: bool = False  # True: the file gave none, `seed` was drawn with secrets.randbits(64)
    disable_spec_decode: bool = False  # as the request says; its batch's value is what counts


@dataclass
class InferBatch:
    batch_idx: int
    item_indices: list[int]
    lora_name: str | None
    num_logprobs: int  # the largest K its requests ask for; every request in it gets this K
    disable_spec_decode: bool  # any request of the batch sets it: no drafts for the whole batch
    error: str | None


@dataclass
class InferJob:
    input_file: str
    batch_size: int
    items: list[InferItem]
    batches: list[InferBatch]
    lora_weights: dict[str, str]
    top: dict[str, Any] = field(default_factory=dict)  # normalised top-level values, for the profile


# -- rendering values and paths in messages ------------------------------------------------------------

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _key_text(key: str) -> str:
    key = key[:64] + ("..." if len(key) > 64 else "")
    return json.dumps(key, ensure_ascii=has_surrogate(key))


def _path(parts: tuple[str | int, ...] | list[str | int], *, relative: bool = False) -> str:
    """`requests[2].logit_bias["12"]`; relative=True: a continuation (`.name` even first)."""
    out = ""
    if len(parts) > 12:  # a path 100 levels deep says no more than its first steps
        parts = [*parts[:10], "..."]
    for part in parts:
        if part == "...":
            out += "..."
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif _IDENT.fullmatch(part):
            out += f".{part}" if out or relative else part
        else:
            out += f"[{_key_text(part)}]"
    return out if len(out) <= 160 else out[:157] + "..."


def _got(value: Any) -> str:
    """A value from the file as JSON would show it, bounded."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        if value.bit_length() > 128:
            return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return _key_text(value) if len(value) <= 64 else _key_text(value[:61]) + " (a string)"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def _quoted(values: tuple[str, ...] | list[str]) -> str:
    return ", ".join(json.dumps(v) for v in values)


# -- pass 1: JSON text -> Python values, with what json.loads would accept or crash on marked ---------


class _Bad:
    """Stands for a JSON token Python cannot hold faithfully; the tree walk reports it with its path."""

    __slots__ = ("problem",)

    def __init__(self, problem: str):
        self.problem = problem


class _DupDict(dict):
    """An object in which a key appears twice (json.loads would keep the last silently)."""

    duplicate: str = ""


def _object(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = _DupDict(obj)
        dup.duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
        return dup
    return obj


def _digits(text: str) -> int:
    return sum(c.isdigit() for c in text)


def _int(text: str) -> int | _Bad:
    if len(text) > MAX_NUMBER_DIGITS + 1 and _digits(text) > MAX_NUMBER_DIGITS:
        return _Bad(f"number with {_digits(text)} digits is too long (at most {MAX_NUMBER_DIGITS})")
    return int(text)


def _float(text: str) -> float | _Bad:
    if len(text) > MAX_NUMBER_DIGITS + 1 and _digits(text) > MAX_NUMBER_DIGITS:
        return _Bad(f"number with {_digits(text)} digits is too long (at most {MAX_NUMBER_DIGITS})")
    value = float(text)
    if not math.isfinite(value):
        return _Bad(f"number {text[:40]} is out of range (not a finite 64-bit float)")
    return value


def _constant(name: str) -> _Bad:
    return _Bad(f"{name} is not valid JSON (numbers must be finite)")


class _JsonProblem(Exception):
    """What is wrong with a JSON text or value, at `parts` (a path inside it)."""

    def __init__(self, problem: str, parts: list[str | int] | None = None):
        super().__init__(problem)
        self.problem, self.parts = problem, parts or []


def _loads(text: str) -> Any:
    """JSON text -> values; _Bad and _DupDict mark what _check_tree() reports with its path."""
    try:
        return json.loads(text, object_pairs_hook=_object, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise _JsonProblem(f"nests deeper than {MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise _JsonProblem(f"is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None


def _check_tree(value: Any, depth: int = 0) -> None:
    """Walks a parsed value (iteratively) and raises _JsonProblem for the first problem in document
    order: a _Bad token, a duplicate key, a lone surrogate, a non-finite float, an integer too long,
    nesting deeper than MAX_JSON_DEPTH, a non-JSON type (parse_job may be given any Python value).
    `depth`: how deep `value` sits in the file."""
    # Entries: (value, parent entry, key, depth); a path is built only for the problem reported.
    stack: list[tuple[Any, Any, str | int | None, int]] = [(value, None, None, depth)]

    def fail(entry: tuple, problem: str) -> NoReturn:
        parts: list[str | int] = []
        while entry is not None and entry[2] is not None:
            parts.append(entry[2])
            entry = entry[1]
        raise _JsonProblem(problem, parts[::-1])

    while stack:
        entry = stack.pop()
        item, _, _, level = entry
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, str):
            if has_surrogate(item):
                fail(entry, "string holds a lone surrogate (invalid UTF-16 escape); the file must be valid Unicode")
        elif isinstance(item, int):
            if item.bit_length() > MAX_NUMBER_DIGITS * 3.33:
                fail(entry, f"integer is too long (more than {MAX_NUMBER_DIGITS} digits)")
        elif isinstance(item, float):
            if not math.isfinite(item):
                fail(entry, f"{item!r} is not valid JSON (numbers must be finite)")
        elif isinstance(item, _Bad):
            fail(entry, item.problem)
        elif isinstance(item, dict | list):
            if level >= MAX_JSON_DEPTH:
                fail(entry, f"nests deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(item, _DupDict):
                fail((None, entry, item.duplicate, level + 1), "key appears more than once in its object")
            if isinstance(item, list):
                stack.extend((child, entry, i, level + 1) for i, child in reversed(list(enumerate(item))))
                continue
            children = []
            for key, child in item.items():
                if not isinstance(key, str):
                    fail(entry, f"key {_got(key)} is not a string")
                if has_surrogate(key):
                    fail(entry, f"key {_key_text(key)} holds a lone surrogate (invalid UTF-16 escape)")
                children.append((child, entry, key, level + 1))
            stack.extend(reversed(children))
        else:
            fail(entry, f"{_got(item)} is not a JSON value")


# -- pass 2: the models ---------------------------------------------------------------------------------


class _Problem(Exception):
    """A rule's refusal: `message`, at `sub` below the field that was being checked."""

    def __init__(self, message: str, sub: str = ""):
        super().__init__(message)
        self.message, self.sub = message, sub


def _rule(check: Any) -> BeforeValidator:
    """A check function as a pydantic validator: its _Problem becomes our own error type (no pydantic
    wording reaches the user)."""

    def run(value: Any) -> Any:
        try:
            return check(value)
        except _Problem as p:
            raise PydanticCustomError("infer", "{message}", {"message": p.message, "sub": p.sub}) from None

    return BeforeValidator(run)


def _integer(desc: str, lo: int, hi: int | None = None) -> Any:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            raise _Problem(f"must be {desc}, got {_got(value)}")
        return value

    return check


def _number(desc: str, ok: Any) -> Any:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _Problem(f"must be {desc}, got {_got(value)}")
        try:
            number = float(value)
        except OverflowError:  # an int beyond any float
            raise _Problem(f"must be {desc}, got {_got(value)}") from None
        if not math.isfinite(number) or not ok(number):
            raise _Problem(f"must be {desc}, got {_got(value)}")
        return number

    return check


def _choice(values: tuple[str, ...]) -> Any:
    def check(value: Any) -> str:
        if not isinstance(value, str) or value not in values:
            raise _Problem(f"must be one of {_quoted(values)}, got {_got(value)}")
        return value

    return check


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Problem(f"must be true or false, got {_got(value)}")
    return value


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise _Problem(f"must be a string, got {_got(value)}")
    return value


def _path_string(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _Problem(f"must be a non-empty path string, got {_got(value)}")
    return value


_check_batch_size = _integer("an integer >= 1", 1)
_check_max_length = _integer(f"an integer in [1, {MAX_GENERATE_LENGTH}]", 1, MAX_GENERATE_LENGTH)
_check_num_logprobs = _integer(f"an integer in [0, {MAX_NUM_LOGPROBS}]", 0, MAX_NUM_LOGPROBS)
_check_seed = _integer("an unsigned 64-bit integer in [0, 2^64-1]", 0, MAX_SEED)


def _stop(value: Any) -> list[str]:
    if isinstance(value, str):
        if not value:
            raise _Problem('must be a non-empty string or an array of non-empty strings, got ""')
        return [value]
    if not isinstance(value, list):
        raise _Problem(f"must be a string or an array of strings, got {_got(value)}")
    if len(value) > MAX_STOP_STRINGS:
        raise _Problem(f"may hold at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise _Problem(f"must be a non-empty string, got {_got(s)}", f"[{i}]")
    return list(value)


_TOKEN_ID = re.compile(r"[0-9]+")


def _logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise _Problem(f"must be an object mapping token ids to bias values, got {_got(value)}")
    if len(value) > MAX_LOGIT_BIAS:
        raise _Problem(f"may hold at most {MAX_LOGIT_BIAS} token ids, got {len(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        sub = f"[{_key_text(key)}]"
        if not _TOKEN_ID.fullmatch(key) or len(key.lstrip("0")) > 10 or int(key) > MAX_TOKEN_ID:
            raise _Problem(f"token id must be a non-negative integer (at most {MAX_TOKEN_ID}), got {_got(key)}", sub)
        token = int(key)
        if token in out:
            raise _Problem(f"token id {token} appears twice", sub)
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise _Problem(f"bias must be finite and in [-100, 100], got {_got(bias)}", sub)
        out[token] = float(bias)
    return out


def _lora_weights(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _Problem(f"must be an object mapping adapter names to file paths, got {_got(value)}")
    for name, path in value.items():
        if not name:
            raise _Problem("adapter names must be non-empty", '[""]')
        if not isinstance(path, str) or not path:
            raise _Problem(f"must be a non-empty path string, got {_got(path)}", f"[{_key_text(name)}]")
    return dict(value)


def _nonempty_list(what: str) -> Any:
    def check(value: Any) -> list:
        if not isinstance(value, list):
            raise _Problem(f"must be an array of {what}s, got {_got(value)}")
        if not value:
            raise _Problem(f"must hold at least one {what}")
        return value

    return check


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextItem(_Model):
    type: Literal["text"]
    text: Annotated[str, _rule(_string)]


class ImageItem(_Model):
    type: Literal["image"]
    image: Annotated[str, _rule(_path_string)]
    do_resize: Annotated[bool, _rule(_flag)] = True


class AudioItem(_Model):
    type: Literal["audio"]
    audio: Annotated[str, _rule(_path_string)]


class VideoItem(_Model):
    """Seed 001's placeholder (seed 000: "does not accept video content"); refused per request."""

    type: Literal["video"]
    video: Annotated[str, _rule(_path_string)]
    do_resize: Annotated[bool, _rule(_flag)] = True


ContentItem = TextItem | ImageItem | AudioItem | VideoItem
_ITEM_MODELS: dict[str, type[_Model]] = {"text": TextItem, "image": ImageItem, "audio": AudioItem, "video": VideoItem}


def _content(value: Any) -> str | list[ContentItem]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _Problem(f"must be a string or an array of content items, got {_got(value)}")
    if not value:
        raise _Problem("must hold at least one content item")
    items = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _Problem(f'must be a content object ({{"type": ..., ...}}), got {_got(item)}', f"[{i}]")
        kind = item.get("type")
        if kind is None:
            raise _Problem("required field is missing", f"[{i}].type")
        if not isinstance(kind, str) or kind not in _ITEM_MODELS:
            raise _Problem(f"must be one of {_quoted(list(_ITEM_MODELS))}, got {_got(kind)}", f"[{i}].type")
        try:
            items.append(_ITEM_MODELS[kind].model_validate(item))
        except ValidationError as exc:
            sub, message = _first_problem(exc, nested=True)
            raise _Problem(message, f"[{i}]{sub}") from None
    return items


class Message(_Model):
    role: Annotated[str, _rule(_choice(("system", "user", "assistant")))]
    content: Annotated[str | list[ContentItem], _rule(_content)]


class GuidedDecoding(_Model):
    """Exactly one mode; each also accepts its value as an escaped JSON string."""

    json_object: Any = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    choice: Any = None
    _spec: GuideSpec = PrivateAttr()

    @model_validator(mode="after")
    def _one_mode(self) -> GuidedDecoding:
        modes = [m for m in GUIDE_MODES if getattr(self, m) is not None and getattr(self, m) is not False]
        if len(modes) != 1:
            got = "none is set" if not modes else f"got {', '.join(modes)}"
            raise PydanticCustomError(
                "infer", "{message}", {"message": f"set exactly one of {', '.join(GUIDE_MODES)}; {got}", "sub": ""}
            )
        try:
            self._spec = _guide_spec(GuideKind(modes[0]), getattr(self, modes[0]))
        except _Problem as p:
            raise PydanticCustomError("infer", "{message}", {"message": p.message, "sub": p.sub}) from None
        return self

    @property
    def spec(self) -> GuideSpec:
        return self._spec


# Where a guide's value sits in the file: top level 0, requests 1, a request 2, guided_decoding 3.
_GUIDE_DEPTH = 4


def _escaped(kind: GuideKind, text: str) -> Any:
    """The value an escaped JSON string stands for, checked as the file is (surrogates, depth, ...)."""
    sub = f".{kind.value}"
    try:
        value = _loads(text)
    except _JsonProblem as p:
        raise _Problem(f"escaped JSON string {p.problem}", sub) from None
    try:
        _check_tree(value, depth=_GUIDE_DEPTH)
    except _JsonProblem as p:
        where = f" at {_path(p.parts, relative=True)}" if p.parts else ""
        raise _Problem(f"escaped JSON string{where}: {p.problem}", sub) from None
    return value


def _guide_spec(kind: GuideKind, value: Any) -> GuideSpec:
    """The GuideSpec of one mode's value; only its JSON type is checked here (a wrong type is a file
    error), its content is llguidance's to judge (grammar_for, per request)."""
    sub = f".{kind.value}"
    if kind in (GuideKind.REGEX, GuideKind.EBNF):
        if not isinstance(value, str):
            raise _Problem(
                f"must be a string (the {'pattern' if kind is GuideKind.REGEX else 'grammar'}), got {_got(value)}", sub
            )
        if len(value) >= 2 and value[0] == value[-1] == '"':
            try:
                decoded = json.loads(value)
            except (json.JSONDecodeError, RecursionError):
                decoded = None
            if isinstance(decoded, str):
                if has_surrogate(decoded):
                    raise _Problem("escaped JSON string holds a lone surrogate (invalid UTF-16 escape)", sub)
                value = decoded
        return GuideSpec(kind, value)
    if isinstance(value, str):
        value = _escaped(kind, value)
    if kind is GuideKind.JSON_OBJECT:
        if value is not True and value != {}:
            raise _Problem(
                f"must be true or {{}} (any JSON object; use json_schema for a schema), got {_got(value)}", sub
            )
        return GuideSpec(kind)
    if kind is GuideKind.CHOICE:
        if not isinstance(value, list):
            raise _Problem(f"must be an array of strings or an escaped JSON string of one, got {_got(value)}", sub)
        return GuideSpec(kind, value)
    if not isinstance(value, dict):
        what = "a JSON schema object" if kind is GuideKind.JSON_SCHEMA else "an object with triggers and structures"
        raise _Problem(f"must be {what} or an escaped JSON string of one, got {_got(value)}", sub)
    if kind is GuideKind.STRUCTURAL_TAG:
        value = _structural_tag(value)
    return GuideSpec(kind, value)


def _structural_tag(value: dict) -> dict:
    """{"triggers", "structures"}, with vLLM's {"type": "structural_tag", ...} wrapper taken off. The
    content (triggers, each begin starting with one) is grammar_for's to check, per request."""
    if "type" in value and value["type"] != "structural_tag":
        raise _Problem(f'"type" must be "structural_tag" when given, got {_got(value["type"])}', ".structural_tag")
    unknown = [k for k in value if k not in ("type", "triggers", "structures")]
    if unknown:
        raise _Problem(f"unknown key {_key_text(unknown[0])} (expected triggers and structures)", ".structural_tag")
    structures = value.get("structures")
    for i, st in enumerate(structures if isinstance(structures, list) else []):
        extra = [k for k in st if k not in ("begin", "schema", "end")] if isinstance(st, dict) else []
        if extra:
            where = f".structural_tag.structures[{i}]"
            raise _Problem(f"unknown key {_key_text(extra[0])} (expected begin, schema and end)", where)
    return {k: value[k] for k in ("triggers", "structures") if k in value}


class Request(_Model):
    messages: Annotated[list[Message], _rule(_nonempty_list("message"))]
    lora_name: Annotated[str, _rule(_string)] | None = None
    # Seed 001's "cache system prompt KV": accepted, no effect of its own; the prefix cache already
    # reuses a system prompt shared by later requests (seed 000 calls the field legacy too).
    save_system_prompt_kv_cache: Annotated[bool, _rule(_flag)] | None = None
    disable_spec_decode: Annotated[bool, _rule(_flag)] | None = None
    logit_bias: Annotated[dict[int, float], _rule(_logit_bias)] | None = None
    num_logprobs: Annotated[int, _rule(_check_num_logprobs)] | None = None
    guided_decoding: GuidedDecoding | None = None
    stop: Annotated[list[str], _rule(_stop)] | None = None
    sampling_seed: Annotated[int, _rule(_check_seed)] | None = None


class InputFile(_Model):
    """The top level. A null value means "not given" (the default), for every optional field."""

    batch_size: Annotated[int, _rule(_check_batch_size)] | None = None
    temperature: Annotated[float, _rule(_number("a finite number >= 0", lambda t: t >= 0))] | None = None
    top_p: Annotated[float, _rule(_number("a number in (0, 1]", lambda p: 0 < p <= 1))] | None = None
    top_k: Annotated[int, _rule(_integer(f"an integer in [0, {MAX_TOP_K}]", 0, MAX_TOP_K))] | None = None
    sampling_seed: Annotated[int, _rule(_check_seed)] | None = None
    spec_proposal_sampling: Annotated[str, _rule(_choice(("auto", "greedy", "probabilistic")))] | None = None
    logit_bias: Annotated[dict[int, float], _rule(_logit_bias)] | None = None
    max_generate_length: Annotated[int, _rule(_check_max_length)] | None = None
    num_logprobs: Annotated[int, _rule(_check_num_logprobs)] | None = None
    apply_chat_template: Annotated[bool, _rule(_flag)] | None = None
    add_generation_prompt: Annotated[bool, _rule(_flag)] | None = None
    enable_thinking: Annotated[bool, _rule(_flag)] | None = None
    context_cache_lookup_policy: Annotated[str, _rule(_choice(("use_cache", "bypass")))] | None = None
    context_cache_commit_policy: (
        Annotated[str, _rule(_choice(("including_generated_tokens", "prefill_state_only")))] | None
    ) = None
    available_lora_weights: Annotated[dict[str, str], _rule(_lora_weights)] | None = None
    guided_decoding: GuidedDecoding | None = None
    requests: Annotated[list[Request], _rule(_nonempty_list("request"))]


_REQUEST_FIELDS = tuple(Request.model_fields)
_TOP_FIELDS = tuple(InputFile.model_fields)


def _first_problem(exc: ValidationError, *, nested: bool = False) -> tuple[str, str]:
    """(path, message) of the error to report: the first, except that a missing field next to an
    unknown one with a close name is that field misspelt, so the unknown one is reported. nested=True:
    the model was validated inside a rule, and the path continues the rule's (`.image`)."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    if err["type"] == "missing":
        parent, name = err["loc"][:-1], str(err["loc"][-1])
        err = next(
            (
                e
                for e in errors
                if e["type"] == "extra_forbidden"
                and e["loc"][:-1] == parent
                and difflib.SequenceMatcher(None, str(e["loc"][-1]), name).ratio() >= 0.75
            ),
            err,
        )
    loc, kind, value = err["loc"], err["type"], err.get("input")
    sub = ""
    if kind == "infer":
        message, sub = err["ctx"]["message"], err["ctx"]["sub"]
    elif kind == "extra_forbidden":
        message = UNKNOWN_FIELD + ("" if nested else _field_hint(loc))
    elif kind == "missing":
        message = "required field is missing"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        message = f"must be an object, got {_got(value)}"
    elif kind == "list_type":
        message = f"must be an array, got {_got(value)}"
    elif kind == "literal_error":
        message = f"must be {err['ctx']['expected']}, got {_got(value)}"
    else:  # not reached by the rules above; kept readable all the same
        message = f"invalid value {_got(value)}"
    where = _path(loc, relative=nested)
    if sub:
        where = where + sub if where else sub.lstrip(".")
    return where, message


def _field_hint(loc: tuple) -> str:
    name = loc[-1]
    if not isinstance(name, str):
        return ""
    in_request = len(loc) == 3 and loc[0] == "requests"
    if in_request and name in _TOP_FIELDS:
        return f'; "{name}" is a top-level field'
    if len(loc) == 1 and name in _REQUEST_FIELDS:
        return f'; "{name}" is a field of each request'
    known = _REQUEST_FIELDS if in_request else _TOP_FIELDS if len(loc) == 1 else ()
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    return f'; did you mean "{close[0]}"?' if close else ""


# -- pass 3: cross-field rules and the job ---------------------------------------------------------------


def load_job(
    path: Path,
    *,
    batch_size: int | None = None,
    max_generate_length: int | None = None,
    num_logprobs: int | None = None,
) -> InferJob:
    """Reads and parses an input file; command-line values replace the file's top-level ones."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise InferInputError(f"cannot read the input file {str(path)!r}: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        limit = f"{MAX_FILE_BYTES >> 20} MiB" if MAX_FILE_BYTES % (1 << 20) == 0 else f"{MAX_FILE_BYTES} bytes"
        raise InferInputError(f"the input file is larger than {limit}")
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise InferInputError(f"the input file is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    try:
        data = _loads(text)
    except _JsonProblem as p:
        raise InferInputError(f"the input file {p.problem}") from None
    return parse_job(
        data, str(path), batch_size=batch_size, max_generate_length=max_generate_length, num_logprobs=num_logprobs
    )


def parse_job(
    data: Any,
    input_file: str,
    *,
    batch_size: int | None = None,
    max_generate_length: int | None = None,
    num_logprobs: int | None = None,
) -> InferJob:
    """The parsed input JSON (any Python value) -> InferJob, or InferInputError."""
    if not isinstance(data, dict):
        raise InferInputError(f'the input must be a JSON object with a "requests" array, got {_got(data)}')
    try:
        _check_tree(data)
    except _JsonProblem as p:
        where = _path(p.parts)
        raise InferInputError(f"{where}: {p.problem}", path=where) from None
    try:
        model = InputFile.model_validate(data)
    except ValidationError as exc:
        where, message = _first_problem(exc)
        raise InferInputError(f"{where}: {message}" if where else message, path=where or None) from None
    top = _top_values(model)
    for name, value, check in (
        ("batch_size", batch_size, _check_batch_size),
        ("max_generate_length", max_generate_length, _check_max_length),
        ("num_logprobs", num_logprobs, _check_num_logprobs),
    ):
        if value is not None:
            try:
                top[name] = check(value)
            except _Problem as p:
                raise InferInputError(f"{name} (command line): {p.message}", path=name) from None
    weights: dict[str, str] = top["available_lora_weights"]
    guide_errors: dict[Any, str | None] = {}
    items = [_item(i, req, data["requests"][i]["messages"], top, guide_errors) for i, req in enumerate(model.requests)]
    batches = _batches(items, top["batch_size"], weights)
    return InferJob(input_file, top["batch_size"], items, batches, dict(weights), _profile_top(top))


def _top_values(model: InputFile) -> dict[str, Any]:
    top = {
        name: default if getattr(model, name) is None else getattr(model, name) for name, default in DEFAULTS.items()
    }
    top["guided_decoding"] = model.guided_decoding.spec if model.guided_decoding is not None else None
    return top


def _profile_top(top: dict[str, Any]) -> dict[str, Any]:
    """JSON-friendly: logit_bias keys as strings, the guide as {mode: spec}."""
    out = dict(top)
    out["logit_bias"] = {str(k): v for k, v in top["logit_bias"].items()}
    guide: GuideSpec | None = top["guided_decoding"]
    out["guided_decoding"] = {guide.kind.value: True if guide.spec is None else guide.spec} if guide else None
    return out


def _item(
    idx: int, req: Request, raw_messages: list, top: dict[str, Any], guide_errors: dict[Any, str | None]
) -> InferItem:
    error = None
    messages = []
    for m, msg in enumerate(req.messages):
        if isinstance(msg.content, str):
            messages.append({"role": msg.role, "content": msg.content})
            continue
        for c, item in enumerate(msg.content):
            if item.type == "video" and error is None:
                error = f"requests[{idx}].messages[{m}].content[{c}]: {VIDEO_ERROR}"
        if any(item.type in ("image", "audio") for item in msg.content):
            # Media parts in the node's stored form (media/parts.py): the runner loads the files, relative
            # to the input file, and the engine's projector takes them (or the request fails alone).
            try:
                parts, _, _ = parse_content(
                    f"requests[{idx}].messages[{m}]", [i.model_dump() for i in msg.content], msg.role
                )
            except InvalidRequest as exc:  # e.g. an image in a system message: this request's problem
                error = error or exc.message
                parts = []
            messages.append({"role": msg.role, "content": parts})
            continue
        # Text items only: joined with "\n", as vLLM does for a text-only model given a content array.
        text = "\n".join(item.text for item in msg.content if isinstance(item, TextItem))
        messages.append({"role": msg.role, "content": text})
    if req.guided_decoding is not None:  # a request's guide replaces the top-level one
        guide, where = req.guided_decoding.spec, f"requests[{idx}].guided_decoding"
    else:
        guide, where = top["guided_decoding"], "guided_decoding"
    if guide is not None:
        problem = _guide_problem(guide, guide_errors)
        if problem is not None:
            error = error or f"{where}: {problem}"
            guide = None
    seed = req.sampling_seed if req.sampling_seed is not None else top["sampling_seed"]
    drawn = seed is None
    if seed is None:
        seed = secrets.randbits(64)
    lookup = top["context_cache_lookup_policy"] == "use_cache"
    if not lookup:
        commit = CacheCommit.NONE  # "bypass" skips lookup and publication
    elif top["context_cache_commit_policy"] == "prefill_state_only":
        commit = CacheCommit.PROMPT
    else:
        commit = CacheCommit.ALL
    sampling = SamplingParams(
        temperature=top["temperature"],
        top_p=top["top_p"],
        top_k=top["top_k"],
        min_p=0.0,
        repeat_penalty=1.0,
        seed=seed,
        max_tokens=top["max_generate_length"],
        stop=list(req.stop or []),
        # A request's map replaces the top-level one entirely (it is not merged).
        logit_bias=dict(req.logit_bias if req.logit_bias is not None else top["logit_bias"]),
        num_logprobs=req.num_logprobs if req.num_logprobs is not None else top["num_logprobs"],
    )
    request = EngineRequest(
        request_id=f"infer-{idx}",
        messages=messages,
        sampling=sampling,
        guide=guide,
        apply_chat_template=top["apply_chat_template"],
        add_generation_prompt=top["add_generation_prompt"],
        template_kwargs={"enable_thinking": top["enable_thinking"]},
        cache_lookup=lookup,
        cache_commit=commit,
        # The path as written; the runner resolves it (a relative one against the input file's folder)
        # and converts a PEFT safetensors adapter to GGUF before the batch runs.
        lora_path=top["available_lora_weights"].get(req.lora_name) if req.lora_name is not None else None,
    )
    return InferItem(idx, 0, raw_messages, request, req.lora_name, error, seed, drawn, bool(req.disable_spec_decode))


def _guide_problem(guide: GuideSpec, cache: dict[Any, str | None]) -> str | None:
    """What grammar_for says about a guide (None: fine); each distinct guide is compiled once, and the
    top-level guide (one object, shared by every request) is not even serialised again."""
    from edgellm.engine.guide_llguidance import grammar_for  # llguidance: only when a file has guides

    if id(guide) in cache:
        return cache[id(guide)]
    key = f"{guide.kind.value}:{json.dumps(guide.spec, sort_keys=True)}"
    if key not in cache:
        try:
            grammar_for(guide)
            cache[key] = None
        except GuideError as exc:
            cache[key] = exc.message
    cache[id(guide)] = cache[key]  # the GuideSpecs live as long as the job's models: ids stay theirs
    return cache[key]


def undeclared_lora_error(name: str, weights: dict[str, str]) -> str:
    declared = f"declared: {_quoted(sorted(weights))}" if weights else "none are declared"
    return f"lora_name {_got(name)} is not in available_lora_weights ({declared})"


def _batches(items: list[InferItem], batch_size: int, weights: dict[str, str]) -> list[InferBatch]:
    """Consecutive chunks in input order. A batch is uniform in K (the largest asked for) and in
    disable_spec_decode (any request sets it); one mixing adapters fails whole, as in llm_inference
    (no adapter counts as a value of its own), and so does one naming an adapter the file does not
    declare (the seeds' own "Basic Structure" example does: its batch fails, the file runs on)."""
    batches = []
    for b, start in enumerate(range(0, len(items), batch_size)):
        chunk = items[start : start + batch_size]
        names = {item.lora_name for item in chunk}
        error = MIXED_LORA_ERROR if len(names) > 1 else None
        name = chunk[0].lora_name
        if error is None and name is not None and name not in weights:
            error = undeclared_lora_error(name, weights)
        k = max(item.request.sampling.num_logprobs for item in chunk)
        for item in chunk:
            item.batch_idx = b
            item.request.sampling.num_logprobs = k
            if error:
                item.error = error  # the batch's refusal comes first: none of its requests runs
        batches.append(
            InferBatch(
                batch_idx=b,
                item_indices=[item.request_idx for item in chunk],
                lora_name=chunk[0].lora_name if error is None else None,
                num_logprobs=k,
                disable_spec_decode=any(item.disable_spec_decode for item in chunk),
                error=error,
            )
        )
    return batches

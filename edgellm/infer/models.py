"""The pydantic models of the TensorRT-Edge-LLM input file (every model forbids unknown fields), the
checks of its fields, and the first validation error rendered as `path: message`."""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from edgellm import jsonsafe
from edgellm.api.fields import MAX_LOGIT_BIAS, MAX_SEED, MAX_STOP_STRINGS
from edgellm.api.validation import MAX_TOKEN_ID
from edgellm.engine.types import GuideKind, GuideSpec
from edgellm.infer.rules import (
    Problem,
    choice,
    flag,
    got,
    integer,
    nonempty_list,
    number,
    path_string,
    quoted,
    rule,
    string,
)
from edgellm.jsonsafe import has_surrogate, json_path, key_text

MAX_GENERATE_LENGTH = 32768
MAX_NUM_LOGPROBS = 50
MAX_BIAS = 100.0
MAX_TOP_K = MAX_TOKEN_ID
LANES = ("realtime", "interactive", "batch")  # engine/types.Priority, edgellm's addition to the format
GUIDE_MODES = ("json_object", "json_schema", "regex", "ebnf", "structural_tag", "choice")  # the seed's order
UNKNOWN_FIELD = "unknown field (not in the TensorRT-Edge-LLM input format)"

check_batch_size = integer("an integer >= 1", 1)
check_max_length = integer(f"an integer in [1, {MAX_GENERATE_LENGTH}]", 1, MAX_GENERATE_LENGTH)
check_num_logprobs = integer(f"an integer in [0, {MAX_NUM_LOGPROBS}]", 0, MAX_NUM_LOGPROBS)
_check_seed = integer("an unsigned 64-bit integer in [0, 2^64-1]", 0, MAX_SEED)


def _stop(value: Any) -> list[str]:
    if isinstance(value, str):
        if not value:
            raise Problem('must be a non-empty string or an array of non-empty strings, got ""')
        return [value]
    if not isinstance(value, list):
        raise Problem(f"must be a string or an array of strings, got {got(value)}")
    if len(value) > MAX_STOP_STRINGS:
        raise Problem(f"may hold at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise Problem(f"must be a non-empty string, got {got(s)}", f"[{i}]")
    return list(value)


_TOKEN_ID = re.compile(r"[0-9]+")


def _logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise Problem(f"must be an object mapping token ids to bias values, got {got(value)}")
    if len(value) > MAX_LOGIT_BIAS:
        raise Problem(f"may hold at most {MAX_LOGIT_BIAS} token ids, got {len(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        sub = f"[{key_text(key)}]"
        if not _TOKEN_ID.fullmatch(key) or len(key.lstrip("0")) > 10 or int(key) > MAX_TOKEN_ID:
            raise Problem(f"token id must be a non-negative integer (at most {MAX_TOKEN_ID}), got {got(key)}", sub)
        token = int(key)
        if token in out:
            raise Problem(f"token id {token} appears twice", sub)
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise Problem(f"bias must be finite and in [-100, 100], got {got(bias)}", sub)
        out[token] = float(bias)
    return out


def _lora_weights(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise Problem(f"must be an object mapping adapter names to file paths, got {got(value)}")
    for name, path in value.items():
        if not name:
            raise Problem("adapter names must be non-empty", '[""]')
        if not isinstance(path, str) or not path:
            raise Problem(f"must be a non-empty path string, got {got(path)}", f"[{key_text(name)}]")
    return dict(value)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextItem(_Model):
    type: Literal["text"]
    text: Annotated[str, rule(string)]


class ImageItem(_Model):
    type: Literal["image"]
    image: Annotated[str, rule(path_string)]
    do_resize: Annotated[bool, rule(flag)] = True


class AudioItem(_Model):
    type: Literal["audio"]
    audio: Annotated[str, rule(path_string)]


class VideoItem(_Model):
    """Seed 001's placeholder (seed 000: "does not accept video content"); refused per request."""

    type: Literal["video"]
    video: Annotated[str, rule(path_string)]
    do_resize: Annotated[bool, rule(flag)] = True


ContentItem = TextItem | ImageItem | AudioItem | VideoItem
_ITEM_MODELS: dict[str, type[_Model]] = {"text": TextItem, "image": ImageItem, "audio": AudioItem, "video": VideoItem}


def _content(value: Any) -> str | list[ContentItem]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise Problem(f"must be a string or an array of content items, got {got(value)}")
    if not value:
        raise Problem("must hold at least one content item")
    items = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise Problem(f'must be a content object ({{"type": ..., ...}}), got {got(item)}', f"[{i}]")
        kind = item.get("type")
        if kind is None:
            raise Problem("required field is missing", f"[{i}].type")
        if not isinstance(kind, str) or kind not in _ITEM_MODELS:
            raise Problem(f"must be one of {quoted(list(_ITEM_MODELS))}, got {got(kind)}", f"[{i}].type")
        try:
            items.append(_ITEM_MODELS[kind].model_validate(item))
        except ValidationError as exc:
            sub, message = first_problem(exc, nested=True)
            raise Problem(message, f"[{i}]{sub}") from None
    return items


class Message(_Model):
    role: Annotated[str, rule(choice(("system", "user", "assistant")))]
    content: Annotated[str | list[ContentItem], rule(_content)]


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
        except Problem as p:
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
        return jsonsafe.loads(text, depth=_GUIDE_DEPTH)
    except jsonsafe.JSONProblem as p:
        if not p.parts:  # the text as a whole (not JSON, nested too deeply for the parser)
            raise Problem(f"escaped JSON string {p.problem}", sub) from None
        raise Problem(f"escaped JSON string at {json_path(p.parts, relative=True)}: {p.problem}", sub) from None


def _guide_spec(kind: GuideKind, value: Any) -> GuideSpec:
    """The GuideSpec of one mode's value; only its JSON type is checked here (a wrong type is a file
    error), its content is llguidance's to judge (grammar_for, per request)."""
    sub = f".{kind.value}"
    if kind in (GuideKind.REGEX, GuideKind.EBNF):
        if not isinstance(value, str):
            raise Problem(
                f"must be a string (the {'pattern' if kind is GuideKind.REGEX else 'grammar'}), got {got(value)}", sub
            )
        if len(value) >= 2 and value[0] == value[-1] == '"':
            try:  # kept: the surrogate is refused below with this field's own message
                decoded = jsonsafe.loads(value, lone_surrogates="keep")
            except jsonsafe.JSONProblem:
                decoded = None
            if isinstance(decoded, str):
                if has_surrogate(decoded):
                    raise Problem("escaped JSON string holds a lone surrogate (invalid UTF-16 escape)", sub)
                value = decoded
        return GuideSpec(kind, value)
    if isinstance(value, str):
        value = _escaped(kind, value)
    if kind is GuideKind.JSON_OBJECT:
        if value is not True and value != {}:
            raise Problem(
                f"must be true or {{}} (any JSON object; use json_schema for a schema), got {got(value)}", sub
            )
        return GuideSpec(kind)
    if kind is GuideKind.CHOICE:
        if not isinstance(value, list):
            raise Problem(f"must be an array of strings or an escaped JSON string of one, got {got(value)}", sub)
        return GuideSpec(kind, value)
    if not isinstance(value, dict):
        what = "a JSON schema object" if kind is GuideKind.JSON_SCHEMA else "an object with triggers and structures"
        raise Problem(f"must be {what} or an escaped JSON string of one, got {got(value)}", sub)
    if kind is GuideKind.STRUCTURAL_TAG:
        value = _structural_tag(value)
    return GuideSpec(kind, value)


def _structural_tag(value: dict) -> dict:
    """{"triggers", "structures"}, with vLLM's {"type": "structural_tag", ...} wrapper taken off. The
    content (triggers, each begin starting with one) is grammar_for's to check, per request."""
    if "type" in value and value["type"] != "structural_tag":
        raise Problem(f'"type" must be "structural_tag" when given, got {got(value["type"])}', ".structural_tag")
    unknown = [k for k in value if k not in ("type", "triggers", "structures")]
    if unknown:
        raise Problem(f"unknown key {key_text(unknown[0])} (expected triggers and structures)", ".structural_tag")
    structures = value.get("structures")
    for i, st in enumerate(structures if isinstance(structures, list) else []):
        extra = [k for k in st if k not in ("begin", "schema", "end")] if isinstance(st, dict) else []
        if extra:
            where = f".structural_tag.structures[{i}]"
            raise Problem(f"unknown key {key_text(extra[0])} (expected begin, schema and end)", where)
    return {k: value[k] for k in ("triggers", "structures") if k in value}


class Request(_Model):
    messages: Annotated[list[Message], rule(nonempty_list("message"))]
    lora_name: Annotated[str, rule(string)] | None = None
    # Seed 001's "cache system prompt KV": accepted, no effect of its own; the prefix cache already
    # reuses a system prompt shared by later requests (seed 000 calls the field legacy too).
    save_system_prompt_kv_cache: Annotated[bool, rule(flag)] | None = None
    disable_spec_decode: Annotated[bool, rule(flag)] | None = None
    logit_bias: Annotated[dict[int, float], rule(_logit_bias)] | None = None
    num_logprobs: Annotated[int, rule(check_num_logprobs)] | None = None
    guided_decoding: GuidedDecoding | None = None
    stop: Annotated[list[str], rule(_stop)] | None = None
    sampling_seed: Annotated[int, rule(_check_seed)] | None = None
    priority: Annotated[str, rule(choice(LANES))] | None = None  # edgellm's: which items the engine serves first


class InputFile(_Model):
    """The top level. A null value means "not given" (the default), for every optional field."""

    batch_size: Annotated[int, rule(check_batch_size)] | None = None
    temperature: Annotated[float, rule(number("a finite number >= 0", lambda t: t >= 0))] | None = None
    top_p: Annotated[float, rule(number("a number in (0, 1]", lambda p: 0 < p <= 1))] | None = None
    top_k: Annotated[int, rule(integer(f"an integer in [0, {MAX_TOP_K}]", 0, MAX_TOP_K))] | None = None
    sampling_seed: Annotated[int, rule(_check_seed)] | None = None
    spec_proposal_sampling: Annotated[str, rule(choice(("auto", "greedy", "probabilistic")))] | None = None
    logit_bias: Annotated[dict[int, float], rule(_logit_bias)] | None = None
    max_generate_length: Annotated[int, rule(check_max_length)] | None = None
    num_logprobs: Annotated[int, rule(check_num_logprobs)] | None = None
    apply_chat_template: Annotated[bool, rule(flag)] | None = None
    add_generation_prompt: Annotated[bool, rule(flag)] | None = None
    enable_thinking: Annotated[bool, rule(flag)] | None = None
    context_cache_lookup_policy: Annotated[str, rule(choice(("use_cache", "bypass")))] | None = None
    context_cache_commit_policy: (
        Annotated[str, rule(choice(("including_generated_tokens", "prefill_state_only")))] | None
    ) = None
    available_lora_weights: Annotated[dict[str, str], rule(_lora_weights)] | None = None
    guided_decoding: GuidedDecoding | None = None
    priority: Annotated[str, rule(choice(LANES))] | None = None  # every request's, unless it sets its own
    requests: Annotated[list[Request], rule(nonempty_list("request"))]


_REQUEST_FIELDS = tuple(Request.model_fields)
_TOP_FIELDS = tuple(InputFile.model_fields)


def first_problem(exc: ValidationError, *, nested: bool = False) -> tuple[str, str]:
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
        message = f"must be an object, got {got(value)}"
    elif kind == "list_type":
        message = f"must be an array, got {got(value)}"
    elif kind == "literal_error":
        message = f"must be {err['ctx']['expected']}, got {got(value)}"
    else:  # not reached by the rules above; kept readable all the same
        message = f"invalid value {got(value)}"
    where = json_path(loc, relative=nested)
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

"""The TensorRT-Edge-LLM `llm_inference` input JSON (seeds 000 and 001), read into engine requests.

`load_job(path)` / `parse_job(data, input_file)` turn an input file into an `InferJob`: one
`InferItem` (an `EngineRequest` plus what the output echoes) per request and one `InferBatch` per
consecutive `batch_size` requests. Nothing here loads a model.

Two kinds of problem, as `llm_inference` has them:
- the file is wrong (not JSON, an unknown field, a value out of range): `InferInputError`, one message
  naming the JSON path of the field (`requests[2].logit_bias["12"]: ...`); nothing runs;
- one request cannot run here (image/audio/video content, a guide llguidance rejects, a batch mixing
  LoRA adapters): its item carries `error` and the rest of the file runs.

Checks run in three passes: the node's one strict JSON reader (edgellm/jsonsafe.py: duplicate keys,
NaN, over-long numbers, lone surrogates, depth: what Python's json would accept or crash on), the
pydantic models (infer/models.py: shape, types, ranges; every model forbids unknown fields; their check
kit is infer/rules.py), then the cross-field rules here (lora_name, batches, guides) and the job.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from edgellm import jsonsafe
from edgellm.engine.types import CacheCommit, EngineRequest, GuideSpec, Priority, SamplingParams
from edgellm.errors import GuideError, InferInputError, InvalidRequest
from edgellm.infer.models import (
    InputFile,
    Request,
    TextItem,
    check_batch_size,
    check_max_length,
    check_num_logprobs,
    first_problem,
)
from edgellm.infer.rules import Problem, got, quoted
from edgellm.media.parts import parse_content

MAX_FILE_BYTES = 64 * 1024 * 1024
MIXED_LORA_ERROR = "Different LoRA weights within the same batch are not supported"
VIDEO_ERROR = "video content is not supported by edgellm infer"

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
        data = jsonsafe.loads(raw)
    except jsonsafe.JSONProblem as p:
        raise InferInputError(p.describe("the input file"), path=p.where or None) from None
    return _job(data, str(path), (batch_size, max_generate_length, num_logprobs))


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
        raise InferInputError(f'the input must be a JSON object with a "requests" array, got {got(data)}')
    try:  # the reader's rules, for values that did not come from a file
        jsonsafe.check_value(data)
    except jsonsafe.JSONProblem as p:
        raise InferInputError(p.describe("the input"), path=p.where) from None
    return _job(data, input_file, (batch_size, max_generate_length, num_logprobs))


def _job(data: Any, input_file: str, overrides: tuple[int | None, int | None, int | None]) -> InferJob:
    """Checked JSON values -> InferJob; `overrides`: the command line's batch size, length and K."""
    if not isinstance(data, dict):
        raise InferInputError(f'the input must be a JSON object with a "requests" array, got {got(data)}')
    batch_size, max_generate_length, num_logprobs = overrides
    try:
        model = InputFile.model_validate(data)
    except ValidationError as exc:
        where, message = first_problem(exc)
        raise InferInputError(f"{where}: {message}" if where else message, path=where or None) from None
    top = _top_values(model)
    for name, value, check in (
        ("batch_size", batch_size, check_batch_size),
        ("max_generate_length", max_generate_length, check_max_length),
        ("num_logprobs", num_logprobs, check_num_logprobs),
    ):
        if value is not None:
            try:
                top[name] = check(value)
            except Problem as p:
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
    if model.priority is not None:
        top["priority"] = model.priority
    return top


def _profile_top(top: dict[str, Any]) -> dict[str, Any]:
    """JSON-friendly: logit_bias keys as strings, the guide as {mode: spec}."""
    out = {k: v for k, v in top.items() if k != "priority"}  # the seed's profile fields only
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
        # edgellm's addition (not in the profile): the engine admits waiting items by lane, then order.
        priority=Priority(req.priority or top.get("priority") or Priority.INTERACTIVE),
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
    declared = f"declared: {quoted(sorted(weights))}" if weights else "none are declared"
    return f"lora_name {got(name)} is not in available_lora_weights ({declared})"


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

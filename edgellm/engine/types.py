"""What crosses the engine boundary (and the process boundary): plain, picklable dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgellm.compat import StrEnum
from edgellm.errors import ErrorType
from edgellm.media.types import MediaInput


class FinishReason(StrEnum):
    STOP = "stop"  # end-of-generation token, stop string, or the grammar completed
    LENGTH = "length"  # max_tokens or the slot's context is full
    ERROR = "error"  # guide dead end or a llama.cpp failure; partial text is kept
    TIMEOUT = "timeout"  # the request's timeout passed: it fails
    DEADLINE = "deadline"  # its deadline_ms passed: it ends with the text it has (EngineRequest.answer_by)
    ABORT = "abort"  # cancelled by the caller (client gone)


class GuideKind(StrEnum):
    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    EBNF = "ebnf"
    CHOICE = "choice"
    # {"triggers": [str], "structures": [{"begin": str, "schema": dict, "end": str}]}: free text until a
    # trigger, then the structure whose begin starts with it, constrained by its schema, then its end.
    STRUCTURAL_TAG = "structural_tag"


class EngineTask(StrEnum):
    """What a request asks of the engine. Only GENERATE takes a slot; the others are answered from the
    prepare pool (TOKENIZE, DETOKENIZE, RENDER: the model's tokenizer and chat template) or batched
    between generation steps on the embedding context (EMBED). Their answer is EngineOutput.result."""

    GENERATE = "generate"
    EMBED = "embed"  # payload {"inputs": [str | list[int]], "normalize": bool}
    TOKENIZE = "tokenize"  # payload {"content": str, "add_special": bool, "parse_special": bool, "with_pieces": bool}
    DETOKENIZE = "detokenize"  # payload {"tokens": [int]}
    RENDER = "render"  # messages/tools/template_kwargs as for GENERATE; payload {"count_only": bool}


class StopCause(StrEnum):
    """What ended a FinishReason.STOP request (the TensorRT-Edge-LLM format tells them apart)."""

    EOS = "eos"  # an end-of-generation token
    STOP_STRING = "stop_string"
    GUIDE = "guide"  # the grammar completed


class Priority(StrEnum):
    """Which requests the engine serves first (admission, resumption) and pauses last (preemption)."""

    REALTIME = "realtime"  # a control loop: preempts a running batch, then interactive, request at once
    INTERACTIVE = "interactive"  # the default: someone is waiting for it
    BATCH = "batch"  # synth, batch-run: whatever the others leave

    @property
    def rank(self) -> int:
        """0 first: realtime, interactive, batch."""
        return _PRIORITY_RANK[self]


_PRIORITY_RANK = {Priority.REALTIME: 0, Priority.INTERACTIVE: 1, Priority.BATCH: 2}


class CacheCommit(StrEnum):
    """What a finished request leaves in its slot for later requests' prefix reuse."""

    ALL = "including_generated_tokens"  # prompt + generated tokens
    PROMPT = "prefill_state_only"  # the prompt only
    NONE = "none"  # nothing (context_cache_lookup_policy "bypass" also skips publication)


@dataclass(frozen=True)
class GuideSpec:
    """One request's output constraint. `spec` is the schema (dict), pattern/grammar (str) or choices."""

    kind: GuideKind
    spec: Any = None


@dataclass(frozen=True)
class ThinkingSpec:
    """A thinking model's reasoning block: where it starts and ends, and how many tokens it may take.

    The engine follows the block in each slot: opened by the prompt itself (the template's generation
    prompt ends inside it) or by the model (`optional`: the template knows the block, the output may
    start with `start`). A guide applies after the block; once `budget` reasoning tokens are spent (or
    what is left of max_tokens is what the answer needs), `message` and `end` are fed as forced tokens."""

    start: str = "<think>"
    end: str = "</think>"
    optional: bool = True
    budget: int | None = None
    message: str = ""


@dataclass(frozen=True)
class StructureHint:
    """Where a guide's JSON is, for closing it inside max_tokens (engine/json_closing.py) when the
    guide's kind does not say it (a tool-call grammar): it starts after `after` (the format's trigger;
    None: at the answer's start), and `reserve` tokens more are kept for what the grammar writes after
    the JSON (a closing tag) and for the arguments it forces (the costliest tool's shortest ones)."""

    after: str | None = None
    reserve: int = 0


@dataclass
class SamplingParams:
    """How one request samples. The API builds it from its field table (api/fields.py, the fields marked
    `sampling`: same names, same defaults, a test holds them equal); `seed` (the one drawn and recorded
    for the request) is the engine's own. The engine never imports the API."""

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0  # OpenAI semantics: over the generated tokens only
    frequency_penalty: float = 0.0
    seed: int = 0
    max_tokens: int = 512
    stop: list[str] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)
    num_logprobs: int = 0


@dataclass
class EngineRequest:
    request_id: str
    messages: list[dict[str, Any]]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    guide: GuideSpec | None = None
    deadline: float | None = None  # wall clock (time.time()), comparable across processes
    # Without a deadline: a budget in seconds counted from when the engine queues the request (an
    # in-process run hands over a whole file at once; requests waiting their turn must not expire).
    timeout_s: float | None = None
    # deadline_ms: by this wall clock time the answer ends, with what it has (FinishReason.DEADLINE), and
    # a request whose first token cannot come before it is refused when it is prepared (engine/lanes.py).
    answer_by: float | None = None
    priority: Priority = Priority.INTERACTIVE
    stream: bool = False  # emit EngineOutput deltas while generating
    # How messages become the prompt. apply_chat_template=False: the contents, concatenated, are the
    # prompt as written (control-token text in them is parsed: the file's author is the operator).
    apply_chat_template: bool = True
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {"enable_thinking": False}
    # Prefix KV reuse: look up a slot's cached prefix, and what to leave behind for the next request.
    cache_lookup: bool = True
    cache_commit: CacheCommit = CacheCommit.ALL
    lora_path: str | None = None  # a GGUF LoRA adapter (engine/lora.py makes one from PEFT safetensors)
    lora_scale: float = 1.0
    speculative: bool = True  # False: never draft for this request (TensorRT-Edge-LLM's disable_spec_decode)
    # Structured output cut by max_tokens is returned as it is, finish "length", not as an error
    # (the OpenAI route, as OpenAI and llama-server do); the seed endpoints keep their 422.
    cut_structure_ok: bool = False
    # This is the second draw of an answer that failed its schema's unenforced keywords
    # (final_output.schema_retry): it is not drawn again, and its output says it was retried.
    schema_retry: bool = False
    first_draw: EngineOutput | None = None  # with schema_retry: the first answer, returned if the second is no better
    # Decoded images/audio; a message's content list refers to them by index ({"type": "media", "index": i}).
    media: list[MediaInput] = field(default_factory=list)
    # Samples of this prompt (OpenAI `n`): the prompt is decoded once and its KV copied to n slots;
    # sample i draws with seed + i, so sample 0 is what the same request with n = 1 gives.
    n: int = 1
    thinking: ThinkingSpec | None = None  # a reasoning block before the answer (see ThinkingSpec)
    structure: StructureHint | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)  # the template's `tools` (OpenAI's shape)
    # How the API reads the reply (api/reply.py's ReplySpec): carried for whoever assembles the output
    # (the service, the offline engine); the engine never looks at it.
    reply: Any = None
    # The prompt as token ids (/v1/completions with token prompts): used as they are instead of
    # `messages` (after the BOS the vocabulary asks for, unless they start with it).
    prompt_tokens: list[int] | None = None
    # Fill-in-the-middle (/v1/completions `suffix`): the prompt is the model's FIM prefix token, the
    # raw prompt, its FIM suffix token, this text and its FIM middle token (models without them refuse).
    infill_suffix: str | None = None
    task: EngineTask = EngineTask.GENERATE
    payload: dict[str, Any] = field(default_factory=dict)  # the task's arguments (see EngineTask)
    # Which of the node's models serves it (runtime/supervision/model_switch.py; None: the default, or the one
    # loaded for a task). The engine never looks at it: a worker runs one model.
    model: str | None = None

    @property
    def media_parts(self) -> bool:
        """Whether a message's content is a list of parts (images/audio, loaded or still to load)."""
        return any(isinstance(m.get("content"), list) for m in self.messages)


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_id": self.token_id,
            "token": self.token,
            "bytes": self.bytes,
            "logprob": self.logprob,
            "top_logprobs": self.top_logprobs,
        }


@dataclass
class EngineOutput:
    """What the engine reports about one request: always a delta since its previous output.

    `data` is the raw bytes of the new tokens: a character may span two outputs, so UTF-8 assembly,
    stop-string holdback and streaming happen in one place on the API side (api/output_processor).
    A request without `stream` gets a single output, at its end, holding everything.
    """

    request_id: str
    finished: bool
    token_ids: list[int] = field(default_factory=list)
    data: bytes = b""
    logprobs: list[TokenLogprob] | None = None  # entries of the new tokens; None when not asked for
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # final: all generated tokens
    error: str | None = None
    error_type: ErrorType | None = None  # the class's type, sent as data: the API maps it back (errors.error_class)
    timings: dict[str, float] = field(default_factory=dict)
    cached_tokens: int = 0  # final: prompt tokens whose KV came from the prefix cache (not decoded again)
    stop_cause: StopCause | None = None  # final, with FinishReason.STOP
    # final: the budget ran short and the JSON was steered to its shortest valid ending (finish "length")
    truncated_structure: bool = False
    # final, a json_schema guide with parts not enforced while generating (engine/schema_check.py): what
    # they are, and why the answer fails the whole schema (None: it passes)
    guide_notes: list[str] = field(default_factory=list)
    schema_error: str | None = None
    # final: the output was cut (max_tokens, the context's end) before its guide could end, and the route
    # takes that as an answer (cut_structure_ok): the text is partial and does not conform
    guided_incomplete: bool = False
    schema_retried: bool = False  # final: the answer is a second draw, the first failed its schema
    index: int = 0  # which of the request's n samples this output is about
    reasoning_open: bool = False  # the prompt opened the reasoning block: the output starts inside it
    reasoning_tokens: int = 0  # final: tokens of the reasoning block (its markers included)
    # final, n > 1: each sample's own final output, by index; the fields above then describe the
    # request (finish_reason, error and timings of sample 0 or the first failed one; token counts summed).
    choices: list[EngineOutput] | None = None
    result: Any = None  # final, tasks other than GENERATE: their answer (plain data)

    @classmethod
    def failure(
        cls, request_id: str, error: str, error_type: ErrorType | str | None, reason: FinishReason = FinishReason.ERROR
    ) -> EngineOutput:
        """A final output for a request that ends without a generation of its own."""
        return cls(request_id, True, finish_reason=reason, error=error, error_type=ErrorType.of(error_type))

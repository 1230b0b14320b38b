"""A request prepared off the step loop: its prompt tokens (media chunks in them) and a compiled guide per sample.

`prepare_request` runs on the prepare pool (prepared.PrepareExecutor): the chat template or the raw text or
fill-in-the-middle made into tokens (engine/chat_prompt.py), images resized and audio made into log-mel frames
(engine/projector.py's MediaCollector), the prompt checked against what a request may hold, and each sample's
guide compiled (engine/guide_matcher.py), the reasoning block the prompt opened included. A caller's mistake
raises EdgeLLMError, which fails that request only (`preparation_failure`). Apart from the scheduler: this
changes with what a prompt is made of, the scheduler with when it runs.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor

from edgellm.engine.chat_prompt import raw_prompt_text
from edgellm.engine.guide_matcher import Guide, GuideBackend
from edgellm.engine.model import LlamaModel
from edgellm.engine.prepared import PreparedRequest, Prompt
from edgellm.engine.projector import MediaCollector, Projector
from edgellm.engine.thinking import prompt_opens
from edgellm.engine.token_step import TokenStep
from edgellm.engine.types import EngineOutput, EngineRequest
from edgellm.errors import ContextLengthExceeded, EdgeLLMError, ErrorType, InvalidRequest

log = logging.getLogger(__name__)


def prepare_request(
    request: EngineRequest,
    model: LlamaModel,
    projector: Projector | None,
    projector_error: str | None,
    backend: GuideBackend,
    token_step: TokenStep,
    pool: Executor,
) -> tuple[Prompt, list[Guide | None]]:
    """Prompt (tokens, media chunks) and a compiled guide per sample; raises EdgeLLMError for the
    caller's mistakes. Images are resized / audio turned into log-mel frames here, off the step loop."""
    room = model.seq_ctx - 1
    if request.media and projector is None:
        why = f" ({projector_error})" if projector_error else " (setting mmproj_path)"
        raise InvalidRequest(f"this model takes text only: images and audio need a multimodal projector{why}")
    collector = MediaCollector(projector, request.media, model.n_batch) if projector is not None else None
    try:
        if request.prompt_tokens is not None:
            prompt = model.with_bos(model.checked_ids(request.prompt_tokens, "prompt"))
        elif request.infill_suffix is not None:
            prompt = _infill_prompt(model, request)
        elif request.apply_chat_template:
            prompt = model.chat_tokens(
                request.messages,
                limit=room,
                add_generation_prompt=request.add_generation_prompt,
                template_kwargs=request.template_kwargs,
                tools=request.tools,
                media=collector,
            )
        else:
            prompt = model.raw_tokens(request.messages, limit=room, media=collector)
    except EdgeLLMError:
        raise
    except Exception as exc:  # a template or tokenizer failure is this request's, never the worker's
        log.warning("request %s: preparing the prompt failed: %r", request.request_id, exc)
        raise InvalidRequest(f"the prompt could not be prepared: {type(exc).__name__}: {exc}"[:500]) from None
    if not prompt:
        raise InvalidRequest("the prompt is empty: there is no token to start generating from")
    if len(prompt) > room:
        raise ContextLengthExceeded(
            f"prompt is {len(prompt)} tokens but a request may hold at most {room} ({model.limit_reason()}); "
            "shorten the messages"
        )
    media = collector.spans(prompt) if collector is not None else []
    if media and media[-1].end == len(prompt):
        raise InvalidRequest(f"the prompt ends with {media[-1].kind} input; put text after it")
    opened = request.thinking is not None and prompt_opens(_tail_bytes(model, prompt), request.thinking)
    guides = [
        backend.compile(request.guide, thinking=request.thinking, opened=opened) if request.guide is not None else None
        for _ in range(request.n)
    ]
    if request.guide is not None:  # the vocabulary scans its steering may use: made off the step loop
        token_step.warm_steering(request, pool)
    return Prompt(prompt, media, thinking_open=opened), guides


def _infill_prompt(model: LlamaModel, request: EngineRequest) -> list[int]:
    """Fill-in-the-middle: <FIM_PRE> prompt <FIM_SUF> suffix <FIM_MID>, the model then writes the middle."""
    fim = model.fim_tokens()
    if fim is None:
        raise InvalidRequest("suffix needs a model with fill-in-the-middle tokens; this one has none", param="suffix")
    pre, suf, mid = fim
    prefix = model.tokenize(raw_prompt_text(request.messages), special=True)
    suffix = model.tokenize(request.infill_suffix or "", special=False)
    return model.with_bos([pre, *prefix, suf, *suffix, mid])


def _tail_bytes(model: LlamaModel, prompt: list[int], n: int = 16) -> bytes:
    """The text of the prompt's last tokens (media stand-ins are negative: skipped)."""
    return b"".join(model.piece(t, special=True) for t in prompt[-n:] if t >= 0)


def preparation_failure(prepared: PreparedRequest) -> EngineOutput:
    """The final output of a request whose preparation raised: its own error, or an engine error for a bug."""
    exc = prepared.future.exception()
    rid = prepared.request.request_id
    if isinstance(exc, EdgeLLMError):
        return EngineOutput.failure(rid, exc.message, exc.error_type)
    # A bug in preparation: this request's failure, never the worker's.
    log.error("request %s: preparation failed", rid, exc_info=exc)
    why = f"internal error while preparing the request: {exc!r}"[:500]
    return EngineOutput.failure(rid, why, ErrorType.ENGINE_ERROR)

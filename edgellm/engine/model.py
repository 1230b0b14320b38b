"""The llama.cpp model and its one context, over llama-cpp-python's low-level bindings.

Everything that touches a ctypes pointer lives here; the scheduler sees tokens, logits rows and
sequence ids. llama.cpp return codes become `EngineError` at this boundary.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import re
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jinja2
import llama_cpp as L
import numpy as np
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from edgellm.engine import test_hooks
from edgellm.engine.chat_format import RESERVED_TEMPLATE_NAMES, ChatFormat
from edgellm.engine.chat_format import detect as detect_chat_format
from edgellm.engine.config import ModelConfig
from edgellm.engine.memory_plan import CELL_ALIGN, kv_cells
from edgellm.errors import ContextLengthExceeded, EngineError, InvalidRequest

log = logging.getLogger(__name__)


# The patched llama.cpp's switch to its row attention kernel (ModelConfig.batch_invariant).
ROW_KERNEL_ENV = "EDGELLM_FA_ROW_KERNEL"


class KvNoRoom(EngineError):
    """llama_decode placed nothing: a sequence of the batch has no free cell after its own last one (a
    unified pool keeps each sequence's cells in position order: tools/llama_cpp/edgellm.patch), or the
    pool is full. The cache is as it was; the scheduler frees cells (preempts) and decodes the rest."""


# SmolLM2 and most instruct GGUFs carry a template; ChatML is the fallback for the few that don't.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_backend_ready = False


@dataclass(frozen=True)
class OffloadInfo:
    gpu_supported: bool
    n_gpu_layers: int
    n_layers: int
    fallback_reason: str | None = None

    @property
    def device(self) -> str:
        return "gpu" if self.n_gpu_layers > 0 else "cpu"


def _joined(offload: OffloadInfo, reason: str) -> str:
    """A new fallback reason after any earlier one (a failed GPU load, then a context that did not fit)."""
    return f"{offload.fallback_reason}; {reason}" if offload.fallback_reason else reason


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _ensure_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        L.llama_backend_init()
        _backend_ready = True


def _load_model(path: str, n_gpu_layers: int) -> ctypes.c_void_p:
    params = L.llama_model_default_params()
    params.n_gpu_layers = n_gpu_layers
    model = L.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise EngineError(f"llama.cpp could not load the model at {path} with n_gpu_layers={n_gpu_layers}")
    return model


def load_offloaded(
    path: str, n_gpu_layers: int, *, force_failure: bool = False
) -> tuple[ctypes.c_void_p, int, str | None]:
    """(model, layers on the GPU, why it fell back to the CPU or None). n_gpu_layers -1 = auto: every layer
    when llama.cpp can offload; a GPU load that fails is retried on the CPU."""
    wanted = n_gpu_layers
    if wanted < 0:
        wanted = 10_000 if L.llama_supports_gpu_offload() else 0  # llama.cpp clamps to the layer count
    if wanted > 0:
        try:
            if force_failure:
                raise EngineError("GPU load failure forced by EDGELLM_FORCE_GPU_FAILURE (test hook)")
            model = _load_model(path, wanted)
            return model, min(wanted, int(L.llama_model_n_layer(model)) + 1), None
        except EngineError as exc:
            fallback = f"GPU load failed ({exc}); retried on CPU"
            log.warning("%s: %s", path, fallback)
    else:
        fallback = None
    return _load_model(path, 0), 0, fallback


# The smallest pool the GPU ladder shrinks to (LlamaModel._context_on_gpu_or_cpu): below it the pool no
# longer holds a few chat turns at once, and the CPU with the configured pool serves better. A config that
# asks for less is never grown to it.
LADDER_MIN_CELLS = 1024


def shrink_ladder(n_cells: int, min_cells: int = LADDER_MIN_CELLS) -> list[int]:
    """The smaller pools (KV cells) to try, in order, after n_cells did not fit on the GPU: halved, on the
    256-cell steps llama.cpp allocates, down to min_cells or the configured size when that is smaller. The
    batch width (n_slots) stays: it costs compute buffers, not KV, and a request may still use all of a
    smaller pool."""
    pools: list[int] = []
    floor = min(min_cells, n_cells)
    cells = n_cells
    while cells > floor:
        cells = max(floor, cells // 2 // CELL_ALIGN * CELL_ALIGN)
        pools.append(cells)
    return pools


def pool_context(
    model: ctypes.c_void_p,
    *,
    n_cells: int,
    n_seqs: int,
    n_batch: int,
    n_threads: int,
    flash_attn: bool = True,
    kv_cache_type: str = "f16",
    unified: bool = True,
) -> ctypes.c_void_p:
    """A context of n_seqs sequences over one unified KV pool of n_cells cells (kv_unified: any sequence
    may take any free cell, and a prefix copied between sequences is shared, not duplicated); with
    unified False, each sequence owns n_cells / n_seqs of them (a KV stream of its own)."""
    cp = L.llama_context_default_params()
    cp.n_ctx = n_cells
    cp.n_batch = n_batch
    cp.n_ubatch = n_batch
    cp.n_seq_max = n_seqs
    cp.n_threads = n_threads
    cp.n_threads_batch = n_threads
    cp.kv_unified = unified
    if hasattr(cp, "flash_attn_type"):
        cp.flash_attn_type = -1 if flash_attn else 0  # -1 = auto
    if kv_cache_type != "f16":
        kv_type = {"q8_0": L.GGML_TYPE_Q8_0, "f32": L.GGML_TYPE_F32}.get(kv_cache_type)
        if kv_type is None:
            raise EngineError(f"kv_cache_type must be f16, q8_0 or f32, got {kv_cache_type!r}")
        cp.type_k = kv_type
        cp.type_v = kv_type
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise EngineError("llama.cpp could not create a context (out of memory?)")
    return ctx


def can_drop_suffix(model: ctypes.c_void_p) -> bool:
    """Whether a sequence's KV can be cut at a position: not recurrent (Mamba, RWKV, hybrids), not
    sliding-window attention."""
    for name in ("llama_model_is_recurrent", "llama_model_is_hybrid"):
        fn = getattr(L, name, None)
        if fn is not None and fn(model):
            return False
    n_swa = getattr(L, "llama_model_n_swa", None)
    return not (n_swa is not None and n_swa(model) > 0)


def free_llama(owner: Any) -> None:
    """Free `owner`'s llama.cpp `batch`, `ctx` and `model` (whichever it has); safe to call twice."""
    if getattr(owner, "batch", None) is not None:
        L.llama_batch_free(owner.batch)
        owner.batch = None
    if getattr(owner, "ctx", None):
        L.llama_free(owner.ctx)
        owner.ctx = None
    if getattr(owner, "model", None):
        L.llama_model_free(owner.model)
        owner.model = None


# How a media part shows in a prompt's text (formatted_complete_request, logs): llama.cpp's marker.
MEDIA_MARKER = "<__media__>"
# A media hook: index into the request's media -> the prompt entries that stand for it (negative ids).
MediaHook = Callable[[int], list[int]]


def content_parts(content: Any) -> list[str | int]:
    """A message's content as parts: text (str) and media (the index of an item in the request's media).

    Content is a string, or a list of {"type": "text", "text": str} and {"type": "media", "index": int}.
    """
    if isinstance(content, list):
        # A part without an index (stored, not yet loaded) only shows as the marker (raw_prompt_text).
        return [p["text"] if p.get("type") == "text" else int(p.get("index", -1)) for p in content]
    return [str(content or "")]


def raw_prompt_text(messages: list[dict]) -> str:
    """What a prompt without a chat template is: the contents, concatenated as written."""
    return "".join(
        part if isinstance(part, str) else MEDIA_MARKER for m in messages for part in content_parts(m.get("content"))
    )


class Vocabulary:
    """A loaded llama.cpp model's tokenizer and metadata (the generation model, a dedicated embedding
    model): `model`, `vocab` and `n_vocab` are set by the subclass before these are used."""

    model: ctypes.c_void_p
    vocab: ctypes.c_void_p
    n_vocab: int

    def _init_vocab(self) -> None:
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self._pieces: dict[int, bytes] = {}

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(65536)
        n = L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def with_bos(self, tokens: list[int]) -> list[int]:
        """The tokens after the model's BOS, when its vocabulary asks for one and they do not start with it."""
        bos = L.llama_vocab_bos(self.vocab)
        if L.llama_vocab_get_add_bos(self.vocab) and bos >= 0 and tokens[:1] != [bos]:
            return [bos, *tokens]
        return tokens

    def with_special(self, tokens: list[int]) -> list[int]:
        """The tokens with the BOS (and EOS) the vocabulary adds to a sequence, where it asks for them."""
        tokens = self.with_bos(tokens)
        eos = L.llama_vocab_eos(self.vocab)
        if L.llama_vocab_get_add_eos(self.vocab) and eos >= 0 and tokens[-1:] != [eos]:
            tokens = [*tokens, eos]
        return tokens

    def input_tokens(self, text: str) -> list[int]:
        """A text input (an embedding input): tokenized as text, control-token text included, with the
        vocabulary's BOS/EOS."""
        return self.with_special(self.tokenize(text, special=False))

    def checked_ids(self, tokens: Any, param: str) -> list[int]:
        """Token ids a client sent: integers in the vocabulary, else a 400 naming `param`."""
        if not isinstance(tokens, list):
            raise InvalidRequest(f"{param} must be an array of token ids", param=param)
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.n_vocab:
                raise InvalidRequest(
                    f"{param}: token id {t!r} is outside the vocabulary [0, {self.n_vocab - 1}]"[:300], param=param
                )
        return list(tokens)

    def fim_tokens(self) -> tuple[int, int, int] | None:
        """The model's fill-in-the-middle prefix, suffix and middle tokens; None where it has none."""
        ids = tuple(int(getattr(L, f"llama_vocab_fim_{k}")(self.vocab)) for k in ("pre", "suf", "mid"))
        return ids if all(t >= 0 for t in ids) else None

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("the prompt contains a lone surrogate (invalid UTF-16); send valid text") from None
        cap = len(data) + 16
        arr = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), arr, cap, False, special)
        if n < 0:
            cap = -n
            arr = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, data, len(data), arr, cap, False, special)
        if n < 0:
            raise EngineError(f"tokenization failed ({n})")
        return list(arr[:n])

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token (cached; control tokens are empty unless special=True).

        Thread-safe: the prepare threads call it (a prompt's tail, a structural tag's trigger mask) while
        the step loop does. So each call that misses the cache has a buffer of its own: ctypes releases
        the GIL around llama_token_to_piece, and one shared buffer could hand a token another's bytes."""
        if not special and token in self._pieces:
            return self._pieces[token]
        buf = ctypes.create_string_buffer(256)
        n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        out = bytes(buf.raw[:n]) if n > 0 else b""
        if not special:
            self._pieces[token] = out
        return out

    def is_eog(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self.vocab, token))


class LlamaModel(Vocabulary):
    """Owns model + context + batch. Not thread-safe: one engine thread drives it."""

    def __init__(self, config: ModelConfig):
        if not os.path.isfile(config.path):
            raise EngineError(f"model file not found: {config.path}")
        _ensure_backend()
        self.config = config
        hooks = test_hooks.current()  # off unless a test installed them (engine/test_hooks.py)
        self.offload = self._load(config, hooks.gpu_load_failure)
        self._init_vocab()
        self.n_embd = int(L.llama_model_n_embd(self.model))
        self.n_threads = config.n_threads or default_threads()
        self.n_slots = config.n_slots  # sequences decoding at once (the batch width)
        self.unified = config.kv_unified  # one KV pool (True) or n_ctx / n_slots cells owned by each slot
        streams = 1 if self.unified else config.n_slots
        if config.n_ctx // streams < 64:
            raise EngineError(f"n_ctx={config.n_ctx} leaves {config.n_ctx // streams} cells a sequence; need >= 64")
        self.n_ctx = config.n_ctx  # cells in the KV pool (the GPU ladder may make it smaller)
        self.ctx = self._context_on_gpu_or_cpu(config, hooks)
        self.n_ctx = int(L.llama_n_ctx(self.ctx))  # llama.cpp pads the pool to whole 256-cell steps
        self.n_ctx_train = int(L.llama_model_n_ctx_train(self.model)) or self.n_ctx
        # The most cells one request may hold: the whole pool (its slot's share when each slot owns its
        # cells), but never past the context the model was trained for (positions beyond it are noise, and
        # llama.cpp only warns).
        self.seq_ctx = min(self.n_ctx // streams, self.n_ctx_train)
        if self.n_ctx != config.n_ctx:
            # The GPU held a smaller pool (or llama.cpp padded it): whatever reads the config from here on
            # (the scheduler's limits, its messages) sees the pool actually made.
            config = dataclasses.replace(config, n_ctx=self.n_ctx)
            self.config = config
        self.memory = L.llama_get_memory(self.ctx)
        self.n_batch = config.n_batch
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        self.eog_tokens = [t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t)]
        self.eos_token = L.llama_vocab_eos(self.vocab)
        self.name = os.path.basename(config.path)
        self.formatter = self._chat_formatter()
        self._formatter_no_gen: Jinja2ChatFormatter | None = None
        self.partial_trim = self._memory_can_drop_suffix()

    # -- loading -------------------------------------------------------------------------------
    def _load(self, config: ModelConfig, force_gpu_failure: bool) -> OffloadInfo:
        self.model, on_gpu, fallback = load_offloaded(config.path, config.n_gpu_layers, force_failure=force_gpu_failure)
        n_layers = L.llama_model_n_layer(self.model)
        return OffloadInfo(bool(L.llama_supports_gpu_offload()), on_gpu, n_layers, fallback)

    def _context_on_gpu_or_cpu(self, config: ModelConfig, hooks: test_hooks.FaultHooks) -> ctypes.c_void_p:
        """The context. When it cannot be made with layers on the GPU (its KV pool and compute buffers did
        not fit next to the weights: shared memory on a Jetson), smaller pools are tried on the GPU first
        (shrink_ladder: the pool halved, the batch width kept); only when none fits is the model reloaded
        on the CPU and the context made there with the configured pool, as a failed GPU model load does.
        n_ctx ends as the pool made; the offload's fallback_reason (/health) says each step."""
        wanted = self.n_ctx
        try:
            return self._gpu_context(hooks, wanted)
        except EngineError as exc:
            if self.offload.n_gpu_layers == 0:
                raise
            first_error = exc
        failed = [wanted]
        for cells in shrink_ladder(wanted):
            try:
                ctx = self._gpu_context(hooks, cells)
            except EngineError:
                failed.append(cells)
                continue
            self.n_ctx = cells
            reason = (
                f"GPU context for a KV pool of {', '.join(map(str, failed))} cells did not fit ({first_error}); "
                f"running a pool of {cells} cells on the GPU"
            )
            log.warning("%s", reason)
            self.offload = dataclasses.replace(self.offload, fallback_reason=_joined(self.offload, reason))
            return ctx
        reason = (
            f"GPU context creation failed for a KV pool of {', '.join(map(str, failed))} cells ({first_error}); "
            f"retried on CPU with {wanted} cells"
        )
        log.warning("%s", reason)
        L.llama_model_free(self.model)
        self.model = _load_model(config.path, 0)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.offload = OffloadInfo(self.offload.gpu_supported, 0, self.offload.n_layers, _joined(self.offload, reason))
        return self._new_context(wanted)

    def _gpu_context(self, hooks: test_hooks.FaultHooks, n_cells: int) -> ctypes.c_void_p:
        """A context with a pool of n_cells and the model as loaded; the test hooks stand in for a GPU that
        cannot hold it (on a machine without one, where the allocation would never fail)."""
        if self.offload.n_gpu_layers > 0:
            if hooks.gpu_context_failure:
                raise EngineError("GPU context failure forced by EDGELLM_FORCE_GPU_CONTEXT_FAILURE (test hook)")
            cap = hooks.gpu_context_max_cells
            cells = kv_cells(n_cells, 1 if self.unified else self.n_slots)
            if cap is not None and cells > cap:
                raise EngineError(
                    f"{cells} KV cells over the {cap} the pretend GPU holds (gpu_context_max_cells test hook)"
                )
        return self._new_context(n_cells)

    def limit_reason(self) -> str:
        """Why one request holds at most seq_ctx tokens, for the error that refuses a longer one."""
        trained = f"the model was trained for {self.n_ctx_train}"
        if self.unified:
            return f"the KV pool has {self.n_ctx} cells; {trained}"
        return (
            f"each of the {self.n_slots} slots owns {self.n_ctx // self.n_slots} of the KV cache's {self.n_ctx} "
            f"cells, kv_unified makes them one pool; {trained}"
        )

    def _memory_can_drop_suffix(self) -> bool:
        """Prefix KV reuse keeps positions [0, n) and drops the rest; recurrent state (Mamba, RWKV,
        hybrids) and sliding-window attention cannot do that reliably, so they re-process prompts."""
        return can_drop_suffix(self.model)

    def _new_context(self, n_cells: int) -> ctypes.c_void_p:
        config = self.config
        return pool_context(
            self.model,
            n_cells=n_cells,
            n_seqs=self.n_slots,
            n_batch=config.n_batch,
            n_threads=self.n_threads,
            flash_attn=config.flash_attn,
            kv_cache_type=config.kv_cache_type,
            unified=self.unified,
        )

    def _chat_formatter(self) -> Jinja2ChatFormatter:
        template = self.meta("tokenizer.chat_template") or CHATML_TEMPLATE
        eos = self.piece(self.eos_token, special=True).decode("utf-8", "replace")
        bos_id = L.llama_vocab_bos(self.vocab)
        bos = self.piece(bos_id, special=True).decode("utf-8", "replace") if bos_id >= 0 else ""
        return Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos, add_generation_prompt=True)

    def _formatter_for(self, add_generation_prompt: bool) -> Jinja2ChatFormatter:
        if add_generation_prompt:
            return self.formatter
        if self._formatter_no_gen is None:  # the formatter fixes add_generation_prompt at construction
            f = self.formatter
            self._formatter_no_gen = Jinja2ChatFormatter(
                template=f.template, eos_token=f.eos_token, bos_token=f.bos_token, add_generation_prompt=False
            )
        return self._formatter_no_gen

    @property
    def chat_format(self) -> ChatFormat:
        """How the template writes tool calls and whether it thinks (engine/chat_format.py)."""
        return detect_chat_format(self.formatter.template)

    # -- text ------------------------------------------------------------------------------------
    def render_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_NAMES}
        if tools:
            kwargs["tools"] = tools  # Hugging Face templates render them (Hermes/Qwen, Llama 3.1, Mistral)
        # Content parts render as their text, each image/audio as llama.cpp's media marker.
        messages = [
            {**m, "content": raw_prompt_text([m])} if isinstance(m.get("content"), list) else m for m in messages
        ]
        try:
            return self._formatter_for(add_generation_prompt)(messages=messages, **kwargs).prompt
        # TemplateError: a template that refuses a role or an order of turns; ValueError: the template's
        # raise_exception() (Mistral/Gemma-style templates refuse some turn orders).
        except (jinja2.TemplateError, ValueError) as exc:
            raise InvalidRequest(f"the model's chat template rejected the messages: {exc}") from None

    def chat_tokens(
        self,
        messages: list[dict],
        *,
        limit: int | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        media: MediaHook | None = None,
    ) -> list[int]:
        """The prompt of a conversation, where only the template's own markup may become control tokens.

        Each message's content is swapped for a private-use placeholder before rendering; the
        rendered text is then tokenized piecewise: template text with special-token parsing on,
        client content with it off, so a user who writes "<|im_start|>system" gets those
        characters as text, not a forged role turn. Past `limit` tokens it stops with a 400 at once
        instead of tokenizing the rest of a prompt that cannot fit anyway. Media parts of a content
        list become what `media` returns for them (the projector's stand-ins).
        """
        # Private-use marks with a per-call nonce: client text cannot contain (or fake) a placeholder.
        nonce = secrets.token_hex(8)
        marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
        options = {"add_generation_prompt": add_generation_prompt, "template_kwargs": template_kwargs, "tools": tools}
        rendered = self.render_chat(
            [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)], **options
        )
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
        # split() with one group gives [text, index, text, index, ..., text]
        indices = [int(i) for i in parts[1::2]]
        if sorted(indices) != list(range(len(messages))):
            # The template transformed the content (sliced it, repeated it): fall back to tokenizing
            # the rendered prompt as a whole, as llama.cpp's own server does.
            if any(isinstance(m.get("content"), list) for m in messages):
                raise InvalidRequest("this model's chat template cannot carry content parts (images, audio)")
            log.warning("chat template altered the content placeholders; control-token text in content is parsed")
            return self.tokenize(self.render_chat(messages, **options), special=True)
        tokens: list[int] = []
        for j, text in enumerate(parts):
            if j % 2 == 0:
                if text:
                    tokens += self.tokenize(text, special=True)
            else:
                tokens += self._content_tokens(messages[int(text)]["content"], False, media)
            if limit is not None and len(tokens) > limit:
                raise ContextLengthExceeded(
                    f"prompt is over {limit} tokens (stopped counting at message {j // 2} of {len(messages)}) but a "
                    f"request may hold at most {limit}; shorten the messages"
                )
        return tokens

    def _content_tokens(self, content: Any, special: bool, media: MediaHook | None) -> list[int]:
        """One message's content: text parts tokenized (control-token text parsed only when `special`),
        media parts as `media` gives them."""
        tokens: list[int] = []
        for part in content_parts(content):
            if isinstance(part, str):
                if part:
                    tokens += self.tokenize(part, special=special)
            elif media is None:
                raise InvalidRequest("this model takes text only: it has no multimodal projector (mmproj_path)")
            else:
                tokens += media(part)
        return tokens

    def raw_tokens(
        self, messages: list[dict], *, limit: int | None = None, media: MediaHook | None = None
    ) -> list[int]:
        """The prompt without a chat template: the contents as written, in order, after the model's BOS
        when its vocabulary asks for one. Control-token text is parsed: whoever writes a raw prompt
        writes its markup too (TensorRT-Edge-LLM's apply_chat_template=false)."""
        text = raw_prompt_text(messages)
        if limit is not None and len(text) > 16 * limit + 1024:  # far more bytes than tokens fit: no need to count
            raise ContextLengthExceeded(
                f"prompt is over {limit} tokens but a request may hold at most {limit}; shorten it"
            )
        if any(isinstance(m.get("content"), list) for m in messages):
            tokens: list[int] = []
            for m in messages:
                tokens += self._content_tokens(m.get("content"), True, media)
        else:
            tokens = self.tokenize(text, special=True)
        return self.with_bos(tokens)

    # -- decoding ------------------------------------------------------------------------------
    def decode(
        self, tokens: list[int], positions: list[int], seq_ids: list[int], want_logits: list[bool]
    ) -> np.ndarray:
        """Decode one batch; returns a copy of the logits rows, in batch order of want_logits."""
        n = len(tokens)
        if n == 0 or n > self.n_batch:
            raise EngineError(f"batch of {n} tokens outside [1, {self.n_batch}]")
        b = self.batch
        b.n_tokens = n
        for i in range(n):
            b.token[i] = tokens[i]
            b.pos[i] = positions[i]
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq_ids[i]
            b.logits[i] = 1 if want_logits[i] else 0
        self.select_attention_kernel()
        rc = L.llama_decode(self.ctx, b)
        if rc == 1 and self.unified:
            raise KvNoRoom("llama_decode found no KV cells for the batch (returned 1)")
        if rc != 0:
            raise EngineError(f"llama_decode returned {rc}")
        n_out = sum(1 for w in want_logits if w)
        if n_out == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        ptr = L.llama_get_logits(self.ctx)
        # The buffer is overwritten by the next decode: copy the rows out now. Into the array the
        # last decode returned when nobody holds it (or a view of it) any more: a fresh 1.5 MB array
        # each step can cost ~0.8 ms of page faults (measured: the allocator gives blocks of that size
        # back to the OS when they are freed). A caller that keeps rows across decodes (the scheduler's
        # bisecting retry) holds a reference, and gets a new array. Only small outputs are kept (at
        # most 32 rows: 6 MB).
        src = np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))
        spare = getattr(self, "_logits_spare", None)
        # Unheld: as many references as an object only this model holds, counted the same way (the
        # attribute, the local name; what getrefcount itself adds depends on the interpreter).
        probe = self.__dict__.setdefault("_logits_probe", object())
        if spare is not None and spare.shape[0] >= n_out and sys.getrefcount(spare) == sys.getrefcount(probe):
            out = spare[:n_out]
            np.copyto(out, src)
            return out
        out = src.copy()
        self._logits_spare = out if n_out <= 32 else None
        return out

    def select_attention_kernel(self) -> None:
        """Before each decode of this model's context: the CPU attention kernel its config asks for. The
        patched llama.cpp reads EDGELLM_FA_ROW_KERNEL at each call (tools/llama_cpp/edgellm.patch); a
        process-wide variable, so it is set for the model about to decode (tests hold several)."""
        want = "1" if self.config.batch_invariant else "0"
        if os.environ.get(ROW_KERNEL_ENV) != want:
            os.environ[ROW_KERNEL_ENV] = want

    def trim_sequence(self, seq_id: int, keep: int) -> bool:
        """Drop every cached position >= keep of one sequence (keep=0 clears it).

        False when only a full clear was possible (recurrent or sliding-window memory cannot drop a
        suffix): the caller must then prefill from position 0, not leave a gap.
        """
        if keep > 0 and not self.partial_trim:
            L.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
            return False
        if L.llama_memory_seq_rm(self.memory, seq_id, keep, -1):
            return True
        L.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        return keep == 0

    def copy_sequence(self, src: int, dst: int, keep: int) -> bool:
        """Make sequence `dst` hold positions [0, keep) of sequence `src` (n > 1 samples share one prefill,
        requests share a system prompt). In the unified pool the cells are shared, not copied: `dst` is
        added to the cells `src` holds there. False where the memory cannot drop a suffix (recurrent,
        SWA: a sequence's state is not a list of cells): `dst` is left empty then."""
        L.llama_memory_seq_rm(self.memory, dst, -1, -1)
        if not self.partial_trim or keep <= 0:
            return False
        if self.unified:
            L.llama_memory_seq_cp(self.memory, src, dst, 0, keep)
            return True
        # Each slot its own KV stream: llama.cpp copies between streams only whole (queued for the start of
        # the next llama_decode), then the positions >= keep are dropped from `dst`.
        L.llama_memory_seq_cp(self.memory, src, dst, -1, -1)
        return self.trim_sequence(dst, keep)

    def set_threads(self, n: int) -> None:
        """Threads for the next decodes (generation and prompt batches alike)."""
        L.llama_set_n_threads(self.ctx, n, n)

    def save_sequence(self, seq_id: int, path: str, tokens: list[int]) -> int:
        """Write sequence `seq_id`'s KV state and `tokens` (what it holds, positions 0..n-1) to `path`
        (llama.cpp's sequence state file); the bytes written, 0 when llama.cpp could not write it."""
        arr = (L.llama_token * max(1, len(tokens)))(*tokens)
        return int(L.llama_state_seq_save_file(self.ctx, os.fsencode(path), seq_id, arr, len(tokens)))

    def load_sequence(self, seq_id: int, path: str, max_tokens: int) -> list[int] | None:
        """Replace sequence `seq_id`'s KV with the state in `path` (saved by save_sequence); the tokens
        stored with it, or None when llama.cpp refused the file (unreadable, foreign, more than
        `max_tokens` tokens): the sequence is left empty then."""
        L.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        arr = (L.llama_token * max(1, max_tokens))()
        count = ctypes.c_size_t(0)
        read = L.llama_state_seq_load_file(self.ctx, os.fsencode(path), seq_id, arr, max_tokens, ctypes.byref(count))
        n = count.value
        # The KV must hold exactly the stored tokens' positions, 0..n-1 (a file saved with other tokens
        # than its sequence held, or made for another context layout, fails this).
        span = (L.llama_memory_seq_pos_min(self.memory, seq_id), L.llama_memory_seq_pos_max(self.memory, seq_id))
        if read == 0 or n == 0 or n > max_tokens or span != (0, n - 1):
            L.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
            return None
        return list(arr[:n])

    def sequence_state_size(self, seq_id: int) -> int:
        """The bytes sequence `seq_id`'s KV state takes in a state file (the tokens stored with it apart)."""
        return int(L.llama_state_seq_get_size(self.ctx, seq_id))

    def close(self) -> None:
        free_llama(self)

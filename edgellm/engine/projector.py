"""The multimodal projector (llama.cpp's mtmd library): media -> embeddings in a slot's sequence.

A request's images and audio are turned into mtmd chunks while its prompt is prepared (off the step
loop: `mtmd_tokenize_from_parts` is thread-safe and does the resize / log-mel work), and each chunk
is encoded and decoded into the slot's sequence by the step loop, one chunk per step
(`decode_into`), so text slots keep generating between two encodes.

In the prompt a media chunk occupies `n_tokens` entries: stand-in token ids derived from the
content hash (negative, so never a real token). Prefix KV reuse compares them like tokens, so two
requests with the same image at the same place share the encoded prefix.

mtmd aborts the whole process on some malformed projector files (a GGML_ASSERT), so a file is
probed in a child process (`probe`) before the serving process loads it.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import llama_cpp as L
import llama_cpp.mtmd_cpp as M
import numpy as np

from edgellm.engine import test_hooks
from edgellm.engine.gguf_header import read_metadata
from edgellm.errors import EngineError, InvalidRequest
from edgellm.media.types import AudioInput, ImageInput, MediaCaps, MediaInput

log = logging.getLogger(__name__)

_NO_CALLBACK = M.mtmd_helper_post_decode_callback(0)  # a NULL function pointer (ctypes refuses None here)
_MEDIA_TYPES = {M.MTMD_INPUT_CHUNK_TYPE_IMAGE: "image", M.MTMD_INPUT_CHUNK_TYPE_AUDIO: "audio"}
# Projectors that resize every image to one square input (mtmd's fixed-size preprocessors): for them
# `do_resize: false` can check the size exactly. Dynamic-resolution ones (qwen2vl, idefics3 tiling...) cannot.
FIXED_SIZE_PROJECTORS = frozenset({"mlp", "ldp", "ldpv2", "gemma3"})


class OwnedChunk:
    """An mtmd_input_chunk copied out of its chunk list (the preprocessed pixels/mel), freed with us."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            M.mtmd_input_chunk_free(self.ptr)
            self.ptr = None


@dataclass
class MediaSpan:
    """One media chunk inside a prepared prompt: entries [start, start + n_tokens) are its stand-ins."""

    start: int
    n_tokens: int  # KV cells (embeddings) it adds
    n_pos: int  # positions it advances (fewer than n_tokens under M-RoPE)
    kind: str  # "image" | "audio"
    chunk: OwnedChunk = field(repr=False)

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


def standins(content_key: str, n: int) -> list[int]:
    """n negative ids, a function of the chunk's content key: equal media give equal stand-ins.

    They never reach llama.cpp (only text runs are decoded as tokens), so they can be wide: 128 bits of
    the digest, so that no one can craft an image whose stand-ins match another's and have a later
    request reuse the KV of the wrong picture."""
    h = int.from_bytes(hashlib.sha256(content_key.encode()).digest()[:16], "little")
    return [-1 - (h << 20) - j for j in range(n)]


def route_logs() -> None:
    """mtmd and clip print to stderr by default; send them through llama-cpp-python's logger instead."""
    from llama_cpp._logger import llama_log_callback

    M.mtmd_helper_log_set(llama_log_callback, None)


class Projector:
    """An mtmd context bound to the text model. Encoding is single-threaded (one output buffer)."""

    def __init__(self, path: str, model: ctypes.c_void_p, *, n_threads: int, use_gpu: bool):
        route_logs()
        params = M.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = max(1, n_threads)
        params.print_timings = False
        params.warmup = True
        self.ctx = M.mtmd_init_from_file(path.encode(), model, params)
        if not self.ctx:
            raise EngineError(
                f"llama.cpp's mtmd could not load the projector {path}: not an mmproj GGUF, or its output size "
                "does not match this model's embedding size (a projector made for another model)"
            )
        self.path = path
        self.on_gpu = use_gpu
        self.fallback_reason: str | None = None  # why it runs on the CPU though the model is on the GPU
        self.mrope = bool(M.mtmd_decode_use_mrope(self.ctx))
        meta = gguf_strings(path, ("clip.projector_type", "clip.vision.projector_type"))
        ptype = meta.get("clip.vision.projector_type") or meta.get("clip.projector_type") or ""
        vision = bool(M.mtmd_support_vision(self.ctx))
        image_size = gguf_u32(path, "clip.vision.image_size") if vision and ptype in FIXED_SIZE_PROJECTORS else 0
        rate = int(M.mtmd_get_audio_sample_rate(self.ctx))
        self.caps = MediaCaps(
            vision=vision,
            audio=bool(M.mtmd_support_audio(self.ctx)),
            audio_sample_rate=rate if rate > 0 else 0,
            image_size=image_size or 0,
            projector_type=ptype,
        )

    # -- preparation (prepare threads) ---------------------------------------------------------
    def chunks_of(self, item: MediaInput) -> list[tuple[str, list[int] | OwnedChunk, int, int]]:
        """The chunks one media item becomes, in order: ("text", tokens, n, n) for the wrapper text some
        projectors put around media (e.g. <start_of_image>), (kind, OwnedChunk, n_tokens, n_pos) for media.

        Long audio is several chunks (30 s windows). Raises InvalidRequest for media this projector
        cannot take.
        """
        if isinstance(item, ImageInput):
            if not self.caps.vision:
                raise InvalidRequest("this model's projector takes no images (it has no vision encoder)")
            buf = (ctypes.c_uint8 * len(item.rgb)).from_buffer_copy(item.rgb)
            bitmap = M.mtmd_bitmap_init(item.width, item.height, buf)
        elif isinstance(item, AudioInput):
            if not self.caps.audio:
                raise InvalidRequest("this model's projector takes no audio (it has no audio encoder)")
            if item.sample_rate != self.caps.audio_sample_rate:
                raise InvalidRequest(
                    f"audio at {item.sample_rate} Hz; this projector takes {self.caps.audio_sample_rate} Hz"
                )
            buf = (ctypes.c_float * item.n_samples).from_buffer_copy(item.samples)
            bitmap = M.mtmd_bitmap_init_from_audio(item.n_samples, buf)
        else:
            raise TypeError(f"not a media input: {type(item).__name__}")
        if not bitmap:
            raise InvalidRequest(f"the {item.kind} could not be handed to the projector")
        chunks = M.mtmd_input_chunks_init()
        try:
            M.mtmd_bitmap_set_id(bitmap, item.content_id.encode())
            part = M.mtmd_input_part(text=None, bitmap=bitmap)
            parts = (ctypes.POINTER(M.mtmd_input_part) * 1)(ctypes.pointer(part))
            rc = M.mtmd_tokenize_from_parts(self.ctx, chunks, parts, 1, False)
            if rc != 0:
                raise InvalidRequest(f"the projector could not preprocess the {item.kind} (mtmd error {rc})")
            out: list[tuple[str, list[int] | OwnedChunk, int, int]] = []
            for i in range(M.mtmd_input_chunks_size(chunks)):
                ch = M.mtmd_input_chunks_get(chunks, i)
                kind = M.mtmd_input_chunk_get_type(ch)
                if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t(0)
                    ptr = M.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
                    tokens = [ptr[j] for j in range(n.value)]
                    out.append(("text", tokens, len(tokens), len(tokens)))
                else:
                    owned = OwnedChunk(M.mtmd_input_chunk_copy(ch))
                    n_tokens = int(M.mtmd_input_chunk_get_n_tokens(ch))
                    out.append(
                        (_MEDIA_TYPES.get(kind, "media"), owned, n_tokens, int(M.mtmd_input_chunk_get_n_pos(ch)))
                    )
            return out
        finally:
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)

    # -- the step loop -------------------------------------------------------------------------
    def decode_into(
        self, lctx: ctypes.c_void_p, span: MediaSpan, seq_id: int, n_past: int, n_batch: int
    ) -> tuple[int, float]:
        """Encode one media chunk and decode its embeddings into `seq_id` from position n_past.

        Returns the next position and the encode time (s). mtmd's helper places the rows (M-RoPE
        positions, non-causal attention around the decode, n_batch splits). Raises EngineError.
        """
        t0 = time.perf_counter()
        if M.mtmd_encode_chunk(self.ctx, span.chunk.ptr) != 0:
            raise EngineError(f"the projector failed to encode the {span.kind}")
        encode_s = time.perf_counter() - t0
        embd = M.mtmd_get_output_embd(self.ctx)
        new_pos = L.llama_pos(0)
        rc = M.mtmd_helper_decode_image_chunk(
            self.ctx, lctx, span.chunk.ptr, embd, n_past, seq_id, n_batch, ctypes.byref(new_pos), _NO_CALLBACK, None
        )
        if rc != 0:
            raise EngineError(f"decoding the {span.kind}'s embeddings failed (llama_decode {rc})")
        return int(new_pos.value), encode_s

    def close(self) -> None:
        if getattr(self, "ctx", None):
            M.mtmd_free(self.ctx)
            self.ctx = None


# -- GGUF header values (without loading the file) ----------------------------------------------
def gguf_strings(path: str, keys: tuple[str, ...]) -> dict[str, str]:
    return {k: v for k, v in gguf_values(path, keys).items() if isinstance(v, str)}


def gguf_u32(path: str, key: str) -> int:
    value = gguf_values(path, (key,)).get(key)
    return int(value) if isinstance(value, (int, np.integer)) else 0


def gguf_values(path: str, keys: tuple[str, ...]) -> dict:

    try:
        return read_metadata(path, keys)
    except (OSError, ValueError) as exc:
        log.warning("could not read %s's metadata: %s", path, exc)
        return {}


def attach_projector(
    mmproj_path: str | None, model_path: str, model: ctypes.c_void_p, *, n_threads: int, use_gpu: bool
) -> tuple[Projector | None, str | None]:
    """The projector for a loaded text model, after a probe in a child process: (projector, None), or
    (None, why) when none is configured or it cannot be used (the node then serves text only)."""
    if not mmproj_path:
        return None, None
    try:
        probe(mmproj_path, model_path)
        projector = open_projector(mmproj_path, model, n_threads=n_threads, use_gpu=use_gpu)
    except EngineError as exc:
        log.error("multimodal input disabled: %s", exc.message)
        return None, exc.message
    log.info("projector %s loaded: %s", os.path.basename(mmproj_path), projector.caps)
    return projector, None


def open_projector(path: str, model: ctypes.c_void_p, *, n_threads: int, use_gpu: bool) -> Projector:
    """The projector, on the GPU when asked; when its GPU init fails (its weights and compute buffer did not
    fit next to the text model's: one memory pool on a Jetson), on the CPU instead of not at all: images
    and audio then encode slower, text decoding is unchanged. `fallback_reason` says so. A projector the
    CPU cannot load either fails as before (the file, not the memory, is wrong)."""
    if not use_gpu:
        return Projector(path, model, n_threads=n_threads, use_gpu=False)
    try:
        if test_hooks.current().gpu_projector_failure:  # off unless a test installed it (no GPU to fill)
            raise EngineError("projector GPU init failure forced by the gpu_projector_failure test hook")
        return Projector(path, model, n_threads=n_threads, use_gpu=True)
    except EngineError as exc:
        reason = f"projector GPU init failed ({exc.message}); retried on CPU"
        log.warning("%s: %s", os.path.basename(path), reason)
    projector = Projector(path, model, n_threads=n_threads, use_gpu=False)
    projector.fallback_reason = reason
    return projector


# -- probing a projector file in a child process -------------------------------------------------
def probe(mmproj_path: str, model_path: str, *, timeout_s: float = 120.0) -> MediaCaps:
    """Load the projector next to the text model in a child process and encode a dummy image / 1 s of
    silence, so a file that makes mtmd abort takes down the child, not the node. Returns its caps;
    raises EngineError with the reason otherwise."""
    if not os.path.isfile(mmproj_path):
        raise EngineError(f"mmproj file not found: {mmproj_path}")
    cmd = [sys.executable, "-m", "edgellm.engine.projector", mmproj_path, model_path]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise EngineError(f"probing the projector {mmproj_path} took over {timeout_s:.0f} s") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return MediaCaps.from_dict(json.loads(lines[-1]))
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
    why = f"exit status {done.returncode}" if done.returncode >= 0 else f"killed by signal {-done.returncode}"
    raise EngineError(f"the projector {mmproj_path} failed its check ({why}: {tail})")


def _probe_main(mmproj_path: str, model_path: str) -> None:
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    L.llama_backend_init()
    params = L.llama_model_default_params()
    params.vocab_only = True  # mtmd needs the text model's embedding size and vocabulary, not its weights
    model = L.llama_model_load_from_file(model_path.encode(), params)
    if not model:
        raise SystemExit(f"could not load the text model {model_path}")
    try:
        proj = Projector(mmproj_path, model, n_threads=1, use_gpu=False)
    except EngineError as exc:
        raise SystemExit(exc.message) from None
    dummies: list[MediaInput] = []
    if proj.caps.vision:
        dummies.append(ImageInput.of(8, 8, bytes(8 * 8 * 3)))
    if proj.caps.audio:
        dummies.append(AudioInput.of(proj.caps.audio_sample_rate, bytes(4 * proj.caps.audio_sample_rate)))
    if not dummies:
        raise SystemExit("the projector supports neither images nor audio")
    for item in dummies:
        for kind, chunk, _, _ in proj.chunks_of(item):
            if kind != "text" and M.mtmd_encode_chunk(proj.ctx, chunk.ptr) != 0:
                raise SystemExit(f"encoding a test {kind} failed")
    print(json.dumps(proj.caps.to_dict()))
    proj.close()


if __name__ == "__main__":
    _probe_main(sys.argv[1], sys.argv[2])


class MediaCollector:
    """The media hook of one prompt's preparation: turns each media part into its chunks, gives the
    tokenizer their stand-ins, and afterwards finds where each chunk landed in the final prompt."""

    def __init__(self, projector: Projector, items: list[MediaInput], n_batch: int):
        self.projector = projector
        self.items = items
        self.n_batch = n_batch
        self._chunks: list[tuple[str, OwnedChunk, int, int]] = []

    def __call__(self, index: int) -> list[int]:
        if not 0 <= index < len(self.items):
            raise InvalidRequest(f"a content part refers to media item {index}, but the request has {len(self.items)}")
        item = self.items[index]
        entries: list[int] = []
        for j, (kind, obj, n_tokens, n_pos) in enumerate(self.projector.chunks_of(item)):
            if kind == "text":
                entries += obj
            else:
                if n_tokens > self.n_batch and M.mtmd_decode_use_non_causal(self.projector.ctx, obj.ptr):
                    # Non-causal attention over the image only holds within one batch: split, it is wrong.
                    raise InvalidRequest(
                        f"the {kind} becomes {n_tokens} embeddings but this projector needs them in one batch and "
                        f"n_batch is {self.n_batch}: raise n_batch (setting) or send a smaller {kind}"
                    )
                self._chunks.append((kind, obj, n_tokens, n_pos))
                entries += standins(f"{item.content_id}:{j}", n_tokens)
        return entries

    def spans(self, prompt: list[int]) -> list[MediaSpan]:
        """Chunks in order, each at the next run of stand-ins (BOS or template text may have shifted them)."""
        spans: list[MediaSpan] = []
        i = 0
        for kind, chunk, n_tokens, n_pos in self._chunks:
            while i < len(prompt) and prompt[i] >= 0:
                i += 1
            if i + n_tokens > len(prompt):
                raise EngineError("internal error: media stand-ins missing from the prepared prompt")
            spans.append(MediaSpan(i, n_tokens, n_pos, kind, chunk))
            i += n_tokens
        return spans

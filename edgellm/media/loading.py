"""Loading a request's media: stored content parts (media/parts.py) -> what the engine takes."""

from __future__ import annotations

from typing import Any

from edgellm.media.decode import decode_audio, decode_image
from edgellm.media.errors import MediaError, MediaTooLarge
from edgellm.media.limits import MediaLimits, MediaSources
from edgellm.media.parts import has_media
from edgellm.media.sources import check_source, load_bytes
from edgellm.media.types import ImageInput, MediaCaps, MediaInput

DEFAULT_AUDIO_RATE = 16000
# Decoded pixels are held until the request is done (and sent to the engine process): a 49 KB PNG can
# declare 4096x4096 (48 MB of RGB). Images are scaled down to this longer side, which every projector
# resizes below anyway (336-896 px fixed inputs; dynamic ones cap near 1-3 Mpx), and the decoded media of
# one request are capped in total.
MAX_IMAGE_SIDE = 2048
MAX_DECODED_BYTES = 32 * 1024 * 1024


def load_content(
    messages: list[dict[str, Any]],
    caps: MediaCaps | None,
    sources: MediaSources,
    limits: MediaLimits,
    *,
    base_dir: str | None = None,
) -> tuple[list[dict[str, Any]], list[MediaInput]]:
    """Stored messages -> (engine messages, decoded media). `caps` is the engine's projector (None while
    it is unknown: then media can only fail later, in the engine). Raises MediaError / InvalidRequest."""
    _count(messages, limits)
    out: list[dict[str, Any]] = []
    items: list[MediaInput] = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if not has_media(content):
            out.append(msg)
            continue
        parts = []
        for j, part in enumerate(content):
            if part["type"] == "text":
                parts.append(part)
                continue
            param = f"messages[{i}].content[{j}]"
            items.append(_load_part(part, caps, sources, limits, base_dir, param))
            parts.append({"type": "media", "index": len(items) - 1})
            decoded = sum(len(x.rgb) if isinstance(x, ImageInput) else len(x.samples) for x in items)
            if decoded > MAX_DECODED_BYTES:
                raise MediaTooLarge(
                    f"{param}: the request's images and audio decode to over {MAX_DECODED_BYTES // 2**20} MiB; "
                    "send fewer or smaller ones",
                    param=param,
                )
        out.append({**msg, "content": parts})
    return out, items


def check_content(
    messages: list[dict[str, Any]],
    caps: MediaCaps | None,
    sources: MediaSources,
    limits: MediaLimits,
    *,
    base_dir: str | None = None,
) -> None:
    """What load_content would refuse the stored messages for by policy (how many media, a modality the
    model lacks, where each may come from: media_dirs, remote media), without reading a file, fetching a
    URL or decoding anything (the console's check of a request it does not run)."""
    _count(messages, limits)
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if not has_media(content):
            continue
        for j, part in enumerate(content):
            if part["type"] != "text":
                param = f"messages[{i}].content[{j}]"
                _check_modality(part["type"], caps, param)
                check_source(part["source"], sources, limits, param=param, base_dir=base_dir)


def _count(messages: list[dict[str, Any]], limits: MediaLimits) -> None:
    n_media = sum(1 for m in messages if has_media(m.get("content")) for p in m["content"] if p["type"] != "text")
    if n_media > limits.max_items:  # before fetching or decoding any of them
        raise MediaError(f"the request carries {n_media} images/audio clips; the limit is {limits.max_items}")


def _check_modality(kind: str, caps: MediaCaps | None, param: str) -> None:
    if caps is not None and not (caps.vision if kind == "image" else caps.audio):
        raise MediaError(
            f"{param}: this model takes no {'images' if kind == 'image' else 'audio'}: the node has no "
            f"{'vision' if kind == 'image' else 'audio'} projector (setting mmproj_path)"
            + (f"; {caps.error}" if caps.error else ""),
            param=param,
        )


def _load_part(
    part: dict[str, Any],
    caps: MediaCaps | None,
    sources: MediaSources,
    limits: MediaLimits,
    base_dir: str | None,
    param: str,
) -> MediaInput:
    kind = part["type"]
    _check_modality(kind, caps, param)
    data = load_bytes(part["source"], sources, limits, param=param, base_dir=base_dir)
    if kind == "image":
        if part.get("do_resize", True):
            return decode_image(data, limits, max_side=MAX_IMAGE_SIDE, param=param)
        # do_resize false: the pixels as they are, of the fixed-size projector's input size when it has one
        expect = (caps.image_size, caps.image_size) if caps is not None and caps.image_size else None
        return decode_image(data, limits, expect_size=expect, param=param)
    # Before the engine reports (a request recovered at start), whisper-family projectors' 16 kHz: the
    # engine refuses another rate with a clear error, it never guesses.
    rate = caps.audio_sample_rate if caps is not None and caps.audio_sample_rate else DEFAULT_AUDIO_RATE
    return decode_audio(data, limits, sample_rate=rate, param=param)

"""Content arrays: the parts a client may send in a message, checked, stored, then loaded.

Two steps, because they happen in different places:

- `parse_content` (pure, no I/O) checks a content array and turns every accepted spelling into one
  stored form: {"type": "text", "text"}, {"type": "image", "source", "do_resize"} or
  {"type": "audio", "source"}. The registry keeps this form, so a request recovered after a restart
  loads its media again from the same sources.
- `media/loading.load_content` (I/O: files, data URLs, optionally http) fetches and decodes the
  media and gives the engine's form: parts {"type": "text"} / {"type": "media", "index": i} plus the
  decoded inputs.

Accepted parts (the same on every route): OpenAI's {"type": "text"}, {"type": "image_url",
"image_url": {"url"}}, {"type": "input_audio", "input_audio": {"data", "format"}}, and
TensorRT-Edge-LLM's {"type": "image", "image", "do_resize"}, {"type": "audio", "audio"}.
"""

from __future__ import annotations

from typing import Any

from edgellm.errors import InvalidRequest

AUDIO_FORMATS = ("wav", "mp3", "flac")
MEDIA_ROLES = ("user",)  # as OpenAI: images and audio come from the user


def has_media(content: Any) -> bool:
    return isinstance(content, list) and any(p.get("type") in ("image", "audio") for p in content)


def parse_content(where: str, content: list[Any], role: str) -> tuple[list[dict[str, Any]], int, int]:
    """A content array -> (stored parts, text bytes, media count). Raises InvalidRequest naming `where`."""
    if not content:
        raise InvalidRequest(f"{where}.content must not be an empty array", param="messages")
    parts: list[dict[str, Any]] = []
    text_bytes = n_media = 0
    for j, raw in enumerate(content):
        at = f"{where}.content[{j}]"
        part = _parse_part(at, raw)
        if part["type"] == "text":
            text_bytes += len(part["text"].encode("utf-8"))
            if parts and parts[-1]["type"] == "text":  # adjacent text parts read as lines, as before
                part = {"type": "text", "text": "\n" + part["text"]}
        else:
            if role not in MEDIA_ROLES:
                raise InvalidRequest(f"{at}: {part['type']} input is accepted in user messages only", param="messages")
            n_media += 1
        parts.append(part)  # one stored part per client part: error messages name the client's index
    if n_media == 0:  # text only: the plain string they read as
        parts = [{"type": "text", "text": "".join(p["text"] for p in parts)}]
    return parts, text_bytes, n_media


def _parse_part(at: str, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{at} must be an object with a type", param="messages")
    kind = raw.get("type")
    if kind == "text":
        return {"type": "text", "text": _text(at, raw.get("text"))}
    if kind == "image_url":
        ref = raw.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        return {"type": "image", "source": _source(f"{at}.image_url.url", url), "do_resize": True}
    if kind == "image":
        do_resize = raw.get("do_resize", True)
        if not isinstance(do_resize, bool):
            raise InvalidRequest(f"{at}.do_resize must be true or false", param="messages")
        return {"type": "image", "source": _source(f"{at}.image", raw.get("image")), "do_resize": do_resize}
    if kind == "input_audio":
        ref = raw.get("input_audio")
        if not isinstance(ref, dict):
            raise InvalidRequest(f"{at}.input_audio must be an object with data and format", param="messages")
        fmt = ref.get("format")
        if fmt not in AUDIO_FORMATS:
            raise InvalidRequest(f"{at}.input_audio.format must be one of {', '.join(AUDIO_FORMATS)}", param="messages")
        data = ref.get("data")
        if not isinstance(data, str) or not data:
            raise InvalidRequest(f"{at}.input_audio.data must be a non-empty base64 string", param="messages")
        _no_surrogates(f"{at}.input_audio.data", data)
        return {"type": "audio", "source": f"data:audio/{fmt};base64,{data}"}
    if kind == "audio":
        return {"type": "audio", "source": _source(f"{at}.audio", raw.get("audio"))}
    if kind in ("video", "video_url", "file", "input_file"):
        raise InvalidRequest(f"{at}: {kind} input is not supported (images and audio are)", param="messages")
    raise InvalidRequest(
        f"{at}.type must be text, image_url, input_audio, image or audio; got {_show(kind)}", param="messages"
    )


def _text(at: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"{at}.text must be a string", param="messages")
    _no_surrogates(f"{at}.text", value)
    return value


def _source(at: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{at} must be a non-empty string (a data: URL or a file path)", param="messages")
    _no_surrogates(at, value)
    return value.strip()


def _no_surrogates(at: str, value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{at} contains a lone surrogate (invalid UTF-16)", param="messages") from None


def _show(value: Any) -> str:
    return repr(value)[:40] if isinstance(value, str) else type(value).__name__

"""Encoded bytes -> ImageInput / AudioInput, with the size limits checked before the expensive decode.

Images: OpenCV. A small file can declare a huge image (a 389 KB PNG of zeros inflates to 20000x20000:
measured 4.4 s and 2.3 GB RSS in cv2.imdecode), and OpenCV has no header-only API; decoding at 1/8
(IMREAD_REDUCED_*_8) is cheap for JPEG only, a PNG is still inflated in full (measured: as slow as a full
decode). So the width and height are read from the file header here, for the formats that have them at
a fixed place, and only those formats are accepted; what OpenCV also reads (AVIF, JPEG 2000, PNM, ...)
is refused rather than decoded unchecked.

Audio: miniaudio (wav, mp3, flac, ogg vorbis), resampled and downmixed to mono float32 by the decoder.
The duration is read from the header first when the format has one, and decoding streams and stops at
the limit, so a file without a usable header cannot decode past it either.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import Literal

import numpy as np

from edgellm.media.errors import MediaError, MediaTooLarge
from edgellm.media.limits import MediaLimits
from edgellm.media.types import AudioInput, ImageInput

IMAGE_FORMATS = "PNG, JPEG, GIF, BMP, WebP or TIFF"
AUDIO_FORMATS = "WAV, MP3, FLAC or Ogg Vorbis"

# mp3 frame counts include the encoder's padding (600 s of audio reads as 600.033 s) and resampling can
# round up a frame: a file at exactly the limit must still pass.
_DURATION_SLACK_S = 0.05
_AUDIO_CHUNK_FRAMES = 65536
# A progressive JPEG decodes every scan over the whole image; thousands of tiny scans turn a small file
# into minutes of CPU. Encoders write about 10.
_MAX_JPEG_SCANS = 100


# --- images -------------------------------------------------------------------------------------------


def decode_image(
    data: bytes,
    limits: MediaLimits,
    *,
    expect_size: tuple[int, int] | None = None,
    max_side: int | None = None,
    param: str | None = None,
) -> ImageInput:
    """Decode to 8-bit RGB (EXIF orientation applied; alpha dropped; gray and 16-bit converted).

    `max_side`: a larger image is scaled down (area averaging, aspect kept) so its longer side is that.
    """
    data = bytes(data)
    fmt = _image_format(data)
    if fmt is None:
        raise MediaError(_not_an_image(data), param=param)
    size = _IMAGE_SIZERS[fmt](data)
    if size is None or size[0] <= 0 or size[1] <= 0:
        raise MediaError(f"could not decode the image: its {fmt} header is malformed", param=param)
    _check_pixels(*size, limits, param)
    if fmt == "JPEG" and data.count(b"\xff\xda") > _MAX_JPEG_SCANS:
        raise MediaError(f"could not decode the image: the JPEG has more than {_MAX_JPEG_SCANS} scans", param=param)
    # OpenCV is imported with the first image: it is ~16 MB of RSS in the API process, whose text-only
    # requests never need it.
    import cv2

    try:
        # IMREAD_COLOR_RGB: 8-bit, 3 channels, RGB order, EXIF orientation applied (not for
        # IMREAD_UNCHANGED). Alpha is dropped, not composited, as llama.cpp's own loader does.
        rgb = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB)
    except cv2.error:
        rgb = None
    if rgb is None:
        raise MediaError(f"could not decode the image: the {fmt} data is truncated or corrupt", param=param)
    height, width = rgb.shape[:2]
    _check_pixels(width, height, limits, param)  # what was decoded, not only what the header said
    if expect_size is not None and (width, height) != tuple(expect_size):
        want_w, want_h = expect_size
        raise MediaError(
            f"the image is {width}x{height}; this model takes images of exactly {want_w}x{want_h} "
            "(it does not resize them): resize the image before sending it",
            param=param,
        )
    if max_side is not None and max(width, height) > max_side:
        scale = max_side / max(width, height)
        width, height = max(1, round(width * scale)), max(1, round(height * scale))
        rgb = cv2.resize(rgb, (width, height), interpolation=cv2.INTER_AREA)
    return ImageInput.of(width, height, np.ascontiguousarray(rgb, dtype=np.uint8).tobytes())


def _check_pixels(width: int, height: int, limits: MediaLimits, param: str | None) -> None:
    if width * height > limits.max_image_pixels:
        raise MediaTooLarge(
            f"the image is {width}x{height} ({width * height} pixels); the limit is {limits.max_image_pixels} pixels",
            param=param,
        )


def _not_an_image(data: bytes) -> str:
    if not data:
        return "the image is empty (0 bytes)"
    if _audio_format(data) is not None:
        return "this is audio data, not an image: send it as an audio part"
    return f"could not decode the image: it is not a {IMAGE_FORMATS} file"


_BMP_INFO_SIZES = {12, 40, 52, 56, 64, 108, 124}  # BITMAPCOREHEADER .. BITMAPV5HEADER


def _image_format(data: bytes) -> str | None:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    if data[:4] in (b"II*\0", b"MM\0*"):  # classic TIFF (BigTIFF is not accepted)
        return "TIFF"
    if data[:2] == b"BM" and _uint(data, 14, 4, "little") in _BMP_INFO_SIZES:
        return "BMP"
    return None


def _uint(data: bytes, at: int, n: int, order: Literal["little", "big"]) -> int | None:
    """An unsigned integer of n bytes at `at`, or None past the end (headers are client bytes)."""
    if at < 0 or at + n > len(data):
        return None
    return int.from_bytes(data[at : at + n], order)


def _png_size(data: bytes) -> tuple[int, int] | None:
    # The signature is followed by the IHDR chunk: length, "IHDR", width, height (big-endian).
    if data[12:16] != b"IHDR":
        return None
    return _pair(_uint(data, 16, 4, "big"), _uint(data, 20, 4, "big"))


def _gif_size(data: bytes) -> tuple[int, int] | None:
    # The logical screen, which is the canvas OpenCV decodes frames onto.
    return _pair(_uint(data, 6, 2, "little"), _uint(data, 8, 2, "little"))


def _bmp_size(data: bytes) -> tuple[int, int] | None:
    if _uint(data, 14, 4, "little") == 12:  # OS/2 core header: 16-bit sizes
        return _pair(_uint(data, 18, 2, "little"), _uint(data, 20, 2, "little"))
    if len(data) < 26:
        return None
    width = int.from_bytes(data[18:22], "little", signed=True)
    height = int.from_bytes(data[22:26], "little", signed=True)
    return (width, abs(height)) if width > 0 else None  # a negative height means top-down rows


def _webp_size(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8 ":  # lossy: frame tag (3 bytes), start code 9d 01 2a, 14-bit width and height
        if data[23:26] != b"\x9d\x01\x2a":
            return None
        width, height = _uint(data, 26, 2, "little"), _uint(data, 28, 2, "little")
        return None if width is None or height is None else (width & 0x3FFF, height & 0x3FFF)
    if chunk == b"VP8L":  # lossless: signature 0x2f, then width-1 and height-1 in 14 bits each
        bits = _uint(data, 21, 4, "little")
        if data[20:21] != b"\x2f" or bits is None:
            return None
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":  # extended (alpha, animation): canvas width-1 and height-1 in 24 bits each
        width, height = _uint(data, 24, 3, "little"), _uint(data, 27, 3, "little")
        return None if width is None or height is None else (width + 1, height + 1)
    return None


_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_JPEG_STANDALONE = {0x01, *range(0xD0, 0xD8)}  # TEM, RST0-7: markers without a length


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    # Walk the marker segments by their lengths up to the frame header (SOFn). Walking, not searching
    # for FF C0, so the EXIF thumbnail's own SOF inside APP1 is skipped.
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        at += 2
        if marker in _JPEG_STANDALONE:
            continue
        if marker in (0xD9, 0xDA):  # end of image or start of scan before any frame header
            return None
        length = _uint(data, at, 2, "big")
        if length is None or length < 2:
            return None
        if marker in _JPEG_SOF:  # length, precision, height, width
            height, width = _uint(data, at + 3, 2, "big"), _uint(data, at + 5, 2, "big")
            return None if width is None or height is None else (width, height)
        at += length
    return None


def _tiff_size(data: bytes) -> tuple[int, int] | None:
    # The first IFD (the page OpenCV decodes): its ImageWidth (256) and ImageLength (257) entries.
    order: Literal["little", "big"] = "little" if data[:2] == b"II" else "big"
    ifd = _uint(data, 4, 4, order)
    count = None if ifd is None else _uint(data, ifd, 2, order)
    if ifd is None or count is None:
        return None
    found: dict[int, int] = {}
    for entry in range(ifd + 2, ifd + 2 + 12 * count, 12):
        tag, kind = _uint(data, entry, 2, order), _uint(data, entry + 2, 2, order)
        if tag is None:
            return None
        if tag in (256, 257) and kind in (3, 4):  # SHORT or LONG, stored in the entry itself
            value = _uint(data, entry + 8, 2 if kind == 3 else 4, order)
            if value is None:
                return None
            found[tag] = value
            if len(found) == 2:
                break
    return _pair(found.get(256), found.get(257))


def _pair(width: int | None, height: int | None) -> tuple[int, int] | None:
    return None if width is None or height is None else (width, height)


_IMAGE_SIZERS: dict[str, Callable[[bytes], tuple[int, int] | None]] = {
    "PNG": _png_size,
    "JPEG": _jpeg_size,
    "GIF": _gif_size,
    "BMP": _bmp_size,
    "WebP": _webp_size,
    "TIFF": _tiff_size,
}


# --- audio --------------------------------------------------------------------------------------------


def decode_audio(data: bytes, limits: MediaLimits, *, sample_rate: int, param: str | None = None) -> AudioInput:
    """Decode to mono float32 at `sample_rate` Hz (the audio encoder's rate)."""
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    data = bytes(data)
    if not data:
        raise MediaError("the audio is empty (0 bytes)", param=param)
    if _image_format(data) is not None:
        raise MediaError("this is image data, not audio: send it as an image part", param=param)
    declared = _declared_seconds(data)
    if declared is not None and declared > limits.max_audio_seconds + _DURATION_SLACK_S:
        raise _too_long(declared, limits, param)
    pcm = _decode_pcm(data, limits, sample_rate, param)
    if pcm.size == 0:
        raise MediaError("the audio is empty (0 samples)", param=param)
    if not np.isfinite(pcm).all():  # float WAVs can carry NaN/inf; the encoder would turn them into NaN
        pcm = np.nan_to_num(pcm, nan=0.0, posinf=1.0, neginf=-1.0)
    return AudioInput.of(sample_rate, pcm.astype(np.float32, copy=False).tobytes())


def _audio_format(data: bytes) -> str | None:
    if data[:4] in (b"RIFF", b"RF64") and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"OggS":
        return "ogg"
    if data[:3] == b"ID3" or (len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):  # MPEG sync
        return "mp3"
    return None


# miniaudio's header readers per format; mp3_get_info counts frames without decoding them (2 ms for 10 minutes)
_AUDIO_INFO = {"wav": "wav_get_info", "flac": "flac_get_info", "ogg": "vorbis_get_info", "mp3": "mp3_get_info"}


def _miniaudio():
    """miniaudio, imported when audio first arrives: the Ratio1 node's venv (requirements/ratio1.lock.txt)
    runs the serving plugin, which imports this module, without it."""
    import miniaudio

    return miniaudio


def _declared_seconds(data: bytes) -> float | None:
    """The duration the file states (None when unknown: then the streaming decode enforces the limit)."""
    fmt = _audio_format(data)
    if fmt is None:
        return None
    miniaudio = _miniaudio()
    try:
        info = getattr(miniaudio, _AUDIO_INFO[fmt])(data)
    except miniaudio.MiniaudioError:
        return None  # the decoder gives the verdict, with the clear message
    return info.num_frames / info.sample_rate if info.sample_rate else None


def _decode_pcm(data: bytes, limits: MediaLimits, sample_rate: int, param: str | None) -> np.ndarray:
    max_frames = int((limits.max_audio_seconds + _DURATION_SLACK_S) * sample_rate)
    miniaudio = _miniaudio()
    try:
        stream = miniaudio.stream_memory(
            data,
            output_format=miniaudio.SampleFormat.FLOAT32,
            nchannels=1,
            sample_rate=sample_rate,
            frames_to_read=_AUDIO_CHUNK_FRAMES,
        )
    except miniaudio.MiniaudioError:
        raise MediaError(f"could not decode the audio: it is not a {AUDIO_FORMATS} file", param=param) from None
    chunks: list[array.array] = []
    frames = 0
    try:
        for chunk in stream:
            frames += len(chunk)
            if frames > max_frames:
                raise _too_long(None, limits, param)
            chunks.append(chunk)
    except miniaudio.MiniaudioError:
        raise MediaError("could not decode the audio: the data is corrupt", param=param) from None
    finally:
        stream.close()  # frees the decoder now, also when stopped at the limit
    return np.concatenate([np.frombuffer(c, np.float32) for c in chunks]) if chunks else np.zeros(0, np.float32)


def _too_long(seconds: float | None, limits: MediaLimits, param: str | None) -> MediaTooLarge:
    limit = f"{limits.max_audio_seconds:g} s"
    if seconds is None:  # found while decoding: the file did not state its length
        return MediaTooLarge(f"the audio is longer than the limit of {limit}", param=param)
    return MediaTooLarge(f"the audio is {seconds:.1f} s long; the limit is {limit}", param=param)

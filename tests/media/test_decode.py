"""decode_image / decode_audio / sniff_kind on real files the tests write (cv2.imwrite, wave, sox)."""

from __future__ import annotations

import io
import random
import shutil
import struct
import subprocess
import time
import wave
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest

from edgellm.media import decode as decode_mod
from edgellm.media.decode import _audio_format, _image_format, decode_audio, decode_image
from edgellm.media.errors import MediaError, MediaTooLarge
from edgellm.media.limits import MediaLimits

LIMITS = MediaLimits()
W, H = 64, 32

# --- images -------------------------------------------------------------------------------------------


def sniff_kind(data: bytes) -> str | None:
    """ "image" or "audio" by the magic bytes the decoders check first (the product has no use for
    this on its own; the tests check the format detection through it)."""
    if _image_format(data) is not None:
        return "image"
    if _audio_format(data) is not None:
        return "audio"
    return None


def _quadrants() -> np.ndarray:
    """An RGB image whose four quadrants have different colours (orientation shows)."""
    rgb = np.zeros((H, W, 3), np.uint8)
    rgb[: H // 2, : W // 2] = (255, 0, 0)  # top-left red
    rgb[: H // 2, W // 2 :] = (0, 255, 0)  # top-right green
    rgb[H // 2 :, : W // 2] = (0, 0, 255)  # bottom-left blue
    rgb[H // 2 :, W // 2 :] = (255, 255, 255)
    return rgb


def _write(tmp_path: Path, name: str, pixels: np.ndarray, params: tuple[int, ...] = ()) -> bytes:
    path = tmp_path / name
    assert cv2.imwrite(str(path), pixels, list(params))
    return path.read_bytes()


def _write_rgb(tmp_path: Path, name: str, rgb: np.ndarray) -> bytes:
    return _write(tmp_path, name, cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))


def _pixels(image) -> np.ndarray:
    return np.frombuffer(image.rgb, np.uint8).reshape(image.height, image.width, 3)


@pytest.mark.parametrize("name,tolerance", [("a.png", 0), ("a.bmp", 0), ("a.tiff", 0), ("a.jpg", 12), ("a.webp", 12)])
def test_formats_decode_to_rgb(tmp_path, name, tolerance):
    rgb = _quadrants()
    image = decode_image(_write_rgb(tmp_path, name, rgb), LIMITS)
    assert (image.width, image.height, image.kind) == (W, H, "image")
    assert len(image.rgb) == W * H * 3
    # Compare away from the quadrant edges (lossy codecs blur them).
    for y, x in ((4, 4), (4, W - 5), (H - 5, 4), (H - 5, W - 5)):
        assert np.abs(_pixels(image)[y, x].astype(int) - rgb[y, x]).max() <= tolerance, (name, y, x)


def test_same_pixels_same_content_id(tmp_path):
    rgb = _quadrants()
    png = decode_image(_write_rgb(tmp_path, "a.png", rgb), LIMITS)
    bmp = decode_image(_write_rgb(tmp_path, "a.bmp", rgb), LIMITS)
    assert png.content_id == bmp.content_id


def test_gray_rgba_and_16bit_png_come_out_as_8bit_rgb(tmp_path):
    gray = np.full((H, W), 77, np.uint8)
    assert (_pixels(decode_image(_write(tmp_path, "g.png", gray), LIMITS)) == 77).all()

    bgra = np.zeros((H, W, 4), np.uint8)
    bgra[..., :3] = (30, 20, 10)  # BGR
    bgra[..., 3] = 0  # fully transparent: the colour is kept, alpha dropped
    assert (_pixels(decode_image(_write(tmp_path, "a.png", bgra), LIMITS)) == (10, 20, 30)).all()

    deep = np.zeros((H, W, 3), np.uint16)
    deep[...] = (0, 0x8000, 0xFFFF)  # BGR
    data = _write(tmp_path, "d.png", deep)
    assert data[24] == 16  # IHDR bit depth: it really is a 16-bit PNG
    out = _pixels(decode_image(data, LIMITS))
    assert out.dtype == np.uint8 and (out == (255, 128, 0)).all()


def _with_exif_orientation(jpeg: bytes, orientation: int) -> bytes:
    """The JPEG with an APP1 Exif segment holding one IFD entry: Orientation (0x0112, SHORT)."""
    ifd = struct.pack(">H", 1) + struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(">I", 0)
    tiff = b"MM\x00\x2a" + struct.pack(">I", 8) + ifd  # big-endian TIFF header, first IFD at offset 8
    payload = b"Exif\x00\x00" + tiff
    app1 = b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload
    assert jpeg[:2] == b"\xff\xd8"
    return jpeg[:2] + app1 + jpeg[2:]


def test_jpeg_exif_orientation_is_applied(tmp_path):
    plain = _write_rgb(tmp_path, "a.jpg", _quadrants())
    upright = _pixels(decode_image(plain, LIMITS))
    rotated = decode_image(_with_exif_orientation(plain, 6), LIMITS)
    # Orientation 6: the stored image is shown turned 90 degrees clockwise.
    assert (rotated.width, rotated.height) == (H, W)
    assert np.array_equal(_pixels(rotated), np.rot90(upright, k=-1))
    # The red top-left quadrant is now top-right.
    assert _pixels(rotated)[4, H - 5].tolist() == pytest.approx([255, 0, 0], abs=12)
    assert _with_exif_orientation(plain, 1) != plain
    assert np.array_equal(_pixels(decode_image(_with_exif_orientation(plain, 1), LIMITS)), upright)


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _huge_png(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 100_000, 9)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def _huge_jpeg(tmp_path: Path) -> bytes:
    data = bytearray(_write_rgb(tmp_path, "a.jpg", _quadrants()))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", 60000, 60000)  # height, width
    return bytes(data)


def _huge_gif(tmp_path: Path) -> bytes:
    data = bytearray(_write_rgb(tmp_path, "a.gif", _quadrants()))
    data[6:10] = struct.pack("<HH", 65535, 65535)
    return bytes(data)


def _huge_bmp(tmp_path: Path) -> bytes:
    data = bytearray(_write_rgb(tmp_path, "a.bmp", _quadrants()))
    data[18:26] = struct.pack("<ii", 50000, -50000)  # negative height: top-down rows
    return bytes(data)


def _huge_webp() -> bytes:
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\0" * 4 + (49999).to_bytes(3, "little") * 2
    return b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x


def _huge_tiff() -> bytes:
    entries = [struct.pack("<HHII", tag, 4, 1, 50000) for tag in (256, 257)]
    return b"II*\0" + struct.pack("<I", 8) + struct.pack("<H", 2) + b"".join(entries) + struct.pack("<I", 0)


@pytest.mark.parametrize("fmt", ["png", "jpeg", "gif", "bmp", "webp", "tiff"])
def test_huge_declared_size_is_refused_before_decoding(tmp_path, fmt):
    data = {
        "png": lambda: _huge_png(50000, 50000),
        "jpeg": lambda: _huge_jpeg(tmp_path),
        "gif": lambda: _huge_gif(tmp_path),
        "bmp": lambda: _huge_bmp(tmp_path),
        "webp": _huge_webp,
        "tiff": _huge_tiff,
    }[fmt]()
    assert sniff_kind(data) == "image"
    start = time.monotonic()
    with pytest.raises(MediaTooLarge) as caught:
        decode_image(data, LIMITS, param="image_url")
    # Refused from its header, before any pixel is decoded (that would take seconds and GBs); VM slack.
    assert time.monotonic() - start < 2.0
    assert caught.value.http_status == 413 and caught.value.error_type == "media_too_large"
    assert caught.value.param == "image_url"
    assert "the limit is 16777216 pixels" in caught.value.message


def test_pixel_limit_names_size_and_limit(tmp_path):
    with pytest.raises(MediaTooLarge, match=r"64x32 \(2048 pixels\); the limit is 1000 pixels"):
        decode_image(_write_rgb(tmp_path, "a.png", _quadrants()), MediaLimits(max_image_pixels=1000))
    assert decode_image(_write_rgb(tmp_path, "a.png", _quadrants()), MediaLimits(max_image_pixels=2048)).width == W


def test_expect_size(tmp_path):
    data = _write_rgb(tmp_path, "a.png", _quadrants())
    assert decode_image(data, LIMITS, expect_size=(W, H)).width == W
    with pytest.raises(MediaError, match=r"the image is 64x32; this model takes images of exactly 32x32") as caught:
        decode_image(data, LIMITS, expect_size=(32, 32), param="p")
    assert caught.value.http_status == 400 and caught.value.param == "p"


@pytest.mark.parametrize("name", ["a.png", "a.jpg", "a.webp", "a.gif", "a.bmp", "a.tiff"])
def test_truncated_image_is_a_media_error(tmp_path, name):
    data = _write_rgb(tmp_path, name, _quadrants())
    for cut in (len(data) // 2, 40, 12):
        with pytest.raises(MediaError, match="could not decode the image"):
            decode_image(data[:cut], LIMITS)


def test_not_an_image():
    with pytest.raises(MediaError, match="PNG, JPEG, GIF, BMP, WebP or TIFF"):
        decode_image(b"this is not an image at all", LIMITS)
    with pytest.raises(MediaError, match="PNG, JPEG, GIF, BMP, WebP or TIFF"):
        decode_image(b"P6\n2 2\n255\n" + b"\0" * 12, LIMITS)  # PPM: OpenCV reads it, its size is not checked
    with pytest.raises(MediaError, match="empty"):
        decode_image(b"", LIMITS)
    with pytest.raises(MediaError, match="audio data, not an image"):
        decode_image(_wav_bytes(0.1), LIMITS)


@pytest.mark.parametrize("magic", [b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"BM", b"II*\0", b"MM\0*"])
def test_garbage_after_a_magic_is_only_ever_a_media_error(magic):
    rng = random.Random(magic)
    for _ in range(100):
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(60)))
        if magic == b"BM":
            body = body[:12] + struct.pack("<I", 40) + body[16:]
        try:
            decode_image(magic + body, LIMITS)
        except (MediaError, MediaTooLarge):
            pass
    for chunk in (b"VP8 ", b"VP8L", b"VP8X", b"ABCD"):
        for n in range(0, 30, 3):
            with pytest.raises((MediaError, MediaTooLarge)):
                decode_image(b"RIFF\0\0\0\0WEBP" + chunk + bytes(rng.randrange(256) for _ in range(n)), LIMITS)


# --- audio --------------------------------------------------------------------------------------------

RATE = 16000


def _wav_bytes(seconds: float, rate: int = 44100, channels: int = 2, freq: float = 440.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    mono = (np.sin(2 * np.pi * freq * t) * 0.5 * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(mono[:, None], channels, axis=1).tobytes())
    return buf.getvalue()


def _float_wav(samples: np.ndarray, rate: int = RATE) -> bytes:
    """A mono IEEE-float WAV (format tag 3), which the stdlib wave module cannot write."""
    body = samples.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    chunks = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(body)) + body
    return b"RIFF" + struct.pack("<I", len(chunks)) + chunks


def _peak_hz(audio) -> float:
    x = np.frombuffer(audio.samples, np.float32)
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / audio.sample_rate)[spectrum.argmax()])


@pytest.fixture(scope="module")
def wav_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("audio") / "sine.wav"
    path.write_bytes(_wav_bytes(1.0))
    return path


def test_wav_is_resampled_to_mono(wav_path):
    audio = decode_audio(wav_path.read_bytes(), LIMITS, sample_rate=RATE)
    assert audio.kind == "audio" and audio.sample_rate == RATE
    assert abs(audio.n_samples - 16000) <= 16
    assert abs(_peak_hz(audio) - 440) < 5
    x = np.frombuffer(audio.samples, np.float32)
    assert 0.4 < np.abs(x).max() < 0.6  # two equal channels averaged: the amplitude stays 0.5


@pytest.mark.parametrize("ext", ["mp3", "flac", "ogg"])
def test_compressed_audio_via_sox(wav_path, tmp_path, ext):
    if shutil.which("sox") is None:  # a missing tool fails, as everywhere in the suite (make system-deps)
        pytest.fail("sox is not installed: `make system-deps` installs the Debian packages sox, libsox-fmt-mp3")
    out = tmp_path / f"sine.{ext}"
    subprocess.run(["sox", str(wav_path), str(out)], check=True, capture_output=True, timeout=30)
    data = out.read_bytes()
    assert sniff_kind(data) == "audio"
    audio = decode_audio(data, LIMITS, sample_rate=RATE)
    assert abs(audio.n_samples - 16000) <= 800  # mp3 adds its encoder delay and padding
    assert abs(_peak_hz(audio) - 440) < 5


def test_too_long_audio_is_refused_from_the_header(wav_path):
    with pytest.raises(MediaTooLarge, match=r"the audio is 1.0 s long; the limit is 0.5 s") as caught:
        decode_audio(wav_path.read_bytes(), MediaLimits(max_audio_seconds=0.5), sample_rate=RATE, param="audio")
    assert caught.value.http_status == 413 and caught.value.param == "audio"
    assert decode_audio(wav_path.read_bytes(), MediaLimits(max_audio_seconds=1.0), sample_rate=RATE).n_samples


def test_too_long_audio_without_a_stated_length_stops_while_decoding(wav_path, monkeypatch):
    monkeypatch.setattr(decode_mod, "_declared_seconds", lambda data: None)
    with pytest.raises(MediaTooLarge, match=r"longer than the limit of 0.5 s"):
        decode_audio(wav_path.read_bytes(), MediaLimits(max_audio_seconds=0.5), sample_rate=RATE)


def test_empty_and_garbage_audio():
    with pytest.raises(MediaError, match="empty"):
        decode_audio(b"", LIMITS, sample_rate=RATE)
    with pytest.raises(MediaError, match=r"empty \(0 samples\)"):
        decode_audio(_wav_bytes(0.0), LIMITS, sample_rate=RATE)
    for junk in (b"definitely not audio" * 10, b"RIFF\0\0\0\0WAVE", b"fLaC" + b"\1" * 50, b"ID3" + b"\0" * 50):
        with pytest.raises(MediaError, match="could not decode the audio"):
            decode_audio(junk, LIMITS, sample_rate=RATE)
    with pytest.raises(MediaError, match="image data, not audio"):
        decode_audio(_huge_png(10, 10), LIMITS, sample_rate=RATE)
    with pytest.raises(ValueError):
        decode_audio(_wav_bytes(0.1), LIMITS, sample_rate=0)


def test_nan_samples_are_zeroed():
    samples = np.full(1600, 0.25, np.float32)
    samples[100:200] = np.nan
    samples[300] = np.inf
    out = np.frombuffer(decode_audio(_float_wav(samples), LIMITS, sample_rate=RATE).samples, np.float32)
    assert np.isfinite(out).all()
    assert out[0] == pytest.approx(0.25) and (out[100:200] == 0).all() and out[300] == 1.0


def test_sniff_kind(tmp_path, wav_path):
    assert sniff_kind(_write_rgb(tmp_path, "a.png", _quadrants())) == "image"
    assert sniff_kind(_write_rgb(tmp_path, "a.jpg", _quadrants())) == "image"
    assert sniff_kind(_huge_webp()) == "image"
    assert sniff_kind(wav_path.read_bytes()) == "audio"
    for magic in (b"ID3\x04", b"\xff\xfb\x90\x00", b"fLaC", b"OggS"):
        assert sniff_kind(magic + b"\0" * 30) == "audio"
    assert sniff_kind(b"") is None
    assert sniff_kind(b"hello") is None

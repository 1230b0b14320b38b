"""Decoded media as it crosses into the engine (and the process boundary): plain, picklable values."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ImageInput:
    """Decoded pixels: `rgb` is width*height*3 bytes, row-major RGB (what mtmd_bitmap_init takes)."""

    width: int
    height: int
    rgb: bytes = field(repr=False)
    # Content hash of the pixels (not of the file: a PNG and a JPEG of the same pixels match). The engine
    # keys its prefix KV reuse on it, so two requests with the same image share the encoded prefix.
    content_id: str = ""

    @classmethod
    def of(cls, width: int, height: int, rgb: bytes) -> ImageInput:
        if len(rgb) != width * height * 3:
            raise ValueError(f"rgb holds {len(rgb)} bytes, expected {width}x{height}x3")
        digest = hashlib.sha256(f"image:{width}x{height}:".encode() + rgb).hexdigest()
        return cls(width, height, rgb, digest)

    @property
    def kind(self) -> str:
        return "image"


@dataclass(frozen=True)
class AudioInput:
    """Decoded sound: `samples` is mono float32 PCM (native byte order) at `sample_rate` Hz."""

    sample_rate: int
    samples: bytes = field(repr=False)
    content_id: str = ""

    @classmethod
    def of(cls, sample_rate: int, samples: bytes) -> AudioInput:
        if len(samples) % 4:
            raise ValueError("samples must be float32 (a multiple of 4 bytes)")
        digest = hashlib.sha256(f"audio:{sample_rate}:".encode() + samples).hexdigest()
        return cls(sample_rate, samples, digest)

    @property
    def kind(self) -> str:
        return "audio"

    @property
    def n_samples(self) -> int:
        return len(self.samples) // 4

    @property
    def seconds(self) -> float:
        return self.n_samples / self.sample_rate if self.sample_rate else 0.0


MediaInput = ImageInput | AudioInput


@dataclass(frozen=True)
class MediaCaps:
    """What the loaded projector accepts (reported by the engine; empty when there is none)."""

    vision: bool = False
    audio: bool = False
    audio_sample_rate: int = 0  # Hz the audio encoder wants; decoding resamples to it
    image_size: int = 0  # a fixed-size projector's input side (0: unknown or dynamic resolution)
    projector_type: str = ""
    error: str | None = None  # why a configured projector is not in use

    def to_dict(self) -> dict:
        return {
            "vision": self.vision,
            "audio": self.audio,
            "audio_sample_rate": self.audio_sample_rate,
            "image_size": self.image_size,
            "projector_type": self.projector_type,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, d: dict | None) -> MediaCaps:
        d = d or {}
        return cls(
            bool(d.get("vision")),
            bool(d.get("audio")),
            int(d.get("audio_sample_rate") or 0),
            int(d.get("image_size") or 0),
            str(d.get("projector_type") or ""),
            d.get("error") or None,
        )

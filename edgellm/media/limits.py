"""How much media one request may carry, and where its bytes may come from (operator settings)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int = 10 * 1024 * 1024  # one encoded file (before base64)
    max_image_pixels: int = 16_777_216  # width * height, checked from the header before decoding
    max_audio_seconds: float = 600.0
    max_items: int = 8  # media parts in one request


@dataclass(frozen=True)
class MediaSources:
    media_dirs: tuple[str, ...] = ()  # local folders files may be read from; empty: no local files
    allow_remote: bool = False  # fetch http(s) URLs (the node then makes requests a client chooses)
    remote_timeout_s: float = 10.0  # for the whole download, redirects included

"""GGUF files split in parts (`NAME-00001-of-00003.gguf`, as `llama-gguf-split` writes them and as the
larger Qwen2.5 GGUFs are published): llama.cpp loads every part when given the first, so the node names
the first part, and pull and the memory plan need all of them."""

from __future__ import annotations

import os
import re

_PART = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_parts(filename: str) -> list[str]:
    """Every part's file name when `filename` is the first part of a split GGUF, else [filename]."""
    match = _PART.match(filename)
    if match is None or int(match["index"]) != 1 or int(match["count"]) < 1:
        return [filename]
    count = int(match["count"])
    return [f"{match['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def total_bytes(path: str) -> int:
    """The size of a model on disk: all of its parts when it is the first part of a split GGUF (a part
    that is missing is llama.cpp's error to report at load; here it counts as nothing)."""
    folder, name = os.path.split(path)
    parts = split_parts(name)
    if len(parts) == 1:
        return os.path.getsize(path)
    return sum(os.path.getsize(p) for p in (os.path.join(folder, n) for n in parts) if os.path.isfile(p))

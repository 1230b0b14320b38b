"""Values from a GGUF file's header, read without loading it (model and projector files alike)."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING = 8
_GGUF_ARRAY = 9


def _read(f: BinaryIO, fmt: str):
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _read_str(f: BinaryIO) -> str:
    return f.read(_read(f, "<Q")).decode("utf-8", "replace")


def _skip(f: BinaryIO, vtype: int) -> None:
    if vtype == _GGUF_STRING:
        f.seek(_read(f, "<Q"), 1)
    elif vtype == _GGUF_ARRAY:
        item, count = _read(f, "<I"), _read(f, "<Q")
        if item in _GGUF_SCALAR:
            f.seek(struct.calcsize(_GGUF_SCALAR[item]) * count, 1)
        else:
            for _ in range(count):
                _skip(f, item)
    else:
        f.seek(struct.calcsize(_GGUF_SCALAR[vtype]), 1)


def _keys(f: BinaryIO, path: str | Path) -> Iterator[tuple[str, int]]:
    """(key, value type) of each header entry, the file positioned at its value: the consumer reads or
    `_skip`s that value before asking for the next key."""
    if f.read(4) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    version = _read(f, "<I")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is too old")
    _read(f, "<Q")  # n_tensors
    for _ in range(_read(f, "<Q")):
        key = _read_str(f)
        yield key, _read(f, "<I")


def read_metadata(path: str | Path, wanted: Iterable[str]) -> dict[str, object]:
    """Scalar and string values of the wanted GGUF keys, reading the header only (GGUFReader parses every array,
    the tokenizer's included, which takes seconds on a model file). Stops once all wanted keys are found."""
    wanted = set(wanted)
    found: dict[str, object] = {}
    with open(path, "rb") as f:
        for key, vtype in _keys(f, path):
            if key in wanted and vtype in _GGUF_SCALAR:
                found[key] = _read(f, _GGUF_SCALAR[vtype])
            elif key in wanted and vtype == _GGUF_STRING:
                found[key] = _read_str(f)
            else:
                _skip(f, vtype)
            if wanted <= found.keys():
                break
    return found


def array_length(path: str | Path, key: str) -> int | None:
    """Item count of an array-valued GGUF key (e.g. `tokenizer.ggml.tokens`, whose length is the vocabulary
    size when `{arch}.vocab_size` is absent), read from the array's own header without reading its items.
    None when the key is missing or not an array."""
    with open(path, "rb") as f:
        for name, vtype in _keys(f, path):
            if name == key:
                if vtype != _GGUF_ARRAY:
                    return None
                _read(f, "<I")  # item type
                return int(_read(f, "<Q"))
            _skip(f, vtype)
    return None

"""Values from a GGUF file's header, read without loading it (model and projector files alike)."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_metadata(path: str | Path, wanted: Iterable[str]) -> dict[str, object]:
    """Scalar and string values of the wanted GGUF keys, reading the header only (GGUFReader parses every array,
    the tokenizer's included, which takes seconds on a model file). Stops once all wanted keys are found."""
    wanted = set(wanted)
    found: dict[str, object] = {}
    with open(path, "rb") as f:

        def read(fmt: str):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def read_str() -> str:
            return f.read(read("<Q")).decode("utf-8", "replace")

        def skip(vtype: int) -> None:
            if vtype == 8:
                f.seek(read("<Q"), 1)
            elif vtype == 9:
                item, count = read("<I"), read("<Q")
                if item in _GGUF_SCALAR:
                    f.seek(struct.calcsize(_GGUF_SCALAR[item]) * count, 1)
                else:
                    for _ in range(count):
                        skip(item)
            else:
                f.seek(struct.calcsize(_GGUF_SCALAR[vtype]), 1)

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version = read("<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old")
        read("<Q")  # n_tensors
        for _ in range(read("<Q")):
            key, vtype = read_str(), read("<I")
            if key in wanted and vtype in _GGUF_SCALAR:
                found[key] = read(_GGUF_SCALAR[vtype])
            elif key in wanted and vtype == 8:
                found[key] = read_str()
            else:
                skip(vtype)
            if wanted <= found.keys():
                break
    return found

"""Values from a GGUF file's header, read without loading it (model and projector files alike)."""

from __future__ import annotations

import mmap
import os
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


def _value(f: BinaryIO, vtype: int) -> object:
    """The value at the file's position: a scalar, a string, or a tuple for an array of scalars; None (the
    value skipped) for an array of strings or arrays (a tokenizer's vocabulary: no caller wants it whole)."""
    if vtype in _GGUF_SCALAR:
        return _read(f, _GGUF_SCALAR[vtype])
    if vtype == _GGUF_STRING:
        return _read_str(f)
    item, count = _read(f, "<I"), _read(f, "<Q")
    if item in _GGUF_SCALAR:
        fmt = _GGUF_SCALAR[item]
        return struct.unpack(f"<{count}{fmt[1]}", f.read(struct.calcsize(fmt) * count))
    for _ in range(count):
        _skip(f, item)
    return None


def read_header(
    path: str | Path, wanted: Iterable[str], *, tensors: bool = False
) -> tuple[dict[str, object], dict[str, tuple[int, ...]]]:
    """(the wanted keys' values, see _value; with `tensors`, each tensor's shape by name, outermost dimension
    first: numpy's and Hugging Face's order, the reverse of GGUF's ne[]). Raises ValueError, or struct.error
    on a truncated file. Without `tensors` it stops once all wanted keys are found."""
    wanted = set(wanted)
    found: dict[str, object] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version = _read(f, "<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old")
        n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
        for _ in range(n_kv):
            key, vtype = _read_str(f), _read(f, "<I")
            if key in wanted:
                value = _value(f, vtype)
                if value is not None:
                    found[key] = value
            else:
                _skip(f, vtype)
            if not tensors and wanted <= found.keys():
                return found, shapes
        for _ in range(n_tensors if tensors else 0):
            name = _read_str(f)
            n_dims = _read(f, "<I")
            if n_dims > 8:
                raise ValueError(f"{path}: corrupt GGUF tensor table (a tensor of {n_dims} dimensions)")
            dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
            f.seek(4 + 8, 1)  # its ggml type and data offset
            shapes[name] = tuple(int(d) for d in reversed(dims))
    return found, shapes


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


def read_scalars(path: str | Path, *, max_string: int = 65_536) -> dict[str, object]:
    """Every header key's value, for showing a model (Ollama's /api/show model_info): scalars and strings
    as they are (a string longer than `max_string` characters cut), each array as None (a tokenizer's
    vocabulary is megabytes nobody reads there). Raises ValueError, or struct.error on a truncated file."""
    found: dict[str, object] = {}
    with open(path, "rb") as f:
        for key, vtype in _keys(f, path):
            if vtype in _GGUF_SCALAR:
                found[key] = _read(f, _GGUF_SCALAR[vtype])
            elif vtype == _GGUF_STRING:
                found[key] = _read_str(f)[:max_string]
            else:
                _skip(f, vtype)
                found[key] = None
    return found


# (values per block, bytes per block) of the ggml tensor types, by their GGUF type id (ggml.h). Types
# missing here (newer ones) are sized 0: the check below then under-estimates, it never refuses a
# file llama.cpp would load.
_GGML_BLOCK = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    15: (256, 292),  # Q8_K
    16: (256, 66),  # IQ2_XXS
    17: (256, 74),  # IQ2_XS
    18: (256, 98),  # IQ3_XXS
    19: (256, 50),  # IQ1_S
    20: (32, 18),  # IQ4_NL
    21: (256, 110),  # IQ3_S
    22: (256, 82),  # IQ2_S
    23: (256, 136),  # IQ4_XS
    24: (1, 1),  # I8
    25: (1, 2),  # I16
    26: (1, 4),  # I32
    27: (1, 8),  # I64
    28: (1, 8),  # F64
    29: (256, 56),  # IQ1_M
    30: (1, 2),  # BF16
    34: (256, 54),  # TQ1_0
    35: (256, 66),  # TQ2_0
    39: (32, 17),  # MXFP4
}
_GGUF_DEFAULT_ALIGNMENT = 32


class _Truncated(Exception):
    """A read ran past the end of the file."""


def check_gguf_file(path: str | Path) -> None:
    """Raise ValueError, naming the file and what is wrong, when it is not a loadable GGUF file: empty, not
    GGUF, a version llama.cpp no longer reads, or truncated (it ends inside its header, or before the
    end of the tensor data its own tensor table describes: an interrupted download or copy, whose header
    still parses). Reads the header and tensor table only (mmap: a few ms for a tokenizer of 50k strings).
    """
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"{path}: empty file (0 bytes), not a GGUF model")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (it starts with {bytes(m[:4])!r}, not b'GGUF')")
        try:
            data_start, data_end = _tensor_layout(m, path)
        except _Truncated:
            raise ValueError(f"{path}: truncated: the file ends inside its GGUF header ({size} bytes)") from None
    if data_end and data_start + data_end > size:  # no tensor data (a tiny test file): nothing to hold
        need = data_start + data_end
        raise ValueError(
            f"{path}: truncated: its tensor table needs at least {need} bytes, the file has {size} "
            f"({100 * size / need:.0f}%): an interrupted download or copy?"
        )


def _tensor_layout(m, path: str | Path) -> tuple[int, int]:
    """(where the tensor data starts, where the last tensor's data ends relative to that)."""
    size = len(m)
    pos = 4

    def take(fmt: str):
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > size:
            raise _Truncated
        value = struct.unpack_from(fmt, m, pos)[0]
        pos += n
        return value

    def skip_str() -> None:
        nonlocal pos
        n = take("<Q")
        if pos + n > size:
            raise _Truncated
        pos += n

    def skip_value(vtype: int) -> None:
        nonlocal pos
        if vtype == _GGUF_STRING:
            skip_str()
        elif vtype == _GGUF_ARRAY:
            item, count = take("<I"), take("<Q")
            if item in _GGUF_SCALAR:
                pos += struct.calcsize(_GGUF_SCALAR[item]) * count
                if pos > size:
                    raise _Truncated
            elif item in (_GGUF_STRING, _GGUF_ARRAY):
                if count > size - pos:  # each item takes at least one byte: garbage, not a count
                    raise _Truncated
                for _ in range(count):
                    skip_value(item)
            else:
                raise ValueError(f"{path}: corrupt GGUF header (array of unknown type {item})")
        elif vtype in _GGUF_SCALAR:
            take(_GGUF_SCALAR[vtype])
        else:
            raise ValueError(f"{path}: corrupt GGUF header (value of unknown type {vtype})")

    version = take("<I")
    if not 2 <= version <= 3:
        raise ValueError(f"{path}: GGUF version {version} is not one llama.cpp reads (2 or 3)")
    n_tensors, n_kv = take("<Q"), take("<Q")
    if n_tensors > size or n_kv > size:
        raise ValueError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys in {size} bytes)")
    alignment = _GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key_len = take("<Q")
        if pos + key_len > size:
            raise _Truncated
        key = bytes(m[pos : pos + key_len])
        pos += key_len
        vtype = take("<I")
        if key == b"general.alignment" and vtype == 4:  # uint32
            alignment = take("<I") or _GGUF_DEFAULT_ALIGNMENT
        else:
            skip_value(vtype)
    data_end = 0
    for _ in range(n_tensors):
        skip_str()  # name
        n_dims = take("<I")
        if n_dims > 8:
            raise ValueError(f"{path}: corrupt GGUF tensor table (a tensor of {n_dims} dimensions)")
        elements = 1
        for _ in range(n_dims):
            elements *= take("<Q")
        ggml_type, offset = take("<I"), take("<Q")
        block, block_bytes = _GGML_BLOCK.get(ggml_type, (1, 0))
        data_end = max(data_end, offset + -(-elements // block) * block_bytes)
    return -(-pos // alignment) * alignment, data_end

"""LoRA adapters, PEFT safetensors made into GGUF adapters llama.cpp can load (no torch).

An adapter reaches the engine as a path (TensorRT-Edge-LLM's batch JSON `available_lora_weights`). Three steps,
a module each:

1. `resolve_adapter_path` (engine/lora_paths.py) decides whether the path may be used at all: relative to the
   input file's folder, symlinks resolved, inside one of the operator's allowed directories, an existing file
   (or a PEFT folder).
2. `gguf_adapter` (this module) gives llama.cpp a file it can load: a GGUF LoRA adapter is checked against the
   model and used as is; PEFT's `adapter_model.safetensors` + `adapter_config.json` is converted with numpy and
   the `gguf` package (no torch) into a cache folder, once per (adapter bytes, config, model shape).
3. `load_adapter` / `apply_adapters` / `free_adapter` (and `AdapterCache` over them, engine/lora_adapters.py)
   drive llama.cpp.

Steps 1 and 2 never import llama_cpp (the API process must not); step 3 imports it when called.

Conversion rules, as llama.cpp's own HF -> GGUF conversion lays the base weights out:
- PEFT `base_model.model.<module>.lora_A.weight` [r, in] / `.lora_B.weight` [out, r] become
  `<gguf tensor>.weight.lora_a` / `.lora_b`, in the same (HF) shapes, float32.
- llama.cpp computes `scale * alpha / r * B @ A @ x`, PEFT `alpha / r` (or `alpha / sqrt(r)` with rsLoRA): the
  per-module difference (rsLoRA, `alpha_pattern`) is folded into lora_B.
- For the `llama` architecture the converter reorders the rows of q_proj and k_proj within each head (HF rotates
  dimension i with i + head_dim/2, llama.cpp's rope rotates 2i with 2i+1), so lora_B of q/k gets that reordering.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from edgellm.engine.gguf_header import read_header
from edgellm.engine.lora_paths import PEFT_CONFIG
from edgellm.engine.shape import ModelShape
from edgellm.errors import LoraError

# Part of every cache key: a change to the conversion must not reuse files the previous one wrote.
CONVERTER_VERSION = "edgellm-lora-1"

# Architectures whose llama.cpp conversion permutes q/k rows for the rope layout ("normal" rope)...
ROPE_PERMUTED_ARCHS = frozenset({"llama"})
# ...and those whose conversion keeps HF's row order (NeoX-style rope): q/k adapters convert without it.
ROPE_UNPERMUTED_ARCHS = frozenset({"qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma", "gemma2", "gemma3", "phi3"})

_PEFT_PREFIX = "base_model.model."
_LORA_SUFFIXES = {".lora_A.weight": "lora_a", ".lora_B.weight": "lora_b"}
_FLOAT_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}


# -- the base model's shape, read from its GGUF -------------------------------------------------------


def _read_gguf(path: Path, keys: Iterable[str]) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """The wanted header values and the tensor shapes of a GGUF file (engine/gguf_header.py)."""
    try:
        return read_header(path, keys, tensors=True)
    except Exception as exc:  # ValueError, struct.error, UnicodeDecodeError... on a bad file
        raise LoraError(f"{path} is not a readable GGUF file ({exc})") from None


def _identity(shape: ModelShape) -> dict[str, Any]:
    """What of the base model a converted adapter depends on (part of its cache key)."""
    return {
        "arch": shape.arch,
        "n_block": shape.n_block,
        "n_embd": shape.n_embd,
        "head_count": list(shape.head_count),
        "head_count_kv": list(shape.head_count_kv),
        "converter": CONVERTER_VERSION,
    }


@functools.lru_cache(maxsize=8)
def _model_shape_cached(path: str, _mtime_ns: int, _size: int) -> ModelShape:
    try:
        return ModelShape.from_gguf(path, tensors=True)
    except (ValueError, OSError) as exc:
        raise LoraError(f"model {path}: {exc}") from None
    except Exception as exc:  # struct.error and the like: a truncated or corrupt file
        raise LoraError(f"model {path} is not a readable GGUF file ({exc})") from None


def model_shape(model_path: str | Path) -> ModelShape:
    """The base model's ModelShape, with its tensors' shapes (cached per file version)."""
    st = os.stat(model_path)
    return _model_shape_cached(os.path.realpath(model_path), st.st_mtime_ns, st.st_size)


# -- the rope row order ----------------------------------------------------------------------------------


def permute_rope_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """HF's q/k row order -> llama.cpp's, for `n_head` heads stacked along axis 0.

    Within a head of d rows, HF rotates row i together with row i + d/2; llama.cpp's "normal" rope rotates
    row 2i with row 2i + 1. So llama.cpp's row 2i is HF's row i, and its row 2i + 1 is HF's row i + d/2.
    """
    n_rows = rows.shape[0]
    if n_head <= 0 or n_rows % (2 * n_head):
        raise LoraError(f"cannot split {n_rows} rows into {n_head} rope heads of an even size")
    half = n_rows // n_head // 2
    order = np.arange(n_rows).reshape(n_head, 2, half).transpose(0, 2, 1).reshape(-1)
    return rows[order]


# -- PEFT -> GGUF --------------------------------------------------------------------------------------


def _load_config(config_path: Path) -> dict[str, Any]:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoraError(f"LoRA adapter {config_path.parent}: {PEFT_CONFIG} not found next to the safetensors") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"{config_path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraError(f"{config_path} is not a JSON object")
    return config


def _positive(value: Any, what: str, where: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise LoraError(f"{where}: {what} must be a positive number, got {value!r}")
    return float(value)


def _check_config(config: dict[str, Any], where: Path) -> None:
    """Refuse what a llama.cpp LoRA adapter cannot express."""
    for key in ("use_rslora", "use_dora", "lora_bias", "fan_in_fan_out"):
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise LoraError(f"{where}: {key} must be true or false, got {config[key]!r}")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoraError(f"{where}: only LoRA adapters are supported (peft_type is {peft_type!r})")
    if config.get("use_dora"):
        raise LoraError(f"{where}: DoRA adapters (use_dora: true) are not supported by llama.cpp")
    if config.get("modules_to_save"):
        raise LoraError(
            f"{where}: modules_to_save {config['modules_to_save']!r} are fully trained modules, which a LoRA adapter "
            "cannot carry"
        )
    for key, what in (
        ("lora_bias", "LoRA biases (lora_bias: true)"),
        ("fan_in_fan_out", "fan_in_fan_out (Conv1D) layouts"),
        ("trainable_token_indices", "trainable tokens (trainable_token_indices)"),
        ("target_parameters", "parameter targets (target_parameters)"),
        ("layer_replication", "layer_replication"),
    ):
        if config.get(key):
            raise LoraError(f"{where}: {what} are not supported by llama.cpp LoRA adapters")
    _positive(config.get("lora_alpha"), "lora_alpha", where)
    r = config.get("r")
    if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r <= 0):
        raise LoraError(f"{where}: r must be a positive integer, got {r!r}")
    for key in ("alpha_pattern", "rank_pattern"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise LoraError(f"{where}: {key} must be an object")
    for key, value in (config.get("rank_pattern") or {}).items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise LoraError(f"{where}: rank_pattern[{key!r}] must be a positive integer, got {value!r}")


def _pattern_value(patterns: dict[str, Any] | None, module: str) -> Any:
    """PEFT's rank/alpha pattern lookup: the first key that matches the end of the module name, at a dot."""
    for key, value in (patterns or {}).items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as exc:
            raise LoraError(f"adapter_config.json: pattern {key!r} is not a valid regular expression ({exc})") from None
    return None


def _read_safetensors(data: bytes, where: Path) -> Iterable[tuple[str, np.ndarray]]:
    import safetensors

    try:
        entries = safetensors.deserialize(data)
    except Exception as exc:  # SafetensorError and friends
        raise LoraError(f"{where} is not a valid safetensors file ({exc})") from None
    for name, info in entries:
        dtype, shape, raw = info["dtype"], info["shape"], info["data"]
        if dtype == "BF16":  # numpy has no bfloat16: its bits are the high half of a float32
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif dtype in _FLOAT_DTYPES:
            arr = np.frombuffer(raw, dtype=np.dtype(_FLOAT_DTYPES[dtype]).newbyteorder("<"))
        else:
            raise LoraError(f"{where}: tensor {name} has dtype {dtype}; LoRA weights must be floating point")
        yield name, arr.astype(np.float32).reshape(shape)


def _tensor_map(shape: ModelShape) -> Any:
    import gguf

    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == shape.arch), None)
    if arch is None:
        raise LoraError(f"the gguf package does not know the model's architecture {shape.arch!r}")
    return gguf.get_tensor_name_map(arch, shape.n_block)


def _split_name(name: str, where: Path) -> tuple[str, str]:
    """PEFT tensor name -> (HF module name, "lora_a" | "lora_b")."""
    if "lora_magnitude_vector" in name:
        raise LoraError(f"{where}: tensor {name} is a DoRA magnitude vector; DoRA is not supported by llama.cpp")
    if "lora_embedding_" in name:
        raise LoraError(f"{where}: tensor {name} is an embedding LoRA, which cannot be converted")
    for suffix, kind in _LORA_SUFFIXES.items():
        if name.startswith(_PEFT_PREFIX) and name.endswith(suffix):
            return name[len(_PEFT_PREFIX) : -len(suffix)], kind
    raise LoraError(
        f"{where}: unknown tensor name {name!r} (expected {_PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)"
    )


def convert_peft(weights_path: Path, config: dict[str, Any], shape: ModelShape) -> tuple[float, dict[str, np.ndarray]]:
    """PEFT tensors -> (adapter.lora.alpha, {GGUF tensor name: float32 array}) for the model of `shape`."""
    where = weights_path
    _check_config(config, where)
    alpha = float(config["lora_alpha"])
    alpha_pattern = config.get("alpha_pattern") or {}
    rank_pattern = config.get("rank_pattern") or {}
    rslora = bool(config.get("use_rslora"))
    tmap = _tensor_map(shape)

    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, arr in _read_safetensors(weights_path.read_bytes(), where):
        module, kind = _split_name(name, where)
        if kind in pairs.setdefault(module, {}):
            raise LoraError(f"{where}: tensor {name} appears twice")
        pairs[module][kind] = arr
    if not pairs:
        raise LoraError(f"{where} holds no LoRA tensors")

    out: dict[str, np.ndarray] = {}
    for module in sorted(pairs):
        if set(pairs[module]) != {"lora_a", "lora_b"}:
            missing = "lora_B" if "lora_a" in pairs[module] else "lora_A"
            raise LoraError(f"{where}: module {module} has no {missing} tensor")
        a, b = pairs[module]["lora_a"], pairs[module]["lora_b"]
        base = tmap.get_name(module)
        if base is None:
            raise LoraError(f"{where}: cannot map module {module!r} to a tensor of the {shape.arch!r} model")
        if base in ("token_embd", "output"):
            raise LoraError(f"{where}: LoRA on {module} (embeddings / lm_head) is not supported")
        target = f"{base}.weight"
        if target not in shape.shapes:
            raise LoraError(f"{where}: module {module} maps to {target}, which the model does not have")
        want = shape.shapes[target]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or len(want) != 2 or (b.shape[0], a.shape[1]) != want:
            raise LoraError(
                f"{where}: shape mismatch for {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit "
                f"the model's {target} {list(want)} (expected lora_A [r, {want[-1]}] and lora_B [{want[0]}, r]); "
                "is the adapter for another base model?"
            )
        rank = a.shape[0]
        if rank == 0:
            raise LoraError(f"{where}: {module} has rank 0 (empty lora_A / lora_B)")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise LoraError(f"{where}: {module} holds NaN or infinite weights")
        want_rank = _pattern_value(rank_pattern, module)
        want_rank = config.get("r") if want_rank is None else want_rank
        if want_rank is not None and rank != want_rank:
            raise LoraError(f"{where}: {module} has rank {rank} but adapter_config.json says r={want_rank}")
        module_alpha = _pattern_value(alpha_pattern, module)
        module_alpha = alpha if module_alpha is None else _positive(module_alpha, f"alpha_pattern for {module}", where)
        # llama.cpp applies alpha / rank; PEFT applies module_alpha / rank (or / sqrt(rank) with rsLoRA).
        factor = module_alpha / alpha * (math.sqrt(rank) if rslora else 1.0)
        if factor != 1.0:
            b = b * np.float32(factor)
        if base.endswith((".attn_q", ".attn_k")):
            if shape.arch in ROPE_PERMUTED_ARCHS:
                bid = int(base.split(".")[1])
                heads = shape.head_count[bid] if base.endswith(".attn_q") else shape.head_count_kv[bid]
                b = permute_rope_rows(b, heads)
            elif shape.arch not in ROPE_UNPERMUTED_ARCHS:
                raise LoraError(
                    f"{where}: converting q/k adapters for the {shape.arch!r} architecture is not supported (its rope "
                    "row order is unknown here); convert it with llama.cpp's convert_lora_to_gguf.py"
                )
        out[f"{target}.lora_a"] = np.ascontiguousarray(a, dtype=np.float32)
        out[f"{target}.lora_b"] = np.ascontiguousarray(b, dtype=np.float32)
    return alpha, out


def write_gguf_adapter(path: Path, arch: str, alpha: float, tensors: dict[str, np.ndarray]) -> None:
    """Write a llama.cpp LoRA adapter file (general.type adapter, adapter.type lora)."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(alpha))
    for name, arr in tensors.items():
        writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def check_gguf_adapter(path: Path, shape: ModelShape) -> None:
    """LoraError unless `path` is a GGUF LoRA adapter whose tensors fit the model of `shape`."""
    meta, tensors = _read_gguf(path, ["general.type", "adapter.type", "general.architecture"])
    general_type = meta.get("general.type")
    if general_type != "adapter":
        raise LoraError(f"{path} is not a LoRA adapter: its general.type is {general_type!r}, expected 'adapter'")
    adapter_type = meta.get("adapter.type")
    if adapter_type != "lora":
        raise LoraError(f"{path} is not a LoRA adapter: its adapter.type is {adapter_type!r}, expected 'lora'")
    arch = meta.get("general.architecture")
    if arch != shape.arch:
        raise LoraError(f"LoRA adapter {path} is for the {arch!r} architecture but the model is {shape.arch!r}")
    found: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, dims in tensors.items():
        base, _, kind = name.rpartition(".")
        if kind not in ("lora_a", "lora_b"):
            continue  # llama.cpp skips *_norm.weight and refuses anything else itself
        found.setdefault(base, {})[kind] = dims
    if not found:
        raise LoraError(f"{path} holds no LoRA tensors")
    for base, ab in sorted(found.items()):
        if set(ab) != {"lora_a", "lora_b"}:
            raise LoraError(f"{path}: {base} lacks its {'lora_b' if 'lora_a' in ab else 'lora_a'} tensor")
        want = shape.shapes.get(base)
        if want is None:
            raise LoraError(f"{path}: tensor {base} does not exist in the model")
        if base == "token_embd.weight":
            continue  # llama.cpp's own layout for embeddings; it checks the shape itself
        a, b = ab["lora_a"], ab["lora_b"]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1] or len(want) != 2 or (b[0], a[1]) != want:
            raise LoraError(
                f"{path}: shape mismatch for {base}: lora_a {list(a)} and lora_b {list(b)} do not fit the model's "
                f"{list(want)}"
            )


def _sha256_file(path: Path, h: Any) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)


def gguf_adapter(path: Path, model_path: str, cache_dir: Path) -> Path:
    """A GGUF LoRA adapter llama.cpp can load for the model at `model_path`.

    `.gguf`: checked and returned as is. `.safetensors` (PEFT, with adapter_config.json beside it): converted
    into `cache_dir/<sha256>.gguf`, keyed by the weights' bytes, the config's bytes and the model's shape, and
    reused while it exists. Anything else: LoraError.
    """
    path = Path(path)
    shape = model_shape(model_path)
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        check_gguf_adapter(path, shape)
        return path
    if suffix != ".safetensors":
        raise LoraError(
            f"LoRA adapter {path} is neither a GGUF adapter (.gguf) nor PEFT weights (.safetensors with {PEFT_CONFIG})"
        )
    config_path = path.parent / PEFT_CONFIG
    config = _load_config(config_path)
    h = hashlib.sha256()
    _sha256_file(path, h)
    h.update(b"\0config\0" + config_path.read_bytes())
    h.update(b"\0model\0" + json.dumps(_identity(shape), sort_keys=True).encode())
    out = Path(cache_dir) / f"{h.hexdigest()}.gguf"
    if out.is_file():
        return out
    alpha, tensors = convert_peft(path, config, shape)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.stem[:16]}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        write_gguf_adapter(Path(tmp), shape.arch, alpha, tensors)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out

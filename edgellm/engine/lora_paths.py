"""Which LoRA adapter files may be used at all: the operator's allowed directories, symlinks resolved.

Step 1 of an adapter's way to the engine (engine/lora.py's overview): `resolve_adapter_path` takes the
path a request names (TensorRT-Edge-LLM's batch JSON `available_lora_weights`), relative to the input
file's folder, resolves links and `..`, and refuses what lies outside the allowed directories (a PEFT
folder's weights and config checked too). A security rule, apart from the conversion: it changes with
what operators allow, not with the adapter format. Never imports llama_cpp.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from edgellm.errors import LoraError

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


def _inside(path: Path, dirs: Sequence[Path]) -> bool:
    return any(path == d or path.is_relative_to(d) for d in dirs)


def _dirs_text(dirs: Sequence[Path]) -> str:
    return ", ".join(str(d) for d in dirs) if dirs else "none configured"


def resolve_adapter_path(path: str, allowed_dirs: Sequence[str | Path], *, base_dir: Path | None = None) -> Path:
    """The real path of an adapter file the operator allows, or LoraError saying why not.

    A relative path is taken from `base_dir` (the input file's folder; the working directory if None). Symlinks
    and `..` are resolved before the check, so a link inside an allowed directory that points outside is refused.
    A directory holding PEFT's adapter_model.safetensors and adapter_config.json means that adapter.
    """
    if not isinstance(path, str) or not path.strip():
        raise LoraError("LoRA adapter path is empty")
    allowed = [Path(os.path.realpath(d)) for d in allowed_dirs]
    joined = Path(path) if os.path.isabs(path) else (base_dir or Path.cwd()) / path
    real = Path(os.path.realpath(joined))
    shown = f"{path!r}" if real == Path(path) else f"{path!r} (resolves to {real})"
    if not _inside(real, allowed):
        raise LoraError(f"LoRA adapter {shown} is outside the allowed adapter directories ({_dirs_text(allowed)})")
    if not real.exists():
        raise LoraError(f"LoRA adapter {shown} not found")
    if real.is_dir():
        weights, config = real / PEFT_WEIGHTS, real / PEFT_CONFIG
        if not (weights.is_file() and config.is_file()):
            raise LoraError(
                f"LoRA adapter {shown} is a directory without a PEFT adapter ({PEFT_WEIGHTS} + {PEFT_CONFIG})"
            )
        real = Path(os.path.realpath(weights))
        if not _inside(real, allowed):
            raise LoraError(
                f"LoRA adapter {shown}: {PEFT_WEIGHTS} resolves to {real}, outside the allowed adapter directories "
                f"({_dirs_text(allowed)})"
            )
    if not real.is_file():
        raise LoraError(f"LoRA adapter {shown} is not a regular file")
    config = real.parent / PEFT_CONFIG
    if real.suffix.lower() == ".safetensors" and config.exists():
        real_config = Path(os.path.realpath(config))
        if not _inside(real_config, allowed):
            raise LoraError(
                f"LoRA adapter {shown}: its {PEFT_CONFIG} resolves to {real_config}, outside the allowed adapter "
                f"directories ({_dirs_text(allowed)})"
            )
    return real

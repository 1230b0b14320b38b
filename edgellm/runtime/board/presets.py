"""Model presets for Jetson boards (configs/models/NAME.yaml): a recommended GGUF and the settings to
serve it with on that board. A preset is the lowest settings layer: the config file, EDGELLM_* and CLI
flags all override it. The node never downloads: a preset names the file, and `edgellm pull PRESET`
(edgellm/pull/) fetches it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from edgellm.errors import PresetError

# Installed presets (tools/install_service.sh copies them here), then the source tree's (editable
# installs, running from a checkout).
INSTALLED_DIR = Path("/etc/edgellm/models")
SOURCE_DIR = Path(__file__).resolve().parents[3] / "configs" / "models"


@dataclass(frozen=True)
class Preset:
    name: str
    path: Path
    board: str = ""
    # name, quant, expected_size_mb, and what `edgellm pull` fetches: hf_repo, file (a split GGUF's first
    # part) and sha256 (a hash, or file -> hash; absent: the hub's own X-Linked-Etag is checked)
    model: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def where_to_get(self) -> str:
        """How a user gets the preset's model, for the message when its file is missing."""
        m = self.model
        what = " ".join(str(m[k]) for k in ("name", "quant") if m.get(k)) or "the model"
        size = f", about {m['expected_size_mb'] / 1000:.1f} GB" if m.get("expected_size_mb") else ""
        source = f" from https://huggingface.co/{m['hf_repo']}" if m.get("hf_repo") else ""
        fetch = f"run `edgellm pull {self.name}`" if m.get("hf_repo") and m.get("file") else "download it"
        return f"preset {self.name} expects {m.get('file', 'its GGUF')} ({what}{size}{source}); {fetch}"


def preset_dirs() -> list[Path]:
    extra = os.environ.get("EDGELLM_PRESETS_DIR")
    return [Path(extra)] if extra else [INSTALLED_DIR, SOURCE_DIR]


def available() -> list[str]:
    names = {p.stem for d in preset_dirs() if d.is_dir() for p in d.glob("*.yaml")}
    return sorted(names)


def load_preset(name: str) -> Preset:
    """A preset by name (configs/models/NAME.yaml) or by path to such a file."""
    candidates = [Path(name)] if name.endswith((".yaml", ".yml")) else [d / f"{name}.yaml" for d in preset_dirs()]
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
        known = ", ".join(available()) or "none installed"
        raise PresetError(f"unknown preset {name!r} (presets: {known})")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise PresetError(f"preset {path} could not be read: {exc}") from None
    settings = data.get("settings") if isinstance(data, dict) else None
    if not isinstance(settings, dict):
        raise PresetError(f"preset {path} has no 'settings' mapping")
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    return Preset(path.stem, path, str(data.get("board") or ""), model, settings)

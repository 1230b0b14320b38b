"""Node settings: defaults < config file (YAML) < environment (EDGELLM_*) < CLI flags.

Built once in runtime/ and passed down; nothing below runtime/ reads the environment. The environment
is read only through names that start with EDGELLM_, plus the two upstream names the Ratio1 node
documents (INFERENCE_API_TOKEN, REQUEST_TTL_SECONDS): a stray TOKENS= or PORT= in a service's
environment must never configure auth or anything else.

This module declares every setting (the table of docs/configuration.md is generated from it), checks
them together and orders their sources; the upstream names and the preset layer are read by
runtime/settings_sources.py, and the model side (files, memory plan, the engine's ModelConfig, `models:`
entries) is runtime/model_sizing.py's ModelSizing, mixed into Settings.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from edgellm.api.envelope import ResponseMode
from edgellm.engine.memory_budget import parse_size
from edgellm.engine.memory_plan import MemoryPlan
from edgellm.errors import SettingsError
from edgellm.media.limits import MediaLimits, MediaSources
from edgellm.runtime.board.presets import PresetError, load_preset
from edgellm.runtime.model_sizing import ModelSizing, ServedModel, check_batch_fits
from edgellm.runtime.settings_sources import PresetSource, UpstreamEnvSource, file_value


def default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "edgellm")


class Settings(ModelSizing, BaseSettings):
    # No validation aliases and no populate_by_name: either one makes pydantic-settings read an
    # un-prefixed variable (an alias "tokens" is read from TOKENS=). Upstream names come from
    # UpstreamEnvSource (runtime/settings_sources.py) instead.
    model_config = SettingsConfigDict(env_prefix="EDGELLM_", extra="forbid")

    # A board preset (configs/models/NAME.yaml): its settings are the lowest layer, under this file.
    preset: str | None = None
    _plan: MemoryPlan | None = PrivateAttr(default=None)  # what model() sized the context with
    _model_from_preset: bool = PrivateAttr(default=False)  # model_path is the preset's (a missing file: say where)
    host: str = "127.0.0.1"  # the address to listen on; a non-loopback one needs a token
    port: int = Field(8765, ge=0, le=65535)  # the HTTP port
    model_path: str | None = None  # the GGUF to serve; None = the bundled SmolLM2-135M GGUF
    model_name: str | None = None  # id reported to clients; default: the GGUF file name
    # A multimodal projector GGUF made for model_path (SmolVLM, Qwen2.5-VL, Gemma 3, Ultravox...):
    # images and/or audio in content arrays. Without it the node takes text only.
    mmproj_path: str | None = None
    # The chat template instead of the GGUF's: a built-in name ("chatml") or a .jinja file's path. Unset: the
    # GGUF's own; a GGUF with none is served as ChatML, with a warning at start and in /status.
    chat_template: str | None = None
    # /v1/embeddings: a dedicated embedding GGUF (bge, nomic-embed, e5...: its own pooling); None = the
    # generation model's weights, mean-pooled. embedding_ctx: the embedding context's tokens (the longest
    # input, one batch's tokens), 0 = embeddings off. Both are in the memory plan.
    embedding_model_path: str | None = None
    embedding_ctx: int = Field(512, ge=0, le=8192)  # the embedding context's tokens; 0 = embeddings off
    media_dirs: list[str] = Field(default_factory=list, description="folders image/audio file paths may name")
    allow_remote_media: bool = False  # fetch http(s) image URLs (the node then requests what a client names)
    remote_media_timeout_s: float = Field(10.0, gt=0, le=300)  # seconds to fetch one remote image URL
    max_media_bytes: int = Field(10 * 1024 * 1024, ge=1024, description="one image/audio file, before base64")
    max_image_pixels: int = Field(16_777_216, ge=1, description="width x height of one image")
    max_audio_seconds: float = Field(600.0, gt=0)  # the length of one audio clip
    max_media_items: int = Field(8, ge=1, le=256, description="images and audio clips in one request")
    # "auto": sized to memory_budget from the model's metadata (engine/memory_plan.py).
    n_ctx: Annotated[int, Field(ge=256)] | Literal["auto"] = Field(
        8192,
        description="cells in the one KV pool all requests share (one request may use it all, up to the "
        "model's trained context); auto = the most that fit memory_budget",
    )
    n_slots: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        8, description="requests decoding at once (the batch width); auto = 4, fewer when memory_budget is short"
    )
    # What the weights, KV cache, compute buffers and runtime may use, e.g. "3GiB"; default: 75% of
    # MemAvailable (on a Jetson the GPU allocates from that same memory). The node refuses to start
    # when its plan does not fit.
    memory_budget: str | None = None
    # The CUDA runtime's share of memory_budget once layers go to a GPU (CUDA context, cuBLAS workspace,
    # llama.cpp's CUDA pools; from the same unified memory on a Jetson): see engine/memory_costs.py for the
    # figures behind the default. Planned only where a CUDA device shows and n_gpu_layers is not 0.
    cuda_context_mib: int = Field(300, ge=0, le=16384)
    n_batch: int = Field(512, ge=32)  # tokens in one llama_decode batch (at least n_slots)
    n_threads: int = Field(0, ge=0, description="0 = every core this process may use")
    # adaptive: fewer threads while other processes keep cores busy (a spinning llama.cpp barrier on a
    # shared core collapses throughput); fixed: always n_threads.
    thread_policy: Literal["adaptive", "fixed"] = "adaptive"
    # Prompt-lookup speculative decoding (engine/draft.py): same output, fewer decode steps when the
    # output copies from the input. A request can opt out with disable_spec_decode.
    speculative_decoding: bool = True
    # Draft-model speculation (engine/draft_model.py): a small GGUF with model_path's vocabulary (same
    # tokenizer: e.g. a smaller model of the same family) drafts instead of prompt lookup; the output
    # stays the same. In the memory plan. Needs speculative_decoding.
    draft_model_path: str | None = None
    # Several models (runtime/supervision/model_switch.py): requests name one by `model`; the first is the default.
    # When set, model_path/mmproj_path/draft_model_path above are not used. One model computes at a time;
    # the others stay loaded while their memory plans fit in memory_budget together (and at most
    # max_loaded_models, 0 = as many as fit), so a switch to one of them costs no reload.
    models: list[ServedModel] = Field(default_factory=list)
    max_loaded_models: int = Field(0, ge=0, le=64)  # models loaded at once (0 = as many as fit memory_budget)
    idle_unload_s: float = Field(0.0, ge=0)  # unload a model after this long without work (0 = never)
    # Other names each served model answers to, on every route and in /v1/models and /api/tags: an id -> the
    # names clients send for it (an app hard-coded to "gpt-4o-mini", Ollama's "qwen2.5:1.5b"). env:
    # EDGELLM_MODEL_ALIASES='{"SmolLM2-135M-Instruct.Q4_1.gguf": ["gpt-4o-mini", "smollm2:135m"]}'
    model_aliases: dict[str, list[str]] = Field(default_factory=dict)
    # A model name the node neither serves nor lists in model_aliases: reject = 404 naming the served ids;
    # default = the default model (the first) answers it.
    unknown_model: Literal["reject", "default"] = "reject"
    # While the loaded model has work, requests for another wait at most this long before it is drained
    # and the other loaded (0: at once); an idle worker switches at once.
    model_switch_after_s: float = Field(5.0, ge=0, le=3600)
    n_gpu_layers: int | Literal["auto"] = "auto"  # layers offloaded to the GPU; auto = all where llama.cpp can
    flash_attn: bool = True  # llama.cpp's flash attention
    # CPU attention in one kernel whatever the batch (true): a request's output does not depend on what runs
    # beside it or where its cells sit, and a preempted one goes on exactly; false: llama.cpp's kernels by
    # batch shape (engine/config.py; docs/jetson.md, "batch invariance").
    batch_invariant: bool = True
    # One KV pool for all requests (true: any request up to the whole pool, shared prefixes, preemption;
    # outputs that depend on what runs beside unless batch_invariant), or n_ctx / n_slots cells owned by
    # each slot (false): see docs/jetson.md "Context per request: one KV pool".
    kv_unified: bool = True
    kv_cache_type: Literal["f16", "q8_0", "f32"] = "f16"  # q8_0 halves KV memory for ~5% decode speed
    response_format: ResponseMode = ResponseMode.WRAPPED  # WRAPPED: in the node envelope; RAW: the result alone
    state_dir: str = Field(default_factory=default_state_dir)  # the registry, prefix cache and start record
    # Prefix KV states that survive a restart (engine/prefix_store.py), in <state_dir>/prefix-cache, at most
    # prefix_cache_mb MiB of files (least recently used evicted first).
    prefix_cache: bool = True
    prefix_cache_mb: int = Field(512, ge=1, le=1_048_576)  # the most MiB the prefix cache's files take
    # The start-up self-test (the crash guard) and decode-cost probe run once per engine build, CPU, model
    # and settings: a pass is recorded in <state_dir>/engine-start.json and a start that finds its key skips
    # both (engine/start_record.py). False: both at every start.
    start_record: bool = True
    request_timeout: float = Field(600.0, gt=0, description="default per-request timeout (s)")
    max_request_timeout: float = Field(3600.0, gt=0)  # the longest timeout a request may ask for (s)
    request_ttl: float = Field(7200.0, gt=0, description="seconds a finished request stays queryable")
    max_queued: int = Field(64, ge=1, description="requests in flight (queued + generating) before 429")
    # Per caller (token owner; all anonymous callers share one budget): POST calls per calendar minute
    # before 429 + Retry-After (api/rate_limit.py, upstream's RATE_LIMIT_PER_MINUTE). 0 = no limit.
    rate_limit_per_minute: int = Field(0, ge=0)
    max_body_bytes: int = Field(1_048_576, ge=1024)  # a request body's size before a 413
    max_messages: int = Field(512, ge=1, description="messages per request before a 400")
    max_prompt_bytes: int = Field(262_144, ge=1024, description="message content bytes (UTF-8, summed) before a 400")
    # Bounds of the request's temperature and max_tokens (upstream TEMPERATURE_MIN/MAX and
    # MIN/MAX_COMPLETION_TOKENS); the OpenAI route keeps its own floor of 1 for max_tokens.
    temperature_min: float = Field(0.0, ge=0.0)  # the lowest temperature a request may ask for
    temperature_max: float = Field(1.5, ge=0.0, le=10.0)  # the highest temperature a request may ask for
    min_completion_tokens: int = Field(16, ge=1)  # the lowest max_tokens a request may ask for
    max_completion_tokens: int = Field(4096, ge=1)  # the highest max_tokens a request may ask for
    shutdown_grace_s: int = Field(20, ge=0, description="on SIGTERM, wait this long for in-flight sync requests")
    header_timeout_s: float = Field(10.0, gt=0, description="a request's headers must arrive within this (s)")
    body_timeout_s: float = Field(30.0, gt=0, description="a request's body must arrive within this (s)")
    # Host names a loopback-bound node answers to besides localhost/127.0.0.1/[::1] ("*": any);
    # env: EDGELLM_ALLOWED_HOSTS='["node.local"]'. Refusing other names defeats DNS rebinding.
    allowed_hosts: list[str] = Field(default_factory=list)
    # Web origins (scheme://host[:port]) whose pages may call the node from a browser (CORS,
    # runtime/server/cors.py); none by default. env: EDGELLM_CORS_ORIGINS=http://a.local:3000,https://b.local
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Bearer tokens; with any set, every endpoint but /health needs one. env: comma separated.
    tokens: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # A lane per token (api/auth.py): its requests run there unless they ask for a lower one, so a batch
    # job's token cannot outrank a control loop's. Each is a valid token too. env:
    # EDGELLM_TOKEN_LANES='{"robot-secret": "realtime", "synth-secret": "batch"}'
    token_lanes: dict[Annotated[str, Field(min_length=1)], Literal["realtime", "interactive", "batch"]] = Field(
        default_factory=dict
    )
    node_alias: str = Field(default_factory=socket.gethostname)  # the node's name in WRAPPED bodies
    evm_network: str = "local"  # the network named in WRAPPED bodies
    log_level: str = "info"  # debug, info, warning or error
    # Where board telemetry is read (sysfs, /proc/device-tree, nvpmodel files); tests point it at a fixture tree.
    board_root: str = "/"
    # How often the energy meter (runtime/board/energy.py) samples the board's input power, where it has an INA3221.
    energy_sample_interval_s: float = Field(0.1, ge=0.01, le=10.0)
    # Memory pressure (runtime/board/memory_pressure.py): MemAvailable (or the cgroup limit's headroom, when
    # tighter) and PSI read every memory_pressure_interval_s; below min_available_mib (or PSI full avg10
    # above psi_full_avg10) new requests get 503 + Retry-After while in-flight ones finish; below
    # critical_mib (or PSI above the critical one) the node also sheds what memory it can. 0 turns a
    # threshold off (all 0: no reader).
    memory_pressure_min_available_mib: int = Field(256, ge=0)  # refusing below this many MiB available
    memory_pressure_critical_mib: int = Field(128, ge=0)  # critical (shedding) below this many MiB
    memory_pressure_psi_full_avg10: float = Field(10.0, ge=0, le=100)  # refusing above this PSI full avg10 (%)
    memory_pressure_psi_critical_full_avg10: float = Field(40.0, ge=0, le=100)  # critical above this PSI (%)
    memory_pressure_interval_s: float = Field(1.0, ge=0.05, le=60)  # seconds between two readings
    memory_pressure_root: str = "/"  # where proc/ and sys/fs/cgroup/ are read; tests: a fake tree
    # A worker that dies before it is warm is started again this many times in all, waiting
    # engine_start_backoff_s, then twice that...; after the last, `edgellm serve` exits non-zero.
    engine_start_attempts: int = Field(3, ge=1, le=20)
    engine_start_backoff_s: float = Field(1.0, ge=0, le=60)  # the first wait between start attempts (doubling)
    # A READY worker that answers no ping for this long is killed and restarted (its requests are sent
    # again); time in which the node itself was stopped does not count.
    engine_hang_timeout_s: float = Field(60.0, ge=1, le=3600)
    force_gpu_failure: bool = False  # test hook: make the GPU load fail to exercise the CPU fallback
    force_gpu_context_failure: bool = False  # test hook: make the GPU context creation fail (same fallback)
    # test hooks: a pretend GPU that holds only this many KV cells (the shrink ladder, engine/llama_load.py), and
    # a projector whose GPU init fails (it then runs on the CPU)
    force_gpu_context_max_cells: int | None = Field(None, ge=1)  # test hook: a GPU that holds only this many cells
    force_gpu_projector_failure: bool = False  # test hook: the projector's GPU init fails (it runs on the CPU)

    @field_validator("tokens", mode="before")
    @classmethod
    def _split_tokens(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [t.strip() for t in value.split(",") if t.strip()]
        return value

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _split_origins(cls, value: Any) -> Any:
        if isinstance(value, str):  # the environment: comma separated (a JSON list is taken too)
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [o.strip() for o in text.split(",") if o.strip()]
        return value

    @field_validator("cors_origins")
    @classmethod
    def _origins_are_origins(cls, value: list[str]) -> list[str]:
        return [normalize_origin(o) for o in value]

    @model_validator(mode="after")
    def _batch_fits_every_slot(self) -> Settings:
        if isinstance(self.n_slots, int):  # n_slots auto: checked once the memory plan has chosen it
            check_batch_fits(self.n_batch, self.n_slots)
        return self

    @field_validator("models")
    @classmethod
    def _model_ids_unique(cls, value: list[ServedModel]) -> list[ServedModel]:
        ids = [m.id for m in value]
        if len(set(ids)) != len(ids):
            raise ValueError(f"models: ids must be unique ({', '.join(i for i in ids if ids.count(i) > 1)} repeat)")
        return value

    @model_validator(mode="after")
    def _aliases_name_served_models(self) -> Settings:
        """Each alias names one served id and is not itself an id (it would shadow that model)."""
        if not self.model_aliases:
            return self
        try:
            ids = [m.id for m in self.models] if self.models else [self.served_model_name()]
        except SettingsError:  # no model file to name the model after: the start says so, not this check
            return self
        seen: dict[str, str] = {}
        for target, names in self.model_aliases.items():
            if target not in ids:
                raise ValueError(
                    f"model_aliases: {target!r} is not a served model id (the node serves {', '.join(map(repr, ids))})"
                )
            for name in names:
                if not name or not name.strip() or len(name) > 256:
                    raise ValueError(f"model_aliases: {name!r} (of {target!r}) must be 1 to 256 characters")
                if name in ids:
                    raise ValueError(f"model_aliases: {name!r} is a served model's id; an alias cannot be one")
                if seen.setdefault(name, target) != target:
                    raise ValueError(f"model_aliases: {name!r} is listed for {seen[name]!r} and {target!r}")
        return self

    def alias_pairs(self) -> tuple[tuple[str, str], ...]:
        """model_aliases as (name, id) pairs, in the order they are written."""
        return tuple((name, target) for target, names in self.model_aliases.items() for name in names)

    @field_validator("memory_budget")
    @classmethod
    def _budget_is_a_size(cls, value: str | None) -> str | None:
        if value is not None:
            parse_size(value)  # ValueError: a clear settings error at start
        return value

    @model_validator(mode="after")
    def _bounds_ordered(self) -> Settings:
        if self.temperature_min > self.temperature_max:
            raise ValueError(
                f"temperature_min ({self.temperature_min}) exceeds temperature_max ({self.temperature_max})"
            )
        if self.min_completion_tokens > self.max_completion_tokens:
            raise ValueError(
                f"min_completion_tokens ({self.min_completion_tokens}) exceeds max_completion_tokens "
                f"({self.max_completion_tokens})"
            )
        # Critical is the deeper state: with it above the refusing threshold, refusing could never be reached.
        low, critical = self.memory_pressure_min_available_mib, self.memory_pressure_critical_mib
        if low and critical and critical > low:
            raise ValueError(
                f"memory_pressure_critical_mib ({critical}) exceeds memory_pressure_min_available_mib ({low})"
            )
        psi, psi_critical = self.memory_pressure_psi_full_avg10, self.memory_pressure_psi_critical_full_avg10
        if psi and psi_critical and psi_critical < psi:
            raise ValueError(
                f"memory_pressure_psi_critical_full_avg10 ({psi_critical}) is below memory_pressure_psi_full_avg10 "
                f"({psi})"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ):
        # Earlier sources win: CLI flags, EDGELLM_*, then the upstream names, then the YAML file.
        sources: tuple = (init_settings, env_settings, UpstreamEnvSource(settings_cls))
        if settings_cls.model_config.get("yaml_file"):
            sources += (YamlConfigSettingsSource(settings_cls),)
        return sources

    # -- derived (the model side: runtime/model_sizing.py) --------------------------------------
    def start_record_path(self) -> str | None:
        """The file of the engine's earlier starts (engine/start_record.py); None: no record."""
        return os.path.join(self.state_dir, "engine-start.json") if self.start_record else None

    def body_limit(self) -> int:
        """max_body_bytes, raised with a projector so that one image/audio file of max_media_bytes fits as
        base64 in a data: URL (4/3 of the bytes) next to max_prompt_bytes of text."""
        if not self.mmproj_path:
            return self.max_body_bytes
        return max(self.max_body_bytes, -(-self.max_media_bytes * 4 // 3) + self.max_prompt_bytes + 65_536)

    def media_limits(self) -> MediaLimits:
        return MediaLimits(
            max_bytes=self.max_media_bytes,
            max_image_pixels=self.max_image_pixels,
            max_audio_seconds=self.max_audio_seconds,
            max_items=self.max_media_items,
        )

    def media_sources(self) -> MediaSources:
        return MediaSources(
            media_dirs=tuple(self.media_dirs),
            allow_remote=self.allow_remote_media,
            remote_timeout_s=self.remote_media_timeout_s,
        )

    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def check_bind_safety(self) -> None:
        if not self.is_loopback() and not self.tokens and not self.token_lanes:
            raise SettingsError(
                f"refusing to listen on non-loopback address {self.host} without a token: set "
                "INFERENCE_API_TOKEN (or tokens in the config file)"
            )


def normalize_origin(origin: str) -> str:
    """A web origin as a browser sends it in `Origin:` (scheme://host[:port], lower case, no default
    port), or ValueError saying what is wrong: a path, a wildcard, credentials, another scheme."""
    text = origin.strip()
    if "*" in text:
        raise ValueError(f"cors_origins: {origin!r}: wildcards are not allowed, list each origin")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise ValueError(f"cors_origins: {origin!r} is not scheme://host[:port]") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(f"cors_origins: {origin!r} is not http(s)://host[:port]")
    if parts.path not in ("", "/") or parts.query or parts.fragment or text.endswith(("?", "#")):
        raise ValueError(f"cors_origins: {origin!r} has a path, query or fragment; an origin is scheme://host[:port]")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"cors_origins: {origin!r} has credentials; an origin is scheme://host[:port]")
    scheme, host = parts.scheme.lower(), parts.hostname.lower()
    if ":" in host:  # an IPv6 literal keeps its brackets
        host = f"[{host}]"
    if port is None or port == {"http": 80, "https": 443}[scheme]:
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


def load_settings(config_file: str | None = None, **overrides: Any) -> Settings:
    """Settings from an optional YAML file, the environment and explicit overrides (CLI flags), over
    the settings of a board preset when one is named (flag, EDGELLM_PRESET or `preset:` in the file)."""
    if config_file is not None and not os.path.isfile(config_file):
        raise SettingsError(f"config file not found: {config_file}")
    given = {k: v for k, v in overrides.items() if v is not None}
    preset_name = given.get("preset") or os.environ.get("EDGELLM_PRESET") or file_value(config_file, "preset")
    try:
        preset = load_preset(str(preset_name)).settings if preset_name else {}
    except PresetError as exc:
        raise SettingsError(exc.message) from None

    class _FileSettings(Settings):
        model_config = SettingsConfigDict(**{**Settings.model_config, "yaml_file": config_file})

        @classmethod
        def settings_customise_sources(cls, settings_cls, **sources):
            above = Settings.settings_customise_sources.__func__(cls, settings_cls, **sources)
            return (*above, PresetSource(settings_cls, preset))

    try:
        settings = _FileSettings(**given)
    except ValueError as exc:  # pydantic ValidationError
        raise SettingsError(f"invalid settings: {exc}") from exc
    settings._model_from_preset = bool(preset.get("model_path")) and settings.model_path == preset.get("model_path")
    return settings

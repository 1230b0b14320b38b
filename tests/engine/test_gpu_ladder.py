"""Start-time GPU memory: the memory plan counts the CUDA runtime and the projector, and a GPU context
that cannot be made shrinks the KV pool (halved, the slots kept) before the model falls
back to the CPU; a projector whose GPU init fails runs on the CPU.

This machine has no GPU (a CPU build of llama.cpp: llama_supports_gpu_offload() is False), so a GPU
allocation never fails here. The test hooks of engine/test_hooks.py stand in for it at the exact point
llama.cpp would fail: a pretend GPU that holds only so many KV cells, a projector GPU init that fails.
As in tests/runtime/test_resilience.py, an explicit n_gpu_layers makes the loader count layers as
offloaded (llama.cpp accepts the count on a CPU build), so the GPU path is the one taken. Everything
else is real: the bundled model, its contexts, the engine serving a request, the projector's files.
"""

from __future__ import annotations

import logging
import os

import pytest

import edgellm.runtime.model_sizing as model_sizing
from edgellm.engine import test_hooks
from edgellm.engine.core import EngineCore
from edgellm.engine.llama_load import shrink_ladder
from edgellm.engine.memory_costs import DEFAULT_CUDA_CONTEXT_BYTES, MIB, cuda_device_present, projector_bytes
from edgellm.engine.memory_plan import format_plan, plan_memory
from edgellm.engine.model import ModelConfig
from edgellm.engine.projector import Projector, attach_projector, open_projector
from edgellm.engine.shape import ModelShape
from edgellm.runtime.settings import load_settings
from edgellm.runtime.supervision.ipc import WorkerConfig
from tests.engine.conftest import EngineHarness, req
from tools.build_mmproj import build_vision_mmproj

N_EMBD = 576  # SmolLM2-135M


@pytest.fixture(scope="module")
def smol(model_path) -> ModelShape:
    return ModelShape.from_gguf(model_path)


@pytest.fixture(scope="module")
def vision_mmproj(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mmproj") / "vision.gguf"
    build_vision_mmproj(path, n_embd_text=N_EMBD)
    return str(path)


@pytest.fixture
def hooks():
    """Install test hooks for one test; the defaults (all off) again afterwards, whatever happened."""
    yield lambda **kw: test_hooks.install(test_hooks.FaultHooks(**kw))
    test_hooks.install(test_hooks.FaultHooks())


# -- the memory plan ---------------------------------------------------------------------------
def test_plan_counts_the_cuda_runtime_and_the_projector(smol):
    base = plan_memory(smol, budget_bytes=6 * 1024 * MIB, n_ctx=8192, n_slots=4)
    plan = plan_memory(
        smol, budget_bytes=6 * 1024 * MIB, n_ctx=8192, n_slots=4, cuda_bytes=300 * MIB, projector_bytes=50 * MIB
    )
    assert plan.total_bytes == base.total_bytes + 350 * MIB
    assert plan.base_bytes == base.base_bytes + 350 * MIB
    d = plan.to_dict()
    assert (d["cuda_mib"], d["cuda_bytes"]) == (300.0, 300 * MIB)
    assert (d["projector_mib"], d["projector_bytes"]) == (50.0, 50 * MIB)
    assert set(base.to_dict()) == set(d)  # the same keys with the parts at 0: /status keeps one shape
    assert base.to_dict()["cuda_bytes"] == 0 and base.to_dict()["projector_bytes"] == 0
    text = format_plan(plan)
    assert "CUDA runtime (context, cuBLAS, pools)" in text and "projector (weights, compute buffer)" in text


def test_auto_context_leaves_room_for_the_cuda_runtime(smol):
    budget = 1024 * MIB
    without = plan_memory(smol, budget_bytes=budget)
    with_cuda = plan_memory(smol, budget_bytes=budget, cuda_bytes=DEFAULT_CUDA_CONTEXT_BYTES)
    assert with_cuda.fits and with_cuda.total_bytes <= budget
    assert with_cuda.n_ctx < without.n_ctx  # the runtime's share came out of the KV cache


def test_refusals_name_the_cuda_runtime_and_the_projector(smol):
    base = plan_memory(smol, budget_bytes=300 * MIB, cuda_bytes=300 * MIB, projector_bytes=20 * MIB)
    why = base.refusal()
    assert not base.fits and "the CUDA runtime (300 MiB: cuda_context_mib" in why
    assert "the projector (20 MiB: weights and compute buffer)" in why
    kv = plan_memory(
        smol, budget_bytes=1200 * MIB, n_ctx=65536, n_slots=1, cuda_bytes=300 * MIB, projector_bytes=20 * MIB
    )
    assert "for weights, compute buffers, the projector, the CUDA runtime and runtime" in kv.refusal()


def test_projector_bytes_are_its_file_plus_a_compute_buffer(vision_mmproj, tmp_path):
    size = os.path.getsize(vision_mmproj)
    # The test projector: image 32 / patch 8 -> 16 patches + 1, hidden 64, FFN 136, 4 heads.
    tokens, per_token = 17, 3 * 136 + 8 * 64 + 4 * 17
    compute = int(4 * tokens * per_token * 1.10) + 1 + 8 * MIB
    assert projector_bytes(vision_mmproj) - size == pytest.approx(compute, abs=2)
    assert projector_bytes(None) == 0
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"junk" * 10)
    assert projector_bytes(not_gguf) == 40  # no header to read: the weights alone


def test_cuda_device_is_seen_from_files(tmp_path):
    marker = tmp_path / "nv_tegra_release"
    assert not cuda_device_present((str(marker),))
    marker.write_text("# R36 (release), REVISION: 4.0\n")
    assert cuda_device_present((str(tmp_path / "absent"), str(marker)))


def test_settings_plan_the_projector_and_the_cuda_runtime_only_when_offloading(vision_mmproj, monkeypatch):
    settings = load_settings(None, mmproj_path=vision_mmproj, memory_budget="900MiB")
    settings.model()
    report = settings.memory_report()
    assert report["projector_bytes"] == projector_bytes(vision_mmproj)
    assert report["cuda_bytes"] == (300 * MIB if cuda_device_present() else 0)
    # No GPU here: pretend the host shows one, to see the setting and n_gpu_layers decide the share.
    monkeypatch.setattr(model_sizing, "cuda_device_present", lambda: True)
    for overrides, expected in (({}, 300), ({"cuda_context_mib": 512}, 512), ({"n_gpu_layers": 0}, 0)):
        s = load_settings(None, memory_budget="2GiB", **overrides)
        s.model()
        assert s.memory_report()["cuda_bytes"] == expected * MIB, overrides


# -- the ladder --------------------------------------------------------------------------------
def test_shrink_ladder_halves_the_pool():
    assert shrink_ladder(8192) == [4096, 2048, 1024]
    assert shrink_ladder(3000) == [1280, 1024]  # on 256-cell steps, down to the 1024 floor
    assert shrink_ladder(1000) == [] and shrink_ladder(256) == []  # never grown to the floor
    assert shrink_ladder(8192, min_cells=2048) == [4096, 2048]


def _core(model_path: str) -> EngineCore:
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return EngineCore(ModelConfig(path=model_path, n_ctx=8192, n_slots=4, n_gpu_layers=99, n_threads=2))


@pytest.mark.parametrize(
    ("max_cells", "pool", "steps"),
    [
        (4096, 4096, "a KV pool of 8192 cells did not fit"),
        (1024, 1024, "a KV pool of 8192, 4096, 2048 cells did not fit"),
    ],
)
def test_a_gpu_context_that_does_not_fit_shrinks_the_pool_and_serves(model_path, hooks, max_cells, pool, steps):
    hooks(gpu_context_max_cells=max_cells)
    core = _core(model_path)
    try:
        info = core.info
        assert (core.model.n_slots, core.model.n_ctx, core.model.seq_ctx) == (4, pool, pool)  # one pool
        assert (info.n_slots, info.n_ctx, info.seq_ctx) == (4, pool, pool)
        assert len(core.scheduler.kv.slots) == 4 and core.model.config.n_ctx == pool
        assert core.scheduler.kv.pool.n_cells == pool
        offload = info.offload
        assert offload["device"] == "gpu" and offload["n_gpu_layers"] > 0
        reason = offload["fallback_reason"]
        assert f"GPU context for {steps}" in reason and f"running a pool of {pool} cells on the GPU" in reason
        assert "pretend GPU holds" in reason  # why the first pool failed
        out = EngineHarness(core).one(req("ladder", max_tokens=8, temperature=0))
        assert out.finish_reason in ("length", "stop") and out.text
    finally:
        core.close()


def test_a_gpu_too_small_for_any_pool_falls_back_to_the_cpu_with_the_configured_pool(model_path, hooks):
    hooks(gpu_context_max_cells=256)  # below the 1024-cell floor
    core = _core(model_path)
    try:
        info = core.info
        assert (info.n_slots, info.n_ctx) == (4, 8192)
        assert info.offload["device"] == "cpu" and info.offload["n_gpu_layers"] == 0
        reason = info.offload["fallback_reason"]
        assert "GPU context creation failed for a KV pool of 8192, 4096, 2048, 1024 cells" in reason
        assert reason.endswith("retried on CPU with 8192 cells")
        out = EngineHarness(core).one(req("cpu", max_tokens=8, temperature=0))
        assert out.text
    finally:
        core.close()


def test_no_hook_no_ladder(model_path, hooks):
    hooks()
    core = _core(model_path)
    try:
        info = core.info
        assert (info.n_slots, info.n_ctx) == (4, 8192) and info.offload["fallback_reason"] is None
    finally:
        core.close()


def test_worker_config_carries_every_hook():
    config = WorkerConfig(ModelConfig(path="m.gguf"), force_gpu_context_failure=True, force_gpu_context_max_cells=4096)
    assert config.fault_hooks() == test_hooks.FaultHooks(gpu_context_failure=True, gpu_context_max_cells=4096)
    assert WorkerConfig(ModelConfig(path="m.gguf")).fault_hooks() == test_hooks.FaultHooks()


# -- the projector -----------------------------------------------------------------------------
def test_projector_gpu_failure_runs_it_on_the_cpu(model_path, vision_mmproj, hooks):
    hooks(gpu_projector_failure=True)
    core = EngineCore(ModelConfig(path=model_path, n_ctx=512, n_slots=1, n_threads=2))
    try:
        model = core.model.model
        projector = open_projector(vision_mmproj, model, n_threads=1, use_gpu=True)
        try:
            assert not projector.on_gpu and projector.caps.vision
            assert "projector GPU init failed" in projector.fallback_reason
            assert projector.fallback_reason.endswith("retried on CPU")
        finally:
            projector.close()
        # Through attach_projector (the engine's path, after the file's probe in a child process): in use.
        attached, error = attach_projector(vision_mmproj, model_path, model, n_threads=1, use_gpu=True)
        try:
            assert error is None and attached is not None and attached.fallback_reason
        finally:
            attached.close()
        hooks()
        plain = open_projector(vision_mmproj, model, n_threads=1, use_gpu=True)
        try:
            assert plain.on_gpu and plain.fallback_reason is None  # a CPU build takes use_gpu and stays on the CPU
        finally:
            plain.close()
        assert isinstance(plain, Projector)
    finally:
        core.close()

"""Free GPU / unified memory: reported where the platform exposes it, absent otherwise."""

from __future__ import annotations

from edgellm.runtime.board import gpu_memory


def test_jetson_reports_unified_memory(tmp_path, monkeypatch):
    release = tmp_path / "nv_tegra_release"
    release.write_text("# R36 (release), REVISION: 3.0\n")
    monkeypatch.setattr(gpu_memory, "TEGRA_RELEASE", release)
    info = gpu_memory.gpu_memory()
    assert info["source"].startswith("jetson-unified-memory")
    assert 0 < info["free_mb"] <= info["total_mb"]


def test_absent_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_memory, "TEGRA_RELEASE", tmp_path / "missing")
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert gpu_memory.gpu_memory() is None  # this CI machine: no NVML module, no nvidia-smi, not a Jetson

"""Board presets as the lowest settings layer, and the memory plan that sizes the context (or refuses)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgellm.engine.memory_costs import MIB
from edgellm.runtime.board.presets import SOURCE_DIR, available, load_preset
from edgellm.runtime.model_sizing import bundled_model_path
from edgellm.runtime.settings import SettingsError, load_settings
from tests.nodeproc import NodeProcess

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_preset_env(monkeypatch):
    monkeypatch.delenv("EDGELLM_PRESET", raising=False)
    monkeypatch.delenv("EDGELLM_PRESETS_DIR", raising=False)


def test_every_shipped_preset_loads_and_its_settings_are_valid():
    names = sorted(p.stem for p in SOURCE_DIR.glob("*.yaml"))
    assert names == ["agx-orin-32gb", "agx-orin-64gb", "agx-thor", "orin-nano", "orin-nx-16gb"]
    assert set(names) <= set(available())
    for name in names:
        preset = load_preset(name)
        settings = load_settings(None, preset=name)  # every key is a setting, every value in range
        assert settings.model_path == preset.settings["model_path"] == f"/var/lib/edgellm/models/{preset.model['file']}"
        assert preset.model["hf_repo"].startswith("Qwen/") and preset.model["file"].endswith(".gguf")
        assert settings.n_ctx == "auto" and settings.memory_budget


def test_a_preset_is_below_the_config_file_the_environment_and_flags(tmp_path, monkeypatch):
    config = tmp_path / "node.yaml"
    config.write_text("preset: orin-nano\nn_slots: 2\n")
    settings = load_settings(str(config))
    assert (settings.n_slots, settings.kv_cache_type, settings.memory_budget) == (2, "q8_0", "3GiB")
    monkeypatch.setenv("EDGELLM_KV_CACHE_TYPE", "f16")
    assert load_settings(str(config), n_slots=3).kv_cache_type == "f16"
    assert load_settings(str(config), n_slots=3).n_slots == 3


def test_a_missing_preset_model_says_where_to_get_it():
    settings = load_settings(None, preset="orin-nano")
    with pytest.raises(SettingsError, match=r"Qwen2.5-1.5B-Instruct-GGUF\); run `edgellm pull orin-nano`"):
        settings.model()
    # A model_path of the user's own is just missing, with no preset hint.
    with pytest.raises(SettingsError) as err:
        load_settings(None, preset="orin-nano", model_path="/nonexistent/m.gguf").model()
    assert "download" not in str(err.value)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(SettingsError, match=r"unknown preset 'orin-mega' \(presets: agx-orin-32gb"):
        load_settings(None, preset="orin-mega")


def test_auto_context_fits_the_budget_and_a_model_that_does_not_fit_is_refused():
    settings = load_settings(None, n_ctx="auto", n_slots="auto", memory_budget="900MiB")
    model = settings.model()
    plan = settings.memory_report()
    assert plan["fits"] and plan["total_bytes"] <= 900 * MIB
    assert plan["embedding_bytes"] > 0  # the embedding context (embedding_ctx 512) is planned for
    off = load_settings(None, n_ctx="auto", n_slots="auto", memory_budget="900MiB", embedding_ctx=0)
    off.model()
    assert off.memory_report()["embedding_bytes"] == 0 and off.memory_report()["n_ctx"] >= plan["n_ctx"]
    assert (model.n_ctx, model.n_slots) == (plan["n_ctx"], plan["n_slots"])
    assert model.n_ctx % 256 == 0 and plan["auto_ctx"]
    with pytest.raises(SettingsError, match=r"does not fit the memory budget: the model's weights \(94 MiB\)"):
        load_settings(None, memory_budget="100MiB").model()
    with pytest.raises(SettingsError, match=r"a KV pool of n_ctx=65536 cells needs"):
        load_settings(None, n_ctx=65536, memory_budget="900MiB").model()
    with pytest.raises(SettingsError, match="memory_budget"):
        load_settings(None, memory_budget="lots")


def test_the_node_runs_with_the_planned_context_and_shows_the_plan(tmp_path):
    node = NodeProcess(tmp_path, "--n-ctx", "auto", "--n-slots", "auto", "--memory-budget", "1GiB").start()
    try:
        with node.client() as c:
            status = c.get("/status").json()["result"]
    finally:
        node.stop()
    plan, info = status["memory_plan"], status["engine_info"]
    assert plan["fits"] and plan["budget_bytes"] == 1024 * MIB
    assert info["n_slots"] == plan["n_slots"] and info["seq_ctx"] == plan["seq_ctx"]
    assert plan["weights_bytes"] == os.path.getsize(bundled_model_path())


def test_serve_refuses_to_start_when_the_model_does_not_fit(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "edgellm", "serve", "--memory-budget", "64MiB", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode != 0
    assert "does not fit the memory budget" in out.stderr and "raise memory_budget" in out.stderr
    assert "Traceback" not in out.stderr
    assert not list(tmp_path.iterdir())  # refused before the registry was opened


def test_the_default_budget_reads_memory_as_it_was_before_the_prestarted_worker(monkeypatch):
    """serve reads /proc/meminfo just before it spawns the worker early (runtime/supervision/prestart.py): the plan's
    default budget is a share of that reading, not of one that the worker's imports already lowered."""
    from edgellm.runtime.supervision import prestart

    monkeypatch.setattr(prestart, "_meminfo_before", "MemTotal: 8000000 kB\nMemAvailable: 4194304 kB\n")
    plan = load_settings(None).memory_plan()
    assert plan.budget_bytes == int(4194304 * 1024 * 0.75)
    monkeypatch.setattr(prestart, "_meminfo_before", None)  # no prestart: the live reading
    assert load_settings(None).memory_plan().budget_bytes != int(4194304 * 1024 * 0.75)

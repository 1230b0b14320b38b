"""Settings precedence: defaults < YAML file < environment < CLI flags."""

from __future__ import annotations

import pytest

from edgellm.runtime.model_sizing import bundled_model_path
from edgellm.runtime.settings import SettingsError, load_settings


def test_defaults(monkeypatch):
    for k in ("EDGELLM_PORT", "INFERENCE_API_TOKEN", "EDGELLM_TOKENS"):
        monkeypatch.delenv(k, raising=False)
    s = load_settings()
    assert (s.host, s.port, s.n_gpu_layers, s.response_format.value) == ("127.0.0.1", 8765, "auto", "WRAPPED")
    assert s.request_ttl == 7200 and s.request_timeout == 600 and s.tokens == []
    assert s.resolved_model_path() == bundled_model_path()


def test_file_env_cli_precedence(tmp_path, monkeypatch):
    cfg = tmp_path / "node.yaml"
    cfg.write_text("port: 9001\nn_slots: 4\nresponse_format: RAW\ntokens: [a]\n")
    s = load_settings(str(cfg))
    assert (s.port, s.n_slots, s.response_format.value, s.tokens) == (9001, 4, "RAW", ["a"])
    monkeypatch.setenv("EDGELLM_PORT", "9002")
    monkeypatch.setenv("INFERENCE_API_TOKEN", "x, y")
    s = load_settings(str(cfg))
    assert s.port == 9002 and s.tokens == ["x", "y"] and s.n_slots == 4
    assert load_settings(str(cfg), port=9003).port == 9003


def test_bad_values_are_clear(tmp_path):
    with pytest.raises(SettingsError, match="config file not found"):
        load_settings(str(tmp_path / "missing.yaml"))
    with pytest.raises(SettingsError, match="port"):
        load_settings(port=70000)
    with pytest.raises(SettingsError, match="model file not found"):
        load_settings(model_path=str(tmp_path / "x.gguf")).resolved_model_path()


def test_non_loopback_needs_a_token(monkeypatch):
    monkeypatch.delenv("INFERENCE_API_TOKEN", raising=False)
    with pytest.raises(SettingsError, match="refusing to listen"):
        load_settings(host="0.0.0.0").check_bind_safety()
    load_settings(host="0.0.0.0", tokens=["t"]).check_bind_safety()
    load_settings(host="::1").check_bind_safety()


# Every field's bare name, upper-cased as a shell would export it: none of these may configure the node.
UNPREFIXED = {
    "TOKENS": "stray-token",
    "REQUEST_TTL": "5",
    "PORT": "1234",
    "HOST": "0.0.0.0",
    "N_SLOTS": "2",
    "MODEL_PATH": "/nonexistent.gguf",
    "LOG_LEVEL": "debug",
}


def _clean_env(monkeypatch):
    for k in ("INFERENCE_API_TOKEN", "REQUEST_TTL_SECONDS", "EDGELLM_TOKENS", "EDGELLM_REQUEST_TTL", "EDGELLM_PORT"):
        monkeypatch.delenv(k, raising=False)


def test_unprefixed_env_names_are_ignored(monkeypatch):
    """Regression (issue 8, defect 19): TOKENS= turned auth on and REQUEST_TTL= set the TTL by accident."""
    _clean_env(monkeypatch)
    for k, v in UNPREFIXED.items():
        monkeypatch.setenv(k, v)
        monkeypatch.setenv(k.lower(), v)
    s = load_settings()
    assert s.tokens == [] and s.request_ttl == 7200
    assert (s.port, s.host, s.n_slots, s.model_path, s.log_level) == (8765, "127.0.0.1", 8, None, "info")


def test_documented_env_names_still_work(monkeypatch):
    _clean_env(monkeypatch)
    monkeypatch.setenv("INFERENCE_API_TOKEN", "up-a,up-b")
    monkeypatch.setenv("REQUEST_TTL_SECONDS", "60")
    s = load_settings()
    assert s.tokens == ["up-a", "up-b"] and s.request_ttl == 60
    # EDGELLM_* wins over the upstream name; CLI flags win over both.
    monkeypatch.setenv("EDGELLM_TOKENS", "ours")
    monkeypatch.setenv("EDGELLM_REQUEST_TTL", "90")
    s = load_settings()
    assert s.tokens == ["ours"] and s.request_ttl == 90
    assert load_settings(request_ttl=30, tokens=["cli"]).request_ttl == 30


def test_upstream_env_names_outrank_the_config_file(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    cfg = tmp_path / "node.yaml"
    cfg.write_text("request_ttl: 100\ntokens: [file]\n")
    s = load_settings(str(cfg))
    assert s.request_ttl == 100 and s.tokens == ["file"]
    monkeypatch.setenv("REQUEST_TTL_SECONDS", "200")
    monkeypatch.setenv("INFERENCE_API_TOKEN", "env")
    s = load_settings(str(cfg))
    assert s.request_ttl == 200 and s.tokens == ["env"]


def test_n_batch_below_n_slots_is_refused_at_load(tmp_path):
    """Regression (issue 8, defect 19): n_batch < n_slots was accepted, then every full-house decode failed."""
    with pytest.raises(SettingsError, match=r"n_batch \(32\) must be at least n_slots \(64\)"):
        load_settings(n_slots=64, n_batch=32)
    cfg = tmp_path / "node.yaml"
    cfg.write_text("n_slots: 40\nn_batch: 39\n")
    with pytest.raises(SettingsError, match="raise n_batch or lower n_slots"):
        load_settings(str(cfg))
    assert load_settings(n_slots=64, n_batch=64).n_batch == 64  # one token per slot per step fits

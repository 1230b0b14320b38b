"""Settings precedence: defaults < YAML file < environment < CLI flags."""

from __future__ import annotations

import pytest

from edgellm.runtime.settings import SettingsError, bundled_model_path, load_settings


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

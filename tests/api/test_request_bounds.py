"""The node's configurable bounds on temperature and max_tokens (upstream TEMPERATURE_MIN/MAX,
MIN/MAX_COMPLETION_TOKENS), from Settings through ServiceConfig into both route families' parsers,
and the node identity WRAPPED bodies carry (create_app(node=...))."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from edgellm.api.auth import Authenticator
from edgellm.api.dialects.openai_chat import parse_openai_request
from edgellm.api.envelope import NodeIdentity
from edgellm.api.service import Service
from edgellm.api.submission import ServiceConfig
from edgellm.api.validation import parse_chat_request
from edgellm.errors import InvalidRequest
from edgellm.runtime.settings import SettingsError, load_settings

MSG = [{"role": "user", "content": "hi"}]


def test_default_bounds_are_upstreams():
    assert parse_chat_request({"messages": MSG, "temperature": 0}).temperature == 0.0
    assert parse_chat_request({"messages": MSG, "temperature": 1.5}).temperature == 1.5
    with pytest.raises(InvalidRequest, match=r"temperature must be in \[0, 1.5\]"):
        parse_chat_request({"messages": MSG, "temperature": 1.6})
    with pytest.raises(InvalidRequest, match=r"max_tokens must be in \[16, 4096\]"):
        parse_chat_request({"messages": MSG, "max_tokens": 15})
    with pytest.raises(InvalidRequest, match=r"max_tokens must be in \[16, 4096\]"):
        parse_chat_request({"messages": MSG, "max_tokens": 4097})


def test_configured_bounds_apply():
    limits = dict(min_temperature=0.2, max_temperature=0.9, min_max_tokens=8, max_max_tokens=100)
    assert parse_chat_request({"messages": MSG, "temperature": 0.9, "max_tokens": 8}, **limits).max_tokens == 8
    with pytest.raises(InvalidRequest, match=r"temperature must be in \[0.2, 0.9\]"):
        parse_chat_request({"messages": MSG, "temperature": 0.1}, **limits)
    with pytest.raises(InvalidRequest, match=r"max_tokens must be in \[8, 100\]"):
        parse_chat_request({"messages": MSG, "max_tokens": 101}, **limits)
    # The defaults (0.7, 512) are pulled inside the configured range, never outside it.
    req = parse_chat_request({"messages": MSG}, **limits)
    assert (req.temperature, req.max_tokens) == (0.7, 100)
    req = parse_chat_request({"messages": MSG}, min_temperature=1.0, max_temperature=1.2, min_max_tokens=600)
    assert (req.temperature, req.max_tokens) == (1.0, 600)


def test_openai_route_keeps_its_floor_of_one_but_takes_the_configured_maximum():
    limits = dict(min_temperature=0.0, max_temperature=1.0, min_max_tokens=16, max_max_tokens=64)
    req, _ = parse_openai_request({"model": "m", "messages": MSG, "max_tokens": 1}, "m", **limits)
    assert req.max_tokens == 1
    with pytest.raises(InvalidRequest, match=r"max_tokens must be in \[1, 64\]"):
        parse_openai_request({"model": "m", "messages": MSG, "max_completion_tokens": 65}, "m", **limits)
    with pytest.raises(InvalidRequest, match="temperature"):
        parse_openai_request({"model": "m", "messages": MSG, "temperature": 1.2}, "m", **limits)


def test_service_passes_its_config_bounds(tmp_path):
    from edgellm.api.registry import Registry

    config = ServiceConfig(
        model_name="m", temperature_min=0.0, temperature_max=0.5, min_completion_tokens=4, max_completion_tokens=32
    )
    service = Service(config, Registry(tmp_path / "r.sqlite3", ttl_s=60, boot_id="b"), Authenticator([]))
    assert asyncio.run(service.parse({"messages": MSG, "max_tokens": 4})).max_tokens == 4
    with pytest.raises(InvalidRequest, match=r"\[4, 32\]"):
        asyncio.run(service.parse({"messages": MSG, "max_tokens": 33}))
    with pytest.raises(InvalidRequest, match=r"\[0, 0.5\]"):
        asyncio.run(service.parse({"messages": MSG, "temperature": 0.6}))
    req, _ = asyncio.run(service.parse_openai({"model": "m", "messages": MSG, "max_tokens": 1}))
    assert req.max_tokens == 1


def test_settings_bounds_are_checked():
    s = load_settings(temperature_max=2.0, max_completion_tokens=8192)
    assert (s.temperature_min, s.temperature_max, s.min_completion_tokens, s.max_completion_tokens) == (
        0.0,
        2.0,
        16,
        8192,
    )
    with pytest.raises(SettingsError, match="temperature_min"):
        load_settings(temperature_min=1.0, temperature_max=0.5)
    with pytest.raises(SettingsError, match="min_completion_tokens"):
        load_settings(min_completion_tokens=100, max_completion_tokens=50)


def test_create_app_wraps_with_the_given_node_identity(tmp_path):
    from edgellm.runtime.server.app import create_app

    node = NodeIdentity("0xai_node", "mainnet", "alias-1", "0xai_node", "0xETH", "mainnet", "7.7.1")
    app = create_app(load_settings(state_dir=str(tmp_path), max_completion_tokens=64), node=node)
    # No lifespan (no engine): a validation error is answered by the route, in the WRAPPED envelope.
    r = TestClient(app, base_url="http://127.0.0.1").get("/request_status")
    assert r.status_code == 400
    body = r.json()
    assert body["result"]["status_code"] == 400
    assert (body["server_node_addr"], body["ee_node_alias"], body["ee_node_eth_address"]) == (
        "0xai_node",
        "alias-1",
        "0xETH",
    )
    assert app.state.service.config.max_completion_tokens == 64

"""LLM_INFERENCE_API's pure parts, without naeural-core: config -> Settings, the node identity, the
ASGI bridge (lifespan, requests, failures) and the error replies. The plugin module itself imports
naeural_core and is exercised by test_node_integration.py."""

from __future__ import annotations

import json
import time

import pytest
from fastapi import FastAPI, Request

from edgellm.api.envelope import NodeIdentity, ResponseMode
from edgellm.errors import InvalidRequest
from edgellm.runtime.settings import SettingsError
from extensions.business.edge_inference_api.asgi_bridge import (
    REPLY_MARK,
    AsgiAppRunner,
    HttpReply,
    HttpRequest,
    edgellm_error_reply,
)
from extensions.business.edge_inference_api.plugin_config import (
    PLUGIN_DEFAULTS,
    node_identity,
    settings_from_config,
)

NODE = NodeIdentity("0xai_n", "mainnet", "alias", "0xai_n", "0xE", "mainnet", "7.7")


def settings(config=None, environ=None, **kw):
    return settings_from_config(
        config or {}, data_folder="/data", instance_key="pipe__inst", environ=environ or {}, **kw
    )


# -- config -> Settings ------------------------------------------------------------------------
def test_defaults_are_upstreams_and_edgellms():
    assert PLUGIN_DEFAULTS["RESPONSE_FORMAT"] == "WRAPPED"
    assert PLUGIN_DEFAULTS["REQUEST_TIMEOUT"] == 600 and PLUGIN_DEFAULTS["REQUEST_TTL_SECONDS"] == 7200
    assert (
        PLUGIN_DEFAULTS["AUTH_TOKEN_ENV"] == "INFERENCE_API_TOKEN" and PLUGIN_DEFAULTS["PREDEFINED_AUTH_TOKENS"] == []
    )
    assert (PLUGIN_DEFAULTS["TEMPERATURE_MIN"], PLUGIN_DEFAULTS["TEMPERATURE_MAX"]) == (0.0, 1.5)
    assert (PLUGIN_DEFAULTS["MIN_COMPLETION_TOKENS"], PLUGIN_DEFAULTS["MAX_COMPLETION_TOKENS"]) == (16, 4096)
    assert PLUGIN_DEFAULTS["HOST"] == "127.0.0.1" and PLUGIN_DEFAULTS["TUNNEL_ENGINE_ENABLED"] is False
    assert PLUGIN_DEFAULTS["N_GPU_LAYERS"] == "auto" and PLUGIN_DEFAULTS["MODEL_PATH"] is None
    json.dumps(PLUGIN_DEFAULTS)  # the node's config is JSON
    s = settings()
    assert s.response_format is ResponseMode.WRAPPED and s.request_ttl == 7200 and s.tokens == []
    assert s.state_dir == "/data/edgellm/pipe__inst" and s.is_loopback()


def test_keys_map_onto_settings():
    s = settings(
        {
            "RESPONSE_FORMAT": "raw",
            "REQUEST_TIMEOUT": 30,
            "REQUEST_TTL_SECONDS": 60,
            "TEMPERATURE_MAX": 1.0,
            "MAX_COMPLETION_TOKENS": 256,
            "MIN_COMPLETION_TOKENS": 4,
            "N_SLOTS": 4,
            "N_CTX": 4096,
            "N_GPU_LAYERS": 0,
            "KV_CACHE_TYPE": "q8_0",
            "MAX_QUEUED": 16,
            "STATE_DIR": "/var/lib/x",
            "MODEL_PATH": "/m.gguf",
        }
    )
    assert s.response_format is ResponseMode.RAW and (s.request_timeout, s.request_ttl) == (30, 60)
    assert (s.temperature_max, s.max_completion_tokens, s.min_completion_tokens) == (1.0, 256, 4)
    assert (s.n_slots, s.n_ctx, s.n_gpu_layers, s.kv_cache_type, s.max_queued) == (4, 4096, 0, "q8_0", 16)
    assert s.state_dir == "/var/lib/x" and s.model_path == "/m.gguf"


def test_a_bad_value_names_the_plugin_key():
    with pytest.raises(SettingsError, match="N_SLOTS"):
        settings({"N_SLOTS": 0})
    with pytest.raises(SettingsError, match="RESPONSE_FORMAT"):
        settings({"RESPONSE_FORMAT": "PRETTY"})
    with pytest.raises(SettingsError, match="temperature_min"):
        settings({"TEMPERATURE_MIN": 1.2, "TEMPERATURE_MAX": 1.0})


def test_the_nodes_environment_does_not_configure_an_instance(monkeypatch):
    monkeypatch.setenv("EDGELLM_N_SLOTS", "3")
    monkeypatch.setenv("EDGELLM_TOKENS", "leaked")
    monkeypatch.setenv("REQUEST_TTL_SECONDS", "5")
    s = settings_from_config({}, data_folder="/d", instance_key="k")  # the real os.environ
    assert s.n_slots == PLUGIN_DEFAULTS["N_SLOTS"] and s.tokens == [] and s.request_ttl == 7200


def test_tokens_come_from_the_named_env_variable_and_the_config():
    s = settings({"PREDEFINED_AUTH_TOKENS": ["p1", "a"]}, environ={"INFERENCE_API_TOKEN": "a, b,"})
    assert s.tokens == ["a", "b", "p1"]
    s = settings({"AUTH_TOKEN_ENV": "MY_TOKENS"}, environ={"MY_TOKENS": "x", "INFERENCE_API_TOKEN": "ignored"})
    assert s.tokens == ["x"]
    with pytest.raises(SettingsError, match="PREDEFINED_AUTH_TOKENS"):
        settings({"PREDEFINED_AUTH_TOKENS": "not-a-list"})


def test_anonymous_access_rules():
    assert settings({"ALLOW_ANONYMOUS_ACCESS": True}).tokens == []  # loopback, no token: allowed
    with pytest.raises(SettingsError, match="non-loopback"):
        settings({"HOST": "0.0.0.0"})  # upstream listened on 0.0.0.0 without auth
    with pytest.raises(SettingsError, match="non-loopback"):
        settings({"HOST": "0.0.0.0", "ALLOW_ANONYMOUS_ACCESS": True})
    assert settings({"HOST": "0.0.0.0", "PREDEFINED_AUTH_TOKENS": ["t"]}).tokens == ["t"]
    with pytest.raises(SettingsError, match="ALLOW_ANONYMOUS_ACCESS is true but tokens"):
        settings({"ALLOW_ANONYMOUS_ACCESS": True, "PREDEFINED_AUTH_TOKENS": ["t"]})
    with pytest.raises(SettingsError, match="ALLOW_ANONYMOUS_ACCESS is false but no token"):
        settings({"ALLOW_ANONYMOUS_ACCESS": False})
    with pytest.raises(SettingsError, match="TUNNEL_ENGINE_ENABLED"):
        settings({"TUNNEL_ENGINE_ENABLED": True})
    tunnel = settings({"TUNNEL_ENGINE_ENABLED": True}, environ={"INFERENCE_API_TOKEN": "t"})
    assert tunnel.allowed_hosts == ["*"]


def test_node_identity_from_the_frameworks_data():
    data = {
        "server_node_addr": "0xai_abc",
        "evm_network": "devnet",
        "ee_node_alias": "n1",
        "ee_node_address": "0xai_abc",
        "ee_node_eth_address": "0x12",
        "ee_node_network": "devnet",
        "ee_node_ver": None,
        "extra": 1,
    }
    node = node_identity(data, version="7.7.336")
    assert node == NodeIdentity("0xai_abc", "devnet", "n1", "0xai_abc", "0x12", "devnet", "7.7.336")


# -- error replies ------------------------------------------------------------------------------
def test_error_replies_keep_edgellms_shapes():
    reply = edgellm_error_reply(InvalidRequest("bad"), "/predict", ResponseMode.WRAPPED, NODE)
    body = json.loads(reply.body)
    assert reply.status == 400 and body["result"]["error_type"] == "invalid_request"
    assert body["ee_node_alias"] == "alias"
    reply = edgellm_error_reply(RuntimeError("boom"), "/predict", "RAW", NODE)
    body = json.loads(reply.body)
    assert reply.status == 503 and body["error_type"] == "engine_unavailable" and "boom" in body["error"]
    assert ("retry-after", "5") in reply.headers
    reply = edgellm_error_reply(RuntimeError("boom"), "/v1/chat/completions", "WRAPPED", NODE)
    assert reply.status == 503 and "message" in json.loads(reply.body)["error"]
    wire = reply.to_wire()
    assert wire[REPLY_MARK] and wire["status"] == 503 and json.loads(wire["body"])


# -- the ASGI bridge ----------------------------------------------------------------------------
def make_app(events: list[str], fail_startup: bool = False) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        events.append("startup")
        if fail_startup:
            raise RuntimeError("no model")
        yield
        events.append("shutdown")

    app = FastAPI(lifespan=lifespan)

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.body()
        return {
            "body": body.decode("latin-1"),
            "query": request.url.query,
            "auth": request.headers.get("authorization"),
            "client": request.client.host if request.client else None,
            "disconnected": await request.is_disconnected(),
        }

    @app.get("/boom")
    async def boom():
        raise ValueError("bug")

    return app


def error_reply(exc, request):
    return HttpReply(599, [("x-error", type(exc).__name__)], str(exc).encode())


def wait(future, timeout=10.0):
    return future.result(timeout)


def test_requests_round_trip_through_the_apps_lifespan():
    events: list[str] = []
    runner = AsgiAppRunner(lambda: make_app(events), error_reply=error_reply)
    runner.start()
    try:
        wire_body = "é\x00\xff".encode().decode("latin-1")  # any bytes survive the latin-1 wire format
        req = HttpRequest.from_wire(
            "post",
            "/echo",
            "a=1",
            [["Authorization", "Bearer t"], ["content-type", "text/plain"]],
            wire_body,
            ["10.0.0.9", 5],
        )
        reply = wait(runner.submit(req))
        assert reply.status == 200
        body = json.loads(reply.body)
        assert body == {
            "body": wire_body,
            "query": "a=1",
            "auth": "Bearer t",
            "client": "10.0.0.9",
            "disconnected": False,
        }
        assert events == ["startup"]
        assert wait(runner.submit(HttpRequest("GET", "/missing"))).status == 404
    finally:
        runner.stop()
    assert events == ["startup", "shutdown"]
    stopped = wait(runner.submit(HttpRequest("GET", "/echo")))
    assert stopped.status == 599 and b"stopping" in stopped.body


def test_an_exception_past_the_apps_handlers_is_still_one_reply():
    runner = AsgiAppRunner(lambda: make_app([]), error_reply=error_reply)
    runner.start()
    try:
        reply = wait(runner.submit(HttpRequest("GET", "/boom")))
        assert reply.status in (500, 599)
    finally:
        runner.stop()


def test_a_failed_startup_answers_every_request_with_the_error_reply():
    events: list[str] = []
    runner = AsgiAppRunner(lambda: make_app(events, fail_startup=True), error_reply=error_reply)
    runner.start()
    try:
        t0 = time.monotonic()
        reply = wait(runner.submit(HttpRequest("POST", "/echo")))
        assert reply.status == 599 and b"no model" in reply.body and time.monotonic() - t0 < 5
        with pytest.raises(RuntimeError):
            runner.started.result(1)
    finally:
        runner.stop()


def test_a_factory_that_raises_is_an_error_reply_too():
    def factory():
        raise SettingsError("bad settings")

    runner = AsgiAppRunner(factory, error_reply=error_reply)
    runner.start()
    try:
        reply = wait(runner.submit(HttpRequest("GET", "/")))
        assert reply.status == 599 and reply.headers == [("x-error", "SettingsError")]
    finally:
        runner.stop(timeout_s=5)

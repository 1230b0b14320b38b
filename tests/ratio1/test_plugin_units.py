"""EDGELLM_INFERENCE_API's pure parts, without naeural-core: config -> Settings, the node identity, the
ASGI bridge (lifespan, requests, failures) and the error replies. The plugin module itself imports
naeural_core and is exercised by test_node_integration.py."""

from __future__ import annotations

import json
import time

import pytest
from fastapi import FastAPI, Request

from edgellm.api.envelope import NodeIdentity, ResponseMode
from edgellm.errors import InvalidRequest
from edgellm.runtime.live_settings import classify
from edgellm.runtime.settings import SettingsError
from extensions.business.edgellm.asgi_bridge import (
    REPLY_MARK,
    AsgiAppRunner,
    HttpReply,
    HttpRequest,
    edgellm_error_reply,
)
from extensions.business.edgellm.held_requests import HeldRequests
from extensions.business.edgellm.plugin_config import (
    PLUGIN_DEFAULTS,
    balancing_from_config,
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


# -- upstream's serving params: MODEL_NAME + MODEL_FILENAME, MODEL_N_CTX, the ones refused -----------
HF_REPO = "example-org/Tiny-GGUF"
HF_FILE = "tiny.Q4_0.gguf"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
BLOB_SHA = "ab" * 32


def fake_hf_cache(root, repo=HF_REPO, filename=HF_FILE, data=b"GGUF fake weights"):
    """The layout huggingface_hub writes: refs/main -> a commit, snapshots/<commit>/FILE a relative link
    to ../../blobs/<sha256>."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    (folder / "blobs").mkdir()
    (folder / "blobs" / BLOB_SHA).write_bytes(data)
    snap = folder / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / filename).symlink_to(f"../../blobs/{BLOB_SHA}")
    return snap / filename


def test_model_name_and_filename_resolve_in_the_local_hugging_face_cache(tmp_path, monkeypatch):
    entry = fake_hf_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    s = settings({"MODEL_NAME": HF_REPO, "MODEL_FILENAME": HF_FILE, "MODEL_N_CTX": 2048})
    assert s.model_path == str(entry) and open(s.model_path, "rb").read() == b"GGUF fake weights"
    assert s.model_name == f"{HF_REPO}/{HF_FILE}"  # upstream's served name for a repo + file
    assert s.n_ctx == 2048
    # The same params inside STARTUP_AI_ENGINE_PARAMS (where upstream's pipelines put them); HF_TOKEN
    # changes nothing here (no download at run time) and is accepted.
    nested = settings(
        {"STARTUP_AI_ENGINE_PARAMS": {"MODEL_NAME": HF_REPO, "MODEL_FILENAME": HF_FILE, "HF_TOKEN": "hf_x"}}
    )
    assert nested.model_path == str(entry) and nested.model_name == f"{HF_REPO}/{HF_FILE}"


def test_a_file_missing_from_the_cache_is_an_error_that_says_how_to_fetch_it(tmp_path, monkeypatch):
    fake_hf_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(SettingsError) as err:
        settings({"MODEL_NAME": HF_REPO, "MODEL_FILENAME": "other.Q8_0.gguf"})
    assert f"edgellm pull hf://{HF_REPO}/other.Q8_0.gguf" in err.value.message
    assert str(tmp_path / "hub") in err.value.message and "nothing is downloaded" in err.value.message
    with pytest.raises(SettingsError, match="not in the local Hugging Face cache"):
        settings({"MODEL_NAME": "nobody/none", "MODEL_FILENAME": HF_FILE})
    # A dangling snapshot link (a half-deleted cache) is missing too, not a crash.
    (tmp_path / "hub" / ("models--" + HF_REPO.replace("/", "--")) / "blobs" / BLOB_SHA).unlink()
    with pytest.raises(SettingsError, match="edgellm pull"):
        settings({"MODEL_NAME": HF_REPO, "MODEL_FILENAME": HF_FILE})


def test_model_name_alone_stays_the_served_name_unless_it_is_a_repo_id():
    assert settings({"MODEL_NAME": "smollm2"}).model_name == "smollm2"
    assert settings({"MODEL_NAME": "mine", "MODEL_PATH": "/m.gguf"}).model_name == "mine"
    # With MODEL_PATH, the name is only a label (a repo-like one too): the model is the file.
    assert settings({"MODEL_NAME": "org/name", "MODEL_PATH": "/m.gguf"}).model_path == "/m.gguf"
    # A repo id and nothing to load it from would report that repo while serving the bundled model.
    with pytest.raises(SettingsError, match="MODEL_FILENAME"):
        settings({"MODEL_NAME": HF_REPO})
    with pytest.raises(SettingsError, match="Hugging Face repo"):
        settings({"MODEL_NAME": "no-slash", "MODEL_FILENAME": HF_FILE})
    with pytest.raises(SettingsError, match="both set"):
        settings({"MODEL_NAME": HF_REPO, "MODEL_FILENAME": HF_FILE, "MODEL_PATH": "/m.gguf"})
    with pytest.raises(SettingsError, match="MODEL_FILENAME must be a file name"):
        settings({"MODEL_NAME": HF_REPO, "MODEL_FILENAME": "../../etc/passwd"})


def test_model_n_ctx_is_n_ctx_and_two_different_values_are_refused():
    assert settings({"MODEL_N_CTX": 1024}).n_ctx == 1024
    assert settings({"MODEL_N_CTX": 1024, "N_CTX": 1024}).n_ctx == 1024
    with pytest.raises(SettingsError, match="N_CTX .* MODEL_N_CTX"):
        settings({"MODEL_N_CTX": 1024, "N_CTX": 2048})
    with pytest.raises(SettingsError, match="set twice"):
        settings({"MODEL_N_CTX": 1024, "STARTUP_AI_ENGINE_PARAMS": {"MODEL_N_CTX": 2048}})
    with pytest.raises(SettingsError, match="N_CTX"):  # edgellm's bounds, named by the plugin key
        settings({"MODEL_N_CTX": 0})


def test_request_balancing_keys_take_upstreams_defaults_and_refuse_bad_values():
    off = balancing_from_config({})
    assert not off.active and off.max_cstore_bytes == 512 * 1024 and off.peer_stale_s == 600
    assert off.request_ttl_s == PLUGIN_DEFAULTS["REQUEST_TIMEOUT"] and off.pending_limit_for(2) == 8
    on = balancing_from_config(
        {
            "REQUEST_BALANCING_ENABLED": True,
            "REQUEST_BALANCING_GROUP": " fleet ",
            "REQUEST_BALANCING_PENDING_LIMIT": 3,
            "REQUEST_BALANCING_PEER_STALE_SECONDS": 20,
            "REQUEST_BALANCING_CAPACITY_REFRESH_PERIOD": 5,
            "REQUEST_BALANCING_CAPACITY_REFRESH_JITTER_SECONDS": 2,
            "REQUEST_BALANCING_ACCEPT_UNSIGNED_FROM": ["0xai_up"],
        }
    )
    assert on.active and on.group_name == "fleet" and on.pending_limit_for(2) == 3 and on.peer_stale_s == 20
    assert on.accept_unsigned_from == ("0xai_up",)
    for bad, match in [
        ({"REQUEST_BALANCING_ENABLED": True}, "REQUEST_BALANCING_GROUP is not set"),
        ({"REQUEST_BALANCING_ENABLED": "yes"}, "true or false"),
        ({"REQUEST_BALANCING_MAX_CSTORE_BYTES": 100}, "MAX_CSTORE_BYTES must be a number >= 4096"),
        ({"REQUEST_BALANCING_PENDING_LIMIT": 1.5}, "whole number"),
        ({"REQUEST_BALANCING_ON_PEER_LOST": "retry"}, "rerun_local"),
        ({"REQUEST_BALANCING_ALLOWED_PEERS": "0xai_a"}, "list of node addresses"),
        (
            {
                "REQUEST_BALANCING_ENABLED": True,
                "REQUEST_BALANCING_GROUP": "g",
                "REQUEST_BALANCING_PEER_STALE_SECONDS": 30,
                "REQUEST_BALANCING_CAPACITY_REFRESH_PERIOD": 25,
                "REQUEST_BALANCING_CAPACITY_REFRESH_JITTER_SECONDS": 5,
            },
            "taken for a gone one",
        ),
    ]:
        with pytest.raises(SettingsError, match=match):
            settings(bad)  # refused with the rest of the config, before anything starts


def test_upstream_params_we_cannot_honour_are_refused_by_name():
    with pytest.raises(SettingsError) as err:
        settings({"CHAT_FORMAT": "chatml", "DEFAULT_TEMPERATURE": 0.2})
    assert "CHAT_FORMAT" in err.value.message and "DEFAULT_TEMPERATURE" in err.value.message
    with pytest.raises(SettingsError, match="STARTUP_AI_ENGINE_PARAMS.SOMETHING_ELSE"):
        settings({"STARTUP_AI_ENGINE_PARAMS": {"SOMETHING_ELSE": 1}})
    with pytest.raises(SettingsError, match="DRAFT_MODEL"):
        settings({"STARTUP_AI_ENGINE_PARAMS": {"DRAFT_MODEL": "tiny.gguf"}})
    # Unset (None), off (False) and the inert ones pass: they ask for nothing we do differently.
    s = settings(
        {
            "CHAT_FORMAT": None,
            "REQUEST_BALANCING_ENABLED": False,
            "DETERMINISTIC_MODE": False,
            "SAVE_PERIOD": 300,
            "STARTUP_AI_ENGINE_PARAMS": {"SERVER_COLLECTOR_TIMEDELTA": 360000, "HF_TOKEN": None},
        }
    )
    assert s.n_ctx == PLUGIN_DEFAULTS["N_CTX"]


# -- RATE_LIMIT_PER_MINUTE -----------------------------------------------------------------------
def test_rate_limit_key_and_upstreams_effective_default():
    assert settings().rate_limit_per_minute == 0  # loopback, no tunnel: upstream applies no limit either
    assert settings({"RATE_LIMIT_PER_MINUTE": 30}).rate_limit_per_minute == 30
    tunnel = settings({"TUNNEL_ENGINE_ENABLED": True}, environ={"INFERENCE_API_TOKEN": "t"})
    assert tunnel.rate_limit_per_minute == 5  # upstream's default, where upstream enforces it
    off = settings({"TUNNEL_ENGINE_ENABLED": True, "RATE_LIMIT_PER_MINUTE": 0}, environ={"INFERENCE_API_TOKEN": "t"})
    assert off.rate_limit_per_minute == 0
    with pytest.raises(SettingsError, match="RATE_LIMIT_PER_MINUTE"):
        settings({"RATE_LIMIT_PER_MINUTE": -1})


def test_the_rate_limiter_counts_per_subject_per_calendar_minute():
    from edgellm.api.rate_limit import RateLimited, RateLimiter

    now = [120.0 * 60 + 10.0]  # 10 s into a minute
    limiter = RateLimiter(2, clock=lambda: now[0])
    limiter.hit("owner-a")
    limiter.hit("owner-a")
    with pytest.raises(RateLimited) as err:
        limiter.hit("owner-a")
    assert err.value.http_status == 429 and err.value.headers["Retry-After"] == "50"
    assert limiter.remaining("owner-a") == 0
    limiter.hit("owner-b")  # another subject: its own budget
    limiter.hit(None)
    limiter.hit("anonymous")  # None is the anonymous subject: one shared budget
    with pytest.raises(RateLimited):
        limiter.hit(None)
    now[0] += 49.5  # 59.5 s into the minute: Retry-After rounds up, never 0
    with pytest.raises(RateLimited) as err:
        limiter.hit("owner-a")
    assert err.value.headers["Retry-After"] == "1"
    now[0] += 1.0  # the minute turned: every budget is whole again
    assert limiter.remaining("owner-a") == 2
    limiter.hit("owner-a")
    limiter.hit("owner-a")
    off = RateLimiter(0)
    for _ in range(1000):
        off.hit("x")
    assert off.remaining("x") is None
    with pytest.raises(ValueError):
        RateLimiter(-1)


# -- SEMAPHORE: the exported URL is one the instance listens on -------------------------------------
def test_semaphore_env_exports_an_address_that_is_listened_on():
    from extensions.business.edgellm.plugin_config import semaphore_env

    assert semaphore_env("0.0.0.0", 15080, "10.1.2.3") == {
        "API_HOST": "10.1.2.3",
        "API_IP": "10.1.2.3",
        "API_PORT": "15080",
        "API_URL": "http://10.1.2.3:15080",
    }
    assert semaphore_env("127.0.0.1", 15080, "10.1.2.3")["API_URL"] == "http://127.0.0.1:15080"  # not the LAN IP
    assert semaphore_env("192.168.7.9", 80, "10.1.2.3")["API_URL"] == "http://192.168.7.9:80"
    assert semaphore_env("0.0.0.0", 15080, None)["API_URL"] == "http://127.0.0.1:15080"
    assert semaphore_env("fd00::5", 15080, None)["API_URL"] == "http://[fd00::5]:15080"
    assert "API_URL" not in semaphore_env("0.0.0.0", None, "10.1.2.3")


# -- the opt-in LLM_INFERENCE_API alias -------------------------------------------------------------
def test_install_copies_the_plugin_beside_upstreams_and_the_alias_is_opt_in(tmp_path):
    from edgellm.ratio1.install import ALIAS_MARK, install

    app = tmp_path / "edge_node"
    upstream = app / "extensions" / "business" / "edge_inference_api" / "llm_inference_api.py"
    upstream.parent.mkdir(parents=True)
    upstream.write_text("class LLMInferenceApiPlugin: pass  # upstream's\n")
    install(app)
    ours = app / "extensions" / "business" / "edgellm" / "edgellm_inference_api.py"
    assert ours.is_file() and (ours.parent / "plugin_config.py").is_file()
    assert (ours.parent / "edgellm_main.py.j2").is_file()
    assert "upstream's" in upstream.read_text()  # untouched: both plugins are there
    install(app, take_over=True)
    alias = upstream.read_text()
    assert alias.startswith(ALIAS_MARK) and "class LlmInferenceApiPlugin(EdgellmInferenceApiPlugin)" in alias
    assert "upstream's" in upstream.with_name("llm_inference_api.py.upstream").read_text()
    install(app, take_over=True)  # again: the kept upstream file is not overwritten by the alias
    assert "upstream's" in upstream.with_name("llm_inference_api.py.upstream").read_text()
    install(app)  # without the flag: upstream's file is back
    assert "upstream's" in upstream.read_text() and not upstream.with_name("llm_inference_api.py.upstream").exists()


# -- pipeline updates: what changes live, what rebuilds, what is refused -------------------------------
def _settings(tmp_path, **config):
    return settings_from_config(
        {**PLUGIN_DEFAULTS, **config}, data_folder=str(tmp_path), instance_key="p__i", environ={}
    )


def test_a_config_update_is_sorted_into_live_rebuild_and_refused(tmp_path):
    base = _settings(tmp_path)
    live = classify(base, _settings(tmp_path, RESPONSE_FORMAT="RAW", PREDEFINED_AUTH_TOKENS=["t-1"], TEMPERATURE_MAX=1))
    assert set(live.live) == {"response_format", "tokens", "temperature_max"} and not live.restart and not live.refused
    rebuild = classify(base, _settings(tmp_path, N_CTX=2048, RESPONSE_FORMAT="RAW"))
    assert rebuild.restart == ("n_ctx",) and rebuild.live == ("response_format",)
    refused = classify(base, _settings(tmp_path, MAX_BODY_BYTES=2_000_000, N_SLOTS=2))
    assert refused.refused == ("max_body_bytes",) and refused.restart == ("n_slots",)
    assert classify(base, _settings(tmp_path)).empty


def test_held_requests_wait_for_the_new_app_and_none_falls_between(tmp_path):
    events: list[str] = []
    held = HeldRequests()
    early = [held.hold(HttpRequest("POST", "/echo", body=f"r{i}".encode())) for i in range(3)]
    assert not any(f.done() for f in early) and len(held) == 3
    runner = AsgiAppRunner(lambda: make_app(events), error_reply=error_reply)
    runner.start()
    try:
        assert held.release(runner) == 3
        assert [json.loads(wait(f).body)["body"] for f in early] == ["r0", "r1", "r2"]
        late = held.hold(HttpRequest("POST", "/echo", body=b"after"))  # after the release: straight through
        assert json.loads(wait(late).body)["body"] == "after" and len(held) == 0
    finally:
        runner.stop()

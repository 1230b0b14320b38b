"""A real offline Ratio1 node (naeural-core in its own venv, a local mosquitto) serving this repo's
EDGELLM_INFERENCE_API plugin, driven through the node's HTTP ports.

One node per module (`ratio1_node`), started by `edgellm.ratio1.launcher` (the code behind
`edgellm ratio1-node`), with these instances of the plugin in one Loopback pipeline:
- wrapped: the default (WRAPPED, anonymous on loopback), N_SLOTS 4, N_CTX 4096;
- raw: RESPONSE_FORMAT RAW with a short REQUEST_TTL_SECONDS (eviction of failed records);
- auth: PREDEFINED_AUTH_TOKENS on loopback (auth is enforced even there);
- broken: a MODEL_PATH that is not a GGUF (an engine failure answers at once);
- unsafe: HOST 0.0.0.0 without a token (refused);
- live: reconfigured by pipeline updates (UPDATE_CONFIG) while it serves;
and a second plugin entry under upstream's signature LLM_INFERENCE_API (the opt-in alias, which the
launcher installs in the work dir) as a stock-node pipeline would write it:
- upstream: the model as upstream names it (STARTUP_AI_ENGINE_PARAMS MODEL_NAME + MODEL_FILENAME, read
  from a Hugging Face cache laid out in the work dir), MODEL_N_CTX, HOST 0.0.0.0 with two tokens (a
  container's setup), RATE_LIMIT_PER_MINUTE;
- not_pulled: a MODEL_FILENAME the cache does not hold (refused, saying how to fetch it).

It needs the node venv: `make ratio1-setup` builds it and `make test` exports EDGELLM_RATIO1_PYTHON.
Without it the tests fail (never skip): CI must run them.

Other plugin tests can share this node: use the `ratio1_node` fixture (`.base_url` of the wrapped
instance, `.output_dir` the node's output folder, `.workdir`), and add pipelines to
`extra_pipelines()` so they start with the same node.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

from edgellm.ratio1.launcher import NodeOptions, Ratio1Node
from edgellm.ratio1.ports import free_port
from tests.nodeproc import wait_until
from tests.process_hygiene import watch

TOKEN = "ratio1-test-token-5b1f0c"
NODE_KEYS = {"server_node_addr", "evm_network", "ee_node_alias", "ee_node_address", "ee_node_eth_address"}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def chat(content: str = "Say hello.", **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], **fields}


SYNTH_COUNT = 8
SYNTH_EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "ratio1" / "examples" / "synthetic_data.json"


def extra_pipelines(ports: dict[str, int], workdir: Path) -> list[dict]:
    """Pipelines other tests add to the shared node (e.g. a client plugin of LLM_INFERENCE_API)."""
    # The shipped SYNTHETIC_DATA_GENERATOR example, a client of the RAW instance (its own engine: the
    # wrapped instance's tests do not share slots with it), made small.
    synth = json.loads(SYNTH_EXAMPLE.read_text())
    synth["PLUGINS"][0]["INSTANCES"][0].update(
        API_PORT=ports["raw"], COUNT=SYNTH_COUNT, CONCURRENCY=2, MAX_TOKENS=96, PROGRESS_INTERVAL=1
    )
    # A test-only plugin that sends UPDATE_CONFIG from inside the node (there is no deeploy offline):
    # tests/ratio1/node_plugins, put in the node's plugins/ folder by the fixture.
    pusher = {
        "NAME": "edgellm_test_config",
        "TYPE": "Void",
        "PLUGINS": [
            {
                "SIGNATURE": "EDGELLM_TEST_CONFIG_PUSHER",
                "INSTANCES": [{"INSTANCE_ID": "pusher", "INBOX": str(workdir / "config_updates")}],
            }
        ],
    }
    return [synth, pusher]


HF_REPO = "edgellm-test/SmolLM2-135M-Instruct-GGUF"
HF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
RATE_TOKENS = ("ratio1-rate-a-41c9", "ratio1-rate-b-7d20")
RATE_LIMIT = 4


def hf_cache_with_the_bundled_model(root: Path) -> Path:
    """A Hugging Face hub cache (the layout huggingface_hub writes) holding the bundled GGUF as
    HF_REPO/HF_FILE: refs/main -> a commit, snapshots/<commit>/FILE -> ../../blobs/<sha256>."""
    import hashlib

    from edgellm.runtime.model_sizing import bundled_model_path

    model = Path(bundled_model_path())
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    folder = root / ("models--" + HF_REPO.replace("/", "--"))
    commit = "f" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "blobs").mkdir()
    (folder / "blobs" / digest).symlink_to(model)  # no 98 MB copy: the blob is the bundled file
    (folder / "snapshots" / commit).mkdir(parents=True)
    (folder / "snapshots" / commit / HF_FILE).symlink_to(f"../../blobs/{digest}")
    return root


def api_pipeline(ports: dict[str, int], broken_model: Path) -> dict:
    small = {"N_SLOTS": 2, "N_CTX": 2048, "TUNNEL_ENGINE_ENABLED": False}
    return {
        "NAME": "llm_api",
        "TYPE": "Loopback",
        "PLUGINS": [
            {
                "SIGNATURE": "EDGELLM_INFERENCE_API",
                "INSTANCES": [
                    {"INSTANCE_ID": "wrapped", "PORT": ports["wrapped"], "N_SLOTS": 4, "N_CTX": 4096},
                    {
                        "INSTANCE_ID": "raw",
                        "PORT": ports["raw"],
                        "RESPONSE_FORMAT": "RAW",
                        "REQUEST_TTL_SECONDS": 3,
                        **small,
                    },
                    {"INSTANCE_ID": "auth", "PORT": ports["auth"], "PREDEFINED_AUTH_TOKENS": [TOKEN], **small},
                    {
                        "INSTANCE_ID": "broken",
                        "PORT": ports["broken"],
                        "MODEL_PATH": str(broken_model),
                        "N_SLOTS": 1,
                        "N_CTX": 512,
                    },
                    # Anonymous on all interfaces: refused by the config check, answers 503 on loopback.
                    {"INSTANCE_ID": "unsafe", "PORT": ports["unsafe"], "HOST": "0.0.0.0"},
                    {"INSTANCE_ID": "live", "PORT": ports["live"], "N_SLOTS": 1, "N_CTX": 1024},
                ],
            },
            {
                # Upstream's signature: the opt-in alias, configured the way upstream's docs write it.
                "SIGNATURE": "LLM_INFERENCE_API",
                "INSTANCES": [
                    {
                        "INSTANCE_ID": "upstream",
                        "PORT": ports["upstream"],
                        "HOST": "0.0.0.0",
                        "PREDEFINED_AUTH_TOKENS": list(RATE_TOKENS),
                        "RATE_LIMIT_PER_MINUTE": RATE_LIMIT,
                        "SEMAPHORE": "edgellm_it_api",
                        "N_SLOTS": 1,
                        "STARTUP_AI_ENGINE_PARAMS": {
                            "HF_TOKEN": "<hf_token_if_needed>",
                            "MODEL_NAME": HF_REPO,
                            "MODEL_FILENAME": HF_FILE,
                            "MODEL_N_CTX": 1024,
                            "SERVER_COLLECTOR_TIMEDELTA": 360000,
                        },
                    },
                    {
                        "INSTANCE_ID": "not_pulled",
                        "PORT": ports["not_pulled"],
                        "MODEL_NAME": HF_REPO,
                        "MODEL_FILENAME": "SmolLM2-135M-Instruct.Q8_0.gguf",
                    },
                ],
            },
        ],
    }


class WatchedRatio1Node(Ratio1Node):
    """Ratio1Node whose broker and node (each started in a session of its own) are registered with the
    test run's sentinel as soon as they are started: a killed pytest leaves neither, nor what the node
    started (tests/process_hygiene.py)."""

    def _start_broker(self, mosquitto: str) -> None:
        try:
            super()._start_broker(mosquitto)
        finally:
            if self.broker is not None:
                watch(self.broker.pid, group=True)

    def _start_node(self, startup: Path) -> None:
        super()._start_node(startup)
        watch(self.node.pid, group=True)


NODE_PLUGINS = Path(__file__).resolve().parent / "node_plugins" / "business"
REPO_PLUGINS = Path(__file__).resolve().parents[2] / "plugins" / "business"


def node_plugins(workdir: Path) -> None:
    """The node's plugins/ folder as a real folder (the launcher keeps one it finds): this repo's
    plugins plus the test-only ones, each linked."""
    business = workdir / "plugins" / "business"
    business.mkdir(parents=True)
    for src in [*REPO_PLUGINS.iterdir(), *NODE_PLUGINS.iterdir()]:
        if src.is_dir() and not src.name.startswith("__"):
            (business / src.name).symlink_to(src, target_is_directory=True)
    (workdir / "config_updates").mkdir()


def node_python() -> str:
    """The node venv's interpreter; the test fails (never skips) without it: CI must run the node tests."""
    python = os.environ.get("EDGELLM_RATIO1_PYTHON")
    if not python:
        pytest.fail(
            "EDGELLM_RATIO1_PYTHON is not set: run `make ratio1-setup` (builds the Ratio1 node venv and installs "
            "mosquitto), then export EDGELLM_RATIO1_PYTHON=$(tools/ratio1_venv.sh)/bin/python -- `make test` does both"
        )
    return python


@pytest.fixture(scope="module")
def ratio1_node(tmp_path_factory, background_stops) -> Ratio1Node:
    """One real offline node for the module; stopped (SIGINT to its process group) at the end, on a thread
    (tests/ratio1/conftest.py: background_stops), which the package's end joins and checks."""
    python = node_python()
    workdir = tmp_path_factory.mktemp("ratio1-node")
    broken = workdir / "not-a-model.gguf"
    broken.write_bytes(b"this is not a GGUF file\n" * 64)
    names = ("wrapped", "raw", "auth", "broken", "unsafe", "live", "upstream", "not_pulled")
    ports = {name: free_port() for name in names}
    node_plugins(workdir)
    hf_cache = hf_cache_with_the_bundled_model(workdir / "hf-hub")
    node = WatchedRatio1Node(
        NodeOptions(
            python=python,
            workdir=workdir,
            mqtt_port=free_port(),
            node_id="edgellm-it",
            pipelines=[api_pipeline(ports, broken), *extra_pipelines(ports, workdir)],
            env={"HF_HUB_CACHE": str(hf_cache)},
            ready_timeout_s=240,
        )
    )
    node.start()
    try:
        by_id = {inst.instance_id: inst for inst in node.instances}
        node.wait_http(by_id["raw"], timeout_s=120)
        node.wait_http(by_id["auth"], timeout_s=120)
        node.wait_http(by_id["broken"], timeout_s=120, ok=(503,))
        node.wait_http(by_id["unsafe"], timeout_s=120, ok=(503,))
        node.wait_http(by_id["upstream"], timeout_s=120)
        node.wait_http(by_id["not_pulled"], timeout_s=120, ok=(503,))
        node.wait_http(by_id["live"], timeout_s=120)
        yield node
    finally:

        def exited() -> None:
            assert node.node.returncode is not None

        background_stops.add("the integration node", node.stop, exited)


def url_of(node: Ratio1Node, instance_id: str) -> str:
    return next(i.base_url for i in node.instances if i.instance_id == instance_id)


@pytest.fixture(scope="module")
def client(ratio1_node) -> httpx.Client:
    with httpx.Client(base_url=ratio1_node.base_url, timeout=180) as c:
        yield c


@pytest.fixture(scope="module")
def raw_client(ratio1_node) -> httpx.Client:
    with httpx.Client(base_url=url_of(ratio1_node, "raw"), timeout=180) as c:
        yield c


def text_of(result: dict) -> str:
    return result["TEXT_RESPONSE"][0]


# -- the node and its identity --------------------------------------------------------------------
def test_wrapped_bodies_carry_the_nodes_real_identity(ratio1_node, client):
    r = client.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["result"]["status"] == "ok"
    assert body["ee_node_alias"] == "edgellm-it"
    assert body["ee_node_address"].startswith("0xai_") and body["server_node_addr"] == body["ee_node_address"]
    assert body["ee_node_eth_address"].startswith("0x") and len(body["ee_node_eth_address"]) == 42
    assert not body["ee_node_address"].startswith("edgellm:")  # not the native host's stand-in identity
    print(f"\nnode ready in {ratio1_node.ready_s:.1f} s")


# -- sync, guided --------------------------------------------------------------------------------
def test_sync_chat_completion_with_a_json_schema(client):
    body = chat(
        "Create a fictional person as JSON with name, age and city.",
        max_tokens=120,
        temperature=0.3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    )
    r = client.post("/create_chat_completion", json=body)
    assert r.status_code == 200, r.text
    result = r.json()["result"]
    jsonschema.validate(json.loads(text_of(result)), SCHEMA)
    assert result["FULL_OUTPUT"][0]["choices"][0]["finish_reason"] == "stop"


# -- async + request_status ----------------------------------------------------------------------
def test_async_submit_then_poll_with_return_full_and_metadata(client):
    meta = {"job": "it-7", "tags": ["a", "b"]}
    r = client.post("/create_chat_completion_async", json=chat("Name a colour.", max_tokens=16, metadata=meta))
    assert r.status_code == 200, r.text
    request_id = r.json()["result"]["request_id"]
    deadline = time.monotonic() + 120
    while True:
        status = client.get("/request_status", params={"request_id": request_id, "return_full": "true"})
        assert status.status_code == 200, status.text
        res = status.json()["result"]
        if res["status"] != "pending" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert res["status"] == "completed"
    assert res["request_id"] == request_id and res["result"]["REQUEST_ID"] == request_id
    assert res["metadata"] == meta and res["params"]["max_tokens"] == 16
    assert res["mode"] == "async" and isinstance(res["seed"], int)


# -- errors keep their status --------------------------------------------------------------------
def test_a_validation_error_is_a_4xx_in_the_wrapped_envelope(client):
    r = client.post("/create_chat_completion", json=chat(temperature=3))
    assert r.status_code == 400
    body = r.json()
    assert body["result"]["error_type"] == "invalid_request" and body["result"]["status_code"] == 400
    assert "temperature" in body["result"]["error"]
    assert NODE_KEYS <= body.keys()
    r = client.get("/request_status", params={"request_id": "never-submitted"})
    assert r.status_code == 404 and r.json()["result"]["error_type"] == "not_found"


def test_raw_has_no_node_keys_and_keeps_error_statuses(raw_client):
    r = raw_client.post("/create_chat_completion", json=chat("Say hi.", max_tokens=16, temperature=0))
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"REQUEST_ID", "MODEL_NAME", "TEXT_RESPONSE", "FULL_OUTPUT"}
    r = raw_client.post("/create_chat_completion", json=chat(max_tokens=5))
    assert r.status_code == 400
    assert r.json()["error_type"] == "invalid_request" and not NODE_KEYS & r.json().keys()
    r = raw_client.post("/create_chat_completion", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


# -- sampling parameters reach the engine --------------------------------------------------------
def test_temperature_zero_stays_zero(client):
    body = chat("Write one sentence about the sea.", max_tokens=48, temperature=0)
    texts = [text_of(client.post("/create_chat_completion", json=body).json()["result"]) for _ in range(2)]
    assert texts[0] and texts[0] == texts[1]
    params = client.get(
        "/request_status",
        params={
            "request_id": client.post("/create_chat_completion_async", json=body).json()["result"]["request_id"],
            "return_full": "true",
        },
    ).json()["result"]["params"]
    assert params["temperature"] == 0.0  # stored as sent: not turned into a default


def test_seed_stop_and_penalties_are_honoured(client):
    prompt = "Write a short poem about mountains."
    seeded = chat(prompt, max_tokens=40, temperature=1.0, seed=1234)
    a, b = (text_of(client.post("/create_chat_completion", json=seeded).json()["result"]) for _ in range(2))
    assert a == b  # same seed at temperature 1: the same sample
    others = {
        text_of(client.post("/create_chat_completion", json={**seeded, "seed": s}).json()["result"]) for s in (1, 2)
    }
    assert others - {a}  # another seed: another sample

    plain = text_of(
        client.post("/create_chat_completion", json=chat(prompt, max_tokens=40, temperature=0)).json()["result"]
    )
    words = plain.split()
    assert len(words) > 4
    stop = words[3]
    cut = client.post("/create_chat_completion", json=chat(prompt, max_tokens=40, temperature=0, stop=[stop])).json()
    assert text_of(cut["result"]) == plain[: plain.index(stop)]
    assert cut["result"]["FULL_OUTPUT"][0]["choices"][0]["finish_reason"] == "stop"

    penalised = chat(
        prompt, max_tokens=40, temperature=0, repeat_penalty=1.8, frequency_penalty=1.5, presence_penalty=1.5
    )
    assert text_of(client.post("/create_chat_completion", json=penalised).json()["result"]) != plain


# -- concurrency, ids ----------------------------------------------------------------------------
def test_eight_concurrent_requests_are_all_answered_each_with_its_own_id(client):
    out: dict[str, tuple[int, dict]] = {}

    def one(i: int) -> None:
        rid = f"it-concurrent-{i}"
        body = chat(f"Write a haiku about the number {i}.", max_tokens=48, temperature=0.7, seed=i, request_id=rid)
        with httpx.Client(base_url=client.base_url, timeout=180) as c:
            r = c.post("/create_chat_completion", json=body)
        out[rid] = (r.status_code, r.json())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(out) == 8
    for rid, (status, body) in out.items():
        assert status == 200, body
        assert body["result"]["REQUEST_ID"] == rid and text_of(body["result"])


# -- auth ----------------------------------------------------------------------------------------
def test_tokens_are_enforced_on_loopback_and_never_stored(ratio1_node):
    with httpx.Client(base_url=url_of(ratio1_node, "auth"), timeout=180) as c:
        r = c.post("/create_chat_completion", json=chat(max_tokens=16))
        assert r.status_code == 401 and r.json()["result"]["error_type"] == "unauthorized"
        assert (
            c.post(
                "/create_chat_completion", json=chat(max_tokens=16), headers={"Authorization": "Bearer nope"}
            ).status_code
            == 401
        )
        assert c.get("/status").status_code == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        r = c.post("/create_chat_completion_async", json=chat("Say hi.", max_tokens=16), headers=auth)
        assert r.status_code == 200, r.text
        rid = r.json()["result"]["request_id"]
        assert c.get("/request_status", params={"request_id": rid}).status_code == 401
        deadline = time.monotonic() + 60
        while True:
            full = c.get("/request_status", params={"request_id": rid, "return_full": "true"}, headers=auth)
            if full.json()["result"]["status"] != "pending" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert full.status_code == 200 and full.json()["result"]["status"] == "completed"
        assert TOKEN not in full.text
    # The registry holds an owner hash, never the token.
    stores = list(ratio1_node.workdir.rglob("requests.sqlite3"))
    assert stores
    for path in stores:
        with sqlite3.connect(path) as db:
            dump = "\n".join(db.iterdump())
        assert TOKEN not in dump


# -- failures: answered at once, evicted after the TTL -------------------------------------------
def test_an_engine_failure_answers_at_once(ratio1_node):
    """A MODEL_PATH that is not a GGUF is refused before any engine worker starts (the header check of
    Settings.model()): every call, /health included, is answered at once with a 503 naming the file."""
    with httpx.Client(base_url=url_of(ratio1_node, "broken"), timeout=30) as c:
        deadline = time.monotonic() + 60
        while "cannot be loaded" not in (health := c.get("/health")).text:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.5)
        assert health.status_code == 503 and "not-a-model.gguf" in health.json()["result"]["error"]
        t0 = time.monotonic()
        r = c.post("/create_chat_completion", json=chat(max_tokens=16))
        # "At once": no engine to wait for (the client allows 30 s, a queued request would wait its 600 s
        # timeout); 5 s is a generous bound for one loopback round trip through the node on 2 busy cores.
        assert time.monotonic() - t0 < 5
        assert r.status_code == 503 and r.json()["result"]["error_type"] == "engine_unavailable"
        assert "not-a-model.gguf" in r.json()["result"]["error"]


def outbound_address() -> str | None:
    """This machine's address on its default route (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if addr.startswith("127.") else addr


def test_an_unsafe_instance_config_is_refused_not_served(ratio1_node):
    port = next(i.port for i in ratio1_node.instances if i.instance_id == "unsafe")
    r = httpx.post(f"http://127.0.0.1:{port}/create_chat_completion", json=chat(max_tokens=16), timeout=30)
    assert r.status_code == 503
    assert "non-loopback" in r.json()["result"]["error"]
    addr = outbound_address()
    if addr:  # the node's uvicorn bound loopback, not 0.0.0.0: another address of this machine does not answer
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{addr}:{port}/health", timeout=5)


# -- a stock-node pipeline: upstream's signature (the alias), model params, HOST 0.0.0.0, rate limit --
def test_upstreams_signature_serves_the_hugging_face_model_it_names(ratio1_node):
    """LLM_INFERENCE_API resolves to edgellm's plugin through the alias; MODEL_NAME + MODEL_FILENAME in
    STARTUP_AI_ENGINE_PARAMS are read from the Hugging Face cache and reported under upstream's name;
    HOST 0.0.0.0 with tokens serves (and asks for a token)."""
    inst = next(i for i in ratio1_node.instances if i.instance_id == "upstream")
    auth = {"Authorization": f"Bearer {RATE_TOKENS[1]}"}
    with httpx.Client(base_url=inst.base_url, timeout=180) as c:
        assert c.post("/predict", json=chat(max_tokens=16)).status_code == 401  # not on loopback: a token
        models = c.get("/v1/models", headers=auth)
        assert models.status_code == 200, models.text
        assert [m["id"] for m in models.json()["data"]] == [f"{HF_REPO}/{HF_FILE}"]
        r = c.post("/predict", json=chat("Say hi.", max_tokens=16, temperature=0), headers=auth)
        assert r.status_code == 200, r.text
        result = r.json()["result"]
        assert result["MODEL_NAME"] == f"{HF_REPO}/{HF_FILE}" and text_of(result)
        assert r.json()["ee_node_alias"] == "edgellm-it"  # the node's envelope: the plugin is ours
    addr = outbound_address()
    if addr:  # bound to every interface: this machine's other address answers too (a container's view)
        assert httpx.get(f"http://{addr}:{inst.port}/health", timeout=10).status_code == 200
    # SEMAPHORE pairing: the URL handed to consumers is one this instance answers on.
    exported = re.compile(r"SEMAPHORE edgellm_it_api: exported API_URL=(http://[^\s\x1b]+)")  # before a color code
    deadline = time.monotonic() + 60
    while not (found := exported.search(ratio1_node.log_path.read_text(errors="replace"))):
        assert time.monotonic() < deadline, "the SEMAPHORE export was not logged"
        time.sleep(0.5)
    url = found.group(1)
    if addr:  # HOST 0.0.0.0: the machine's address, as upstream exports it
        assert url == f"http://{addr}:{inst.port}"
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_a_model_not_in_the_cache_is_refused_with_how_to_fetch_it(ratio1_node):
    with httpx.Client(base_url=url_of(ratio1_node, "not_pulled"), timeout=30) as c:
        r = c.post("/predict", json=chat(max_tokens=16))
        assert r.status_code == 503
        error = r.json()["result"]["error"]
        assert f"edgellm pull hf://{HF_REPO}/SmolLM2-135M-Instruct.Q8_0.gguf" in error, error


def test_rate_limit_per_minute_is_per_token_through_the_node(ratio1_node):
    """RATE_LIMIT_PER_MINUTE through the node's uvicorn and IPC: 429 + Retry-After for the token past
    its budget, the other token unaffected."""
    a = {"Authorization": f"Bearer {RATE_TOKENS[0]}"}
    b = {"Authorization": f"Bearer {RATE_TOKENS[1]}"}

    def minute() -> int:
        return int(time.time() // 60)

    with httpx.Client(base_url=url_of(ratio1_node, "upstream"), timeout=180) as c:
        # The budget is per calendar minute (the node's clock is this machine's): the burst counts only if
        # it began and ended in one minute. One that straddled a minute's turn is sent again in the minute
        # after the next (every budget whole again); a burst takes well under a second.
        for _ in range(3):
            if time.time() % 60 > 50:  # too close to the turn: wait for it
                start = minute()
                wait_until(lambda start=start: minute() != start, 15, "the next calendar minute")
            start = minute()
            burst = [c.post("/predict_async", json=chat(max_tokens=16), headers=a) for _ in range(RATE_LIMIT)]
            over = c.post("/predict_async", json=chat(max_tokens=16), headers=a)
            other = c.post("/predict_async", json=chat(max_tokens=16), headers=b)
            if minute() == start:
                break
            wait_until(lambda start=start: minute() >= start + 2, 125, "a calendar minute no burst has touched")
        else:
            pytest.fail("three bursts of 6 requests each straddled a minute's turn")
        for r in burst:
            assert r.status_code == 200, r.text
        assert over.status_code == 429, over.text
        assert 1 <= int(over.headers["Retry-After"]) <= 60
        assert over.json()["result"]["error_type"] == "rate_limited"
        assert other.status_code == 200, other.text


def test_a_body_over_the_limit_is_413(client):
    big = b"x" * (2 * 1024 * 1024)
    r = client.post("/create_chat_completion", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["result"]["error_type"] == "payload_too_large"


def test_timed_out_records_are_evicted_after_the_ttl(raw_client):
    r = raw_client.post(
        "/create_chat_completion", json=chat("Write a long story.", max_tokens=400, timeout=0.05, request_id="it-ttl-1")
    )
    assert r.status_code == 504 and r.json()["error_type"] == "timeout"
    status = raw_client.get("/request_status", params={"request_id": "it-ttl-1"})
    assert status.status_code == 200 and status.json()["status"] == "timeout"
    deadline = time.monotonic() + 20  # TTL 3 s; eviction runs every second
    while raw_client.get("/request_status", params={"request_id": "it-ttl-1"}).status_code != 404:
        assert time.monotonic() < deadline, "the timed-out record was not evicted"
        time.sleep(0.5)


# -- the OpenAI route through the catch-all ------------------------------------------------------
def test_openai_client_through_the_node(ratio1_node):
    from openai import OpenAI

    oa = OpenAI(base_url=ratio1_node.base_url + "/v1", api_key="unused", timeout=120)
    model = oa.models.list().data[0].id
    done = oa.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=12, temperature=0
    )
    assert done.choices[0].message.content and done.usage.completion_tokens > 0
    chunks = list(
        oa.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=12, temperature=0, stream=True
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == done.choices[0].message.content


# -- the SYNTHETIC_DATA_GENERATOR user plugin (plugins/business), a client of LLM_INFERENCE_API -----
def test_synthetic_data_plugin_writes_schema_valid_records(ratio1_node):
    example = json.loads(SYNTH_EXAMPLE.read_text())["PLUGINS"][0]["INSTANCES"][0]
    out = ratio1_node.output_dir / "synthetic_data" / example["OUTPUT_FILE"]
    deadline = time.monotonic() + 300
    while not (out.exists() and len(out.read_text().splitlines()) >= SYNTH_COUNT):
        assert time.monotonic() < deadline, (
            f"{out}: not {SYNTH_COUNT} records in time\n{ratio1_node.log_path.read_text()[-3000:]}"
        )
        time.sleep(1)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == SYNTH_COUNT
    for row in rows:
        jsonschema.validate(row, example["SCHEMA"])
    assert len({json.dumps(r, sort_keys=True) for r in rows}) == SYNTH_COUNT
    # its progress payloads (logged by the plugin as it sends them) end with "done"
    deadline = time.monotonic() + 30
    while "'SYNTH_STATUS': 'done'" not in ratio1_node.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, "no 'done' payload from the synthetic data plugin"
        time.sleep(0.5)
    done = [
        ln for ln in ratio1_node.log_path.read_text(errors="replace").splitlines() if "'SYNTH_STATUS': 'done'" in ln
    ]
    rate = re.search(r"'SYNTH_RECORDS_PER_MIN': ([0-9.]+)", done[-1])
    print(f"\nsynthetic data plugin through the Ratio1 node: {rate.group(1) if rate else '?'} valid records/min")


# -- live config: pipeline updates while the instance serves -----------------------------------------
LIVE_TOKEN = "ratio1-live-token-19ce"


def push_update(node: Ratio1Node, pipeline: dict, n: int) -> None:
    """An UPDATE_CONFIG for `pipeline`, sent by the node's test pusher plugin (see extra_pipelines)."""
    inbox = node.workdir / "config_updates"
    (inbox / f"update-{n}.tmp").write_text(json.dumps(pipeline))
    (inbox / f"update-{n}.tmp").rename(inbox / f"update-{n}.json")  # whole, or not at all


def test_a_pipeline_update_takes_request_rules_live_and_rebuilds_the_engine_drained(ratio1_node):
    """UPDATE_CONFIG on the real node: RESPONSE_FORMAT and tokens are taken at once (same engine worker);
    N_CTX restarts the engine drained: an async request accepted before completes, a request sent
    during the rebuild waits and is answered (no 503), and the new worker runs the new context."""
    pipeline = json.loads(json.dumps(ratio1_node.options.pipelines[0]))
    live = next(i for p in pipeline["PLUGINS"] for i in p["INSTANCES"] if i["INSTANCE_ID"] == "live")
    auth = {"Authorization": f"Bearer {LIVE_TOKEN}"}
    with httpx.Client(base_url=url_of(ratio1_node, "live"), timeout=180) as c:
        first_pid = c.get("/health").json()["result"]["engine"]["worker_pid"]
        assert "result" in c.post("/create_chat_completion", json=chat(max_tokens=16)).json()  # WRAPPED

        live.update(RESPONSE_FORMAT="RAW", PREDEFINED_AUTH_TOKENS=[LIVE_TOKEN])
        push_update(ratio1_node, pipeline, 1)
        wait_until(lambda: c.get("/status").status_code == 401, 120, "the token to be required")
        r = c.post("/create_chat_completion", json=chat(max_tokens=16), headers=auth)
        assert r.status_code == 200 and set(r.json()) == {"REQUEST_ID", "MODEL_NAME", "TEXT_RESPONSE", "FULL_OUTPUT"}
        assert c.get("/health", headers=auth).json()["engine"]["worker_pid"] == first_pid  # no restart

        long = chat("Count from one to one hundred in words.", max_tokens=160, temperature=0)
        accepted = c.post("/create_chat_completion_async", json=long, headers=auth)
        assert accepted.status_code == 200, accepted.text
        request_id = accepted.json()["request_id"]
        live.update(N_CTX=2048)
        push_update(ratio1_node, pipeline, 2)

        def restarted():
            r = c.get("/health", headers=auth)
            return r.status_code == 200 and r.json()["engine"]["worker_pid"] not in (None, first_pid)

        answers: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: answers.extend(
                c.post("/create_chat_completion", json=chat(max_tokens=16), headers=auth) for _ in range(6)
            )
        )
        sender.start()  # back to back across the rebuild: held while it runs, never refused
        wait_until(restarted, 180, "the engine to restart with the new config")
        sender.join(180)
        assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers if r.status_code != 200]
        info = c.get("/status", headers=auth).json()["engine_info"]
        assert info["n_ctx"] == 2048, info

        def finished():
            r = c.get("/request_status", params={"request_id": request_id}, headers=auth).json()
            return r if r["status"] != "pending" else None

        done = wait_until(finished, 120, "the request accepted before the rebuild")
        assert done["status"] == "completed", done

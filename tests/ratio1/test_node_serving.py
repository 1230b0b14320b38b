"""Upstream-style JEEVES_CONTENT payloads reach the edgellm_llama_cpp serving through a real offline
Ratio1 node (naeural-core in its own venv, a local mosquitto) and every one is answered.

The node runs from a folder assembled here: this checkout's `edgellm` and `extensions/serving`, plus
the test-only LLM_PAYLOAD_PROBE business plugin (tests/ratio1/node_serving/), which sends the
payloads on its Loopback pipeline exactly as upstream's LLM_INFERENCE_API does and writes back what
the serving answered. A second pipeline runs its own serving instance with MMPROJ_PATH (a projector
built here, tools/build_mmproj.py): images in a payload reach the model there. The node venv:
$EDGELLM_RATIO1_VENV, else tools/ratio1_venv.sh (cached).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import cv2
import jsonschema
import numpy as np
import pytest

from edgellm.ratio1.ports import free_port
from tests.process_hygiene import reap_group, spawn
from tools.build_mmproj import build_vision_mmproj

REPO = Path(__file__).resolve().parents[2]
WORDS = ["apple", "banana", "cherry", "dragonfruit", "elderberry", "fig", "grape", "honeydew"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
N_EMBD = 576  # the bundled SmolLM2-135M
IMAGE_TOKENS = 16  # (image_size 32 / patch 8)^2 with the test projector


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _node_python() -> str:
    venv = os.environ.get("EDGELLM_RATIO1_VENV")
    if not venv:
        script = REPO / "tools" / "ratio1_venv.sh"
        if not script.is_file():
            pytest.fail("no node venv: set EDGELLM_RATIO1_VENV or provide tools/ratio1_venv.sh")
        venv = subprocess.run([str(script)], check=True, capture_output=True, text=True).stdout.strip()
    return str(Path(venv) / "bin" / "python")


def _payloads() -> list[dict]:
    llm = {"REQUEST_TYPE": "LLM"}
    out = [
        {**llm, "REQUEST_ID": f"fruit-{w}", "MESSAGES": [{"role": "user", "content": f"Say {w}."}],
         "GUIDED_DECODING": {"choice": [w]}, "MAX_TOKENS": 16}
        for w in WORDS
    ]  # fmt: skip
    haiku = [{"role": "user", "content": "Write a haiku about the sea."}]
    out += [
        {**llm, "REQUEST_ID": f"t0-{i}", "MESSAGES": haiku, "TEMPERATURE": 0, "MAX_TOKENS": 32,
         "REPETITION_PENALTY": 1.1}
        for i in range(2)
    ]  # fmt: skip
    out.append({**llm, "REQUEST_ID": "bad-temp", "MESSAGES": haiku, "TEMPERATURE": 9})
    out.append(
        {**llm, "REQUEST_ID": "js", "MESSAGES": [{"role": "user", "content": "Describe a person as JSON."}],
         "RESPONSE_FORMAT": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "MAX_TOKENS": 64, "SEED": 7}
    )  # fmt: skip
    out.append(
        {**llm, "REQUEST_ID": "tool", "MESSAGES": [{"role": "user", "content": "Weather in Paris?"}],
         "TOOLS": [WEATHER_TOOL], "TOOL_CHOICE": "required", "MAX_TOKENS": 64, "SEED": 7}
    )  # fmt: skip
    return out


def _png_url(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    ok, buf = cv2.imencode(".png", pixels)
    assert ok
    return f"data:image/png;base64,{base64.b64encode(buf.tobytes()).decode()}"


def _media_payloads() -> list[dict]:
    """The same question with and without an image, greedy: only the image's tokens tell them apart."""
    text = {"type": "text", "text": "What is in this picture?"}
    image = {"type": "image_url", "image_url": {"url": _png_url(1)}}
    common = {"REQUEST_TYPE": "LLM", "TEMPERATURE": 0, "MAX_TOKENS": 8}
    return [
        {**common, "REQUEST_ID": "img", "MESSAGES": [{"role": "user", "content": [text, image]}]},
        {**common, "REQUEST_ID": "txt", "MESSAGES": [{"role": "user", "content": text["text"]}]},
    ]


def _node_folder(root: Path, model_path: str, mqtt_port: int, mmproj_path: str) -> Path:
    (root / "config" / "pipelines").mkdir(parents=True)
    (root / "extensions" / "business" / "probe").mkdir(parents=True)
    (root / "edgellm").symlink_to(REPO / "edgellm")  # the script's folder is first on sys.path
    (root / "extensions" / "serving").symlink_to(REPO / "extensions" / "serving")
    shutil.copy(REPO / "tests/ratio1/node_serving/llm_payload_probe.py", root / "extensions/business/probe/")
    (root / "run_node.py").write_text(
        "import multiprocessing as mp, os\n"
        "if __name__ == '__main__':\n"
        "    mp.set_start_method('spawn')\n"
        "    from naeural_core.main.entrypoint import main\n"
        "    code, _ = main(additional_packages=[])\n"
        "    os._exit(code)\n"
    )
    admin = ["PLUGIN_MONITOR_01", "LOCAL_COMMS_01", "NET_CONFIG_MONITOR", "CHAIN_STORE_BASE", "NET_MON_01",
             "UPDATE_MONITOR_01", "ORACLE_SYNC_01", "DEEPLOY_MANAGER_API", "ORACLE_API", "NAEURAL_RELEASE_APP",
             "DAUTH_MANAGER", "CHAIN_DIST_MONITOR", "CSTORE_MANAGER_API", "TUNNELS_MANAGER", "LIVENESS_API",
             "R1FS_MANAGER_API"]  # fmt: skip
    startup = {
        "EE_ID": "edgellm-serving-test",
        "SECURED": False,
        "WORK_OFFLINE": True,
        "MAIN_LOOP_RESOLUTION": 20,
        "SECONDS_HEARTBEAT": 10,
        "PLUGINS_ON_THREADS": True,
        "CONFIG_RETRIEVE": [
            {
                "TYPE": "local",
                "APP_CONFIG_ENDPOINT": str(root / "config" / "app.json"),
                "STREAMS_CONFIGS_ENDPOINT": {"PATH": str(root / "config" / "pipelines"), "IS_RELATIVE_PATH": False},
            }
        ],
        "ADMIN_PIPELINE": {name: {"FORCED_PAUSE": True, "TUNNEL_ENGINE_ENABLED": False} for name in admin},
        "COMMUNICATION_ENVIRONMENT": {"ENCRYPTED_COMMS": False, "QOS": 0},
    }
    channels = {k: {"TOPIC": f"edgellmtest/{v}"} for k, v in
                [("CONFIG_CHANNEL", "{}/config"), ("CTRL_CHANNEL", "ctrl"), ("PAYLOADS_CHANNEL", "payloads"),
                 ("NOTIF_CHANNEL", "notif")]}  # fmt: skip
    app = {
        "COMMUNICATION": {
            "TYPE": "mqtt",
            "PARAMS": {"HOST": "127.0.0.1", "PORT": mqtt_port, "USER": "", "PASS": "", "QOS": 0, "SECURED": 0,
                       "SUBTOPIC": "", **channels},
            "INSTANCES": {
                "COMMANDCONTROL": {"RECV_FROM": "CONFIG_CHANNEL"},
                "DEFAULT": {"SEND_TO": "PAYLOADS_CHANNEL"},
                "HEARTBEATS": {"RECV_FROM": "CTRL_CHANNEL", "SEND_TO": "CTRL_CHANNEL"},
                "NOTIFICATIONS": {"SEND_TO": "NOTIF_CHANNEL"},
            },
        },
        "FILE_UPLOAD": {"TYPE": "minio", "CONFIG_UPLOADER": {}},
    }  # fmt: skip
    instance = {
        "INSTANCE_ID": "probe_1",
        "AI_ENGINE": "edgellm_llama_cpp",
        "STARTUP_AI_ENGINE_PARAMS": {"MODEL_PATH": model_path, "N_SLOTS": 4, "N_CTX": 4096},
        "PROBE_OUT": str(root / "answers.json"),
        "PROBE_PAYLOADS": _payloads(),
    }
    pipeline = {"NAME": "probe", "TYPE": "Loopback",
                "PLUGINS": [{"SIGNATURE": "LLM_PAYLOAD_PROBE", "INSTANCES": [instance]}]}  # fmt: skip
    # Its own serving process (MODEL_INSTANCE_ID), with a projector: the first pipeline's stays text-only.
    media = {
        "INSTANCE_ID": "probe_media",
        "AI_ENGINE": "edgellm_llama_cpp",
        "STARTUP_AI_ENGINE_PARAMS": {"MODEL_PATH": model_path, "N_SLOTS": 2, "N_CTX": 2048,
                                     "MMPROJ_PATH": mmproj_path, "MODEL_INSTANCE_ID": "media"},
        "PROBE_OUT": str(root / "answers_media.json"),
        "PROBE_PAYLOADS": _media_payloads(),
    }  # fmt: skip
    media_pipeline = {"NAME": "probe_media", "TYPE": "Loopback",
                      "PLUGINS": [{"SIGNATURE": "LLM_PAYLOAD_PROBE", "INSTANCES": [media]}]}  # fmt: skip
    (root / "config" / "startup.json").write_text(json.dumps(startup))
    (root / "config" / "app.json").write_text(json.dumps(app))
    (root / "config" / "pipelines" / "probe.json").write_text(json.dumps(pipeline))
    (root / "config" / "pipelines" / "probe_media.json").write_text(json.dumps(media_pipeline))
    return root


def _stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reap_group(proc.pid)  # what the node started and left behind


def _wait_for(out: Path, wanted: int, node: subprocess.Popen, root: Path, deadline: float) -> dict:
    while time.monotonic() < deadline and node.poll() is None:
        if out.is_file() and len(json.loads(out.read_text())["answers"]) >= wanted:
            break
        time.sleep(0.2)
    if not out.is_file():
        pytest.fail(f"no answers in {out.name} from the node in 240 s; see {root / 'node.log'}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def node(tmp_path_factory, model_path, background_stops):
    """(the node's folder, the node, the test's folder with node.log, the deadline for its answers). The
    node and its broker are stopped on a thread (tests/ratio1/conftest.py: background_stops)."""
    python = _node_python()
    root = tmp_path_factory.mktemp("serving-node")
    mmproj = root / "vision.gguf"
    build_vision_mmproj(mmproj, n_embd_text=N_EMBD)
    port = free_port()
    conf = root / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    broker = spawn(["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    node_dir = _node_folder(root / "node", model_path, port, str(mmproj))
    env = {**os.environ, "EE_VPN_IMPL": "true", "EE_ETH_ENABLED": "false", "EE_ID": "edgellm-serving-test",
           "EE_CONFIG": str(node_dir / "config" / "startup.json"), "EE_DAUTH_URL": "N/A", "EE_DEVICE": "cpu",
           "EE_TUNNEL_ENGINE": "none", "EE_SUPERVISOR": "false"}  # fmt: skip
    env["PATH"] = f"{Path(python).parent}:{env['PATH']}"
    log = (root / "node.log").open("w")
    # Its own process group (what the node starts is in it): _stop() and the sentinel reach all of it.
    node = spawn([python, "run_node.py"], own_group=True, cwd=node_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield node_dir, node, root, time.monotonic() + 240
    finally:

        def stop() -> None:
            try:
                _stop(node)
            finally:
                broker.terminate()
                broker.wait(10)
                log.close()

        def exited() -> None:
            assert node.returncode is not None and broker.returncode is not None

        background_stops.add("the serving node", stop, exited)


@pytest.fixture(scope="module")
def answers(node):
    node_dir, proc, root, deadline = node
    return _wait_for(node_dir / "answers.json", len(_payloads()), proc, root, deadline)


@pytest.fixture(scope="module")
def media_answers(node):
    node_dir, proc, root, deadline = node
    return _wait_for(node_dir / "answers_media.json", len(_media_payloads()), proc, root, deadline)


def test_every_drained_payload_is_answered_with_its_own_id(answers):
    by_id = {a["REQUEST_ID"]: a for a in answers["answers"] if a.get("REQUEST_ID")}
    assert answers["engines"] == ["edgellm_llama_cpp"]
    for w in WORDS:
        a = by_id[f"fruit-{w}"]
        assert (a["IS_VALID"], a["text"], a["MODEL_NAME"]) == (True, w, "SmolLM2-135M-Instruct.Q4_1.gguf")
        assert a["FULL_OUTPUT"][0]["choices"][0]["message"]["content"] == w
    # nothing is left unanswered; anything else on the loopback queue is refused, not answered as a request
    assert set(by_id) == {*(f"fruit-{w}" for w in WORDS), "t0-0", "t0-1", "bad-temp", "js", "tool"}
    assert all(not a["IS_VALID"] for a in answers["answers"] if not a.get("REQUEST_ID"))


def test_temperature_zero_json_schema_and_invalid_through_the_node(answers):
    by_id = {a["REQUEST_ID"]: a for a in answers["answers"] if a.get("REQUEST_ID")}
    assert by_id["t0-0"]["text"] and by_id["t0-0"]["text"] == by_id["t0-1"]["text"]
    jsonschema.validate(json.loads(by_id["js"]["text"]), SCHEMA)
    bad = by_id["bad-temp"]
    assert (bad["IS_VALID"], bad["STATUS_CODE"], bad["ERROR_TYPE"]) == (False, 400, "invalid_request")
    assert "temperature must be in [0, 1.5], got 9" in bad["ERROR"]


def test_a_tool_call_through_the_node_is_valid(answers):
    """TOOLS / TOOL_CHOICE in a payload: the serving constrains the call as the native host does."""
    tool = next(a for a in answers["answers"] if a.get("REQUEST_ID") == "tool")
    assert tool["IS_VALID"] is True, tool.get("ERROR")
    choice = tool["FULL_OUTPUT"][0]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call, *_) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_TOOL["function"]["parameters"])


def test_an_image_reaches_the_model_through_the_serving(media_answers):
    """MMPROJ_PATH attaches the projector in the serving (EngineCore builds it, as in the node's worker):
    the image is encoded and its tokens count in the prompt."""
    by_id = {a["REQUEST_ID"]: a for a in media_answers["answers"] if a.get("REQUEST_ID")}
    img, txt = by_id["img"], by_id["txt"]
    assert img["IS_VALID"] is True and txt["IS_VALID"] is True, (img.get("ERROR"), txt.get("ERROR"))
    img_usage, txt_usage = img["FULL_OUTPUT"][0]["usage"], txt["FULL_OUTPUT"][0]["usage"]
    assert img_usage["prompt_tokens"] == txt_usage["prompt_tokens"] + IMAGE_TOKENS

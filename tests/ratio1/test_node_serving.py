"""Upstream-style JEEVES_CONTENT payloads reach the edgellm_llama_cpp serving through a real offline
Ratio1 node (naeural-core in its own venv, a local mosquitto) and every one is answered.

The node runs from a folder assembled here: this checkout's `edgellm` and `extensions/serving`, plus
the test-only LLM_PAYLOAD_PROBE business plugin (tests/ratio1/node_serving/), which sends the
payloads on its Loopback pipeline exactly as upstream's LLM_INFERENCE_API does and writes back what
the serving answered. The node venv: $EDGELLM_RATIO1_VENV, else tools/ratio1_venv.sh (cached).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import jsonschema
import pytest

from edgellm.runtime.ratio1_node import free_port
from tests.process_hygiene import reap_group, spawn

REPO = Path(__file__).resolve().parents[2]
WORDS = ["apple", "banana", "cherry", "dragonfruit", "elderberry", "fig", "grape", "honeydew"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
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
    return out


def _node_folder(root: Path, model_path: str, mqtt_port: int) -> Path:
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
    (root / "config" / "startup.json").write_text(json.dumps(startup))
    (root / "config" / "app.json").write_text(json.dumps(app))
    (root / "config" / "pipelines" / "probe.json").write_text(json.dumps(pipeline))
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


@pytest.fixture(scope="module")
def answers(tmp_path_factory, model_path):
    python = _node_python()
    root = tmp_path_factory.mktemp("serving-node")
    port = free_port()
    conf = root / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    broker = spawn(["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    node_dir = _node_folder(root / "node", model_path, port)
    env = {**os.environ, "EE_VPN_IMPL": "true", "EE_ETH_ENABLED": "false", "EE_ID": "edgellm-serving-test",
           "EE_CONFIG": str(node_dir / "config" / "startup.json"), "EE_DAUTH_URL": "N/A", "EE_DEVICE": "cpu",
           "EE_TUNNEL_ENGINE": "none", "EE_SUPERVISOR": "false"}  # fmt: skip
    env["PATH"] = f"{Path(python).parent}:{env['PATH']}"
    log = (root / "node.log").open("w")
    # Its own process group (what the node starts is in it): _stop() and the sentinel reach all of it.
    node = spawn([python, "run_node.py"], own_group=True, cwd=node_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
    out, wanted, deadline = node_dir / "answers.json", len(_payloads()), time.monotonic() + 240
    try:
        while time.monotonic() < deadline and node.poll() is None:
            if out.is_file() and len(json.loads(out.read_text())["answers"]) >= wanted:
                break
            time.sleep(1)
        if not out.is_file():
            pytest.fail(f"no answers from the node in 240 s; see {root / 'node.log'}")
        yield json.loads(out.read_text())
    finally:
        _stop(node)
        broker.terminate()
        broker.wait(10)
        log.close()


def test_every_drained_payload_is_answered_with_its_own_id(answers):
    by_id = {a["REQUEST_ID"]: a for a in answers["answers"] if a.get("REQUEST_ID")}
    assert answers["engines"] == ["edgellm_llama_cpp"]
    for w in WORDS:
        a = by_id[f"fruit-{w}"]
        assert (a["IS_VALID"], a["text"], a["MODEL_NAME"]) == (True, w, "SmolLM2-135M-Instruct.Q4_1.gguf")
        assert a["FULL_OUTPUT"][0]["choices"][0]["message"]["content"] == w
    # nothing is left unanswered; anything else on the loopback queue is refused, not answered as a request
    assert set(by_id) == {*(f"fruit-{w}" for w in WORDS), "t0-0", "t0-1", "bad-temp", "js"}
    assert all(not a["IS_VALID"] for a in answers["answers"] if not a.get("REQUEST_ID"))


def test_temperature_zero_json_schema_and_invalid_through_the_node(answers):
    by_id = {a["REQUEST_ID"]: a for a in answers["answers"] if a.get("REQUEST_ID")}
    assert by_id["t0-0"]["text"] and by_id["t0-0"]["text"] == by_id["t0-1"]["text"]
    jsonschema.validate(json.loads(by_id["js"]["text"]), SCHEMA)
    bad = by_id["bad-temp"]
    assert (bad["IS_VALID"], bad["STATUS_CODE"], bad["ERROR_TYPE"]) == (False, 400, "invalid_request")
    assert "temperature must be in [0, 1.5], got 9" in bad["ERROR"]

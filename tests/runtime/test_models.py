"""Several models on one node (settings `models:`, runtime/supervision/model_switch.py) on a real node: two copies of
the bundled GGUF under two ids are enough to see which one answered (the response's `model`, the
worker's pid), that both stay loaded when their memory plans fit the budget together and one is
unloaded when they do not, and that nothing is lost across a switch, an idle unload or a node restart
with requests waiting for the unloaded model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from edgellm.runtime.settings import load_settings
from tests.nodeproc import NodeProcess, wait_until

pytestmark = pytest.mark.slow

MSG = [{"role": "user", "content": "Say hi."}]


def _config(tmp_path: Path, model_path: str, **extra) -> Path:
    """Two ids over two copies of the bundled model (the second with 2 slots, to show overrides apply)."""
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    a, b = models / "a.gguf", models / "b.gguf"
    for copy in (a, b):
        if not copy.exists():
            shutil.copyfile(model_path, copy)
    config = {
        "models": [
            {"id": "alpha", "model_path": str(a)},
            {"id": "beta", "model_path": str(b), "overrides": {"n_slots": 2, "n_ctx": 2048}},
        ],
        "n_ctx": 4096,
        "n_slots": 4,
        **extra,
    }
    path = tmp_path / "node.yaml"
    path.write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
    return path


def _chat(c: httpx.Client, model: str, **kw) -> httpx.Response:
    body = {"model": model, "messages": MSG, "max_tokens": 6, "temperature": 0, **kw}
    return c.post("/v1/chat/completions", json=body)


def _models(c: httpx.Client) -> dict[str, dict]:
    return {m["id"]: m for m in c.get("/v1/models").json()["data"]}


def test_requests_for_two_models_from_8_clients_are_each_answered_by_the_model_they_named(tmp_path, model_path):
    """One loaded at a time (max_loaded_models 1): every switch unloads one worker and loads the other."""
    config = _config(tmp_path, model_path, model_switch_after_s=1.0, max_loaded_models=1)
    node = NodeProcess(tmp_path, "--config", str(config)).start()
    try:
        with node.client(timeout=120) as c:
            listed = _models(c)
            assert listed["alpha"]["state"] == "loaded" and listed["beta"]["state"] == "unloaded"
            first_pid = node.worker_pid()
            names = ["alpha", "beta"] * 8
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda m: _chat(c, m), names))
            for name, r in zip(names, answers, strict=True):
                assert r.status_code == 200, r.text
                assert r.json()["model"] == name
            health = c.get("/health").json()["result"]["engine"]
            assert health["switches"] >= 1 and node.worker_pid() != first_pid  # a worker per load
            # the seed routes name a model by `model` or extras.model; an unknown one is a 404 on every route
            seed = c.post("/predict", json={"messages": MSG, "max_tokens": 16, "extras": {"model": "beta"}})
            assert seed.status_code == 200 and seed.json()["result"]["MODEL_NAME"] == "beta", seed.text
            seed = c.post("/predict", json={"messages": MSG, "max_tokens": 16, "model": "alpha"})
            assert seed.json()["result"]["MODEL_NAME"] == "alpha"
            assert _chat(c, "gamma").status_code == 404
            unknown = c.post("/predict", json={"messages": MSG, "model": "gamma"})
            assert unknown.status_code == 404 and "'alpha', 'beta'" in unknown.text
            # the other OpenAI-style routes route the same way
            done = c.post("/v1/completions", json={"model": "beta", "prompt": "Hi", "max_tokens": 4})
            assert done.status_code == 200 and done.json()["model"] == "beta", done.text
            emb = c.post("/v1/embeddings", json={"model": "alpha", "input": "hello"})
            assert emb.status_code == 200 and emb.json()["model"] == "alpha", emb.text
            resp = c.post("/v1/responses", json={"model": "beta", "input": "Say hi.", "max_output_tokens": 16})
            assert resp.status_code == 200 and resp.json()["model"] == "beta", resp.text
            msg = {"model": "alpha", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
            anth = c.post("/v1/messages", json=msg)
            assert anth.status_code == 200 and anth.json()["model"] == "alpha", anth.text
            # each model runs with its own settings: beta's override of n_slots
            _chat(c, "beta")
            assert c.get("/status").json()["result"]["engine_info"]["n_slots"] == 2
    finally:
        node.stop()


def _plan_totals(config: Path) -> tuple[dict[str, int], int]:
    """Each model's memory plan total (what the node counts it for), and the budget, as the node computes
    them from the same config."""
    settings = load_settings(str(config))
    totals = {}
    for entry, model_settings in settings.served_models():
        model_settings.model()
        report = model_settings.memory_report()
        totals[entry.id] = report["total_bytes"]
    return totals, report["budget_bytes"]


def _switch_back_and_forth(c: httpx.Client) -> dict[str, dict]:
    for name in ("beta", "alpha", "beta", "alpha"):
        r = _chat(c, name)
        assert r.status_code == 200 and r.json()["model"] == name, r.text
    return _models(c)


def test_two_models_that_fit_the_budget_together_stay_loaded_and_a_switch_reloads_neither(tmp_path, model_path):
    """max_loaded_models 0 (as memory allows), budget ample: the second model loads beside the first, and
    switching between them afterwards is a drain, not a reload (each loaded once, two live workers)."""
    node = NodeProcess(tmp_path, "--config", str(_config(tmp_path, model_path, model_switch_after_s=0.5))).start()
    try:
        with node.client(timeout=120) as c:
            listed = _switch_back_and_forth(c)
            assert listed["alpha"]["state"] == listed["beta"]["state"] == "loaded", listed
            assert listed["alpha"]["loads"] == listed["beta"]["loads"] == 1, listed
            assert listed["alpha"]["active"] and not listed["beta"]["active"]
            health = c.get("/health").json()["result"]["engine"]
            assert health["switches"] >= 4 and sorted(health["resident_models"]) == ["alpha", "beta"]
            pids = {m["id"]: m["worker_pid"] for m in health["models"]}
            assert pids["alpha"] != pids["beta"] and all(_alive(p) for p in pids.values()), pids
            # requests for both interleaved still come back from the model they named
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda m: _chat(c, m), ["alpha", "beta"] * 4))
            assert [r.json()["model"] for r in answers] == ["alpha", "beta"] * 4
            assert {m["id"]: m["loads"] for m in _models(c).values()} == {"alpha": 1, "beta": 1}
    finally:
        node.stop()


def test_two_models_whose_plans_do_not_fit_together_are_loaded_one_at_a_time(tmp_path, model_path):
    """memory_budget between the larger plan and the sum of both: each model fits alone, not beside the
    other, so activating one unloads the other (its worker exits) and each switch back reloads it."""
    totals, _ = _plan_totals(_config(tmp_path, model_path))
    budget = max(totals.values()) + (min(totals.values()) // 2)
    assert budget < sum(totals.values())
    config = _config(tmp_path, model_path, model_switch_after_s=0.5, memory_budget=str(budget))
    node = NodeProcess(tmp_path, "--config", str(config)).start()
    try:
        with node.client(timeout=120) as c:
            first_pid = node.worker_pid()
            listed = _switch_back_and_forth(c)
            assert listed["alpha"]["state"] == "loaded" and listed["beta"]["state"] == "unloaded", listed
            assert (listed["alpha"]["loads"], listed["beta"]["loads"]) == (3, 2), listed
            health = c.get("/health").json()["result"]["engine"]
            assert health["resident_models"] == ["alpha"]
            assert not _alive(first_pid)  # the first alpha worker ended when beta needed the room
    finally:
        node.stop()


def test_a_busy_model_is_not_starved_and_the_other_waits_no_longer_than_the_switch_bound(tmp_path, model_path):
    """While alpha works on a long request, a request for beta waits (no 503, no loss) until
    model_switch_after_s; requests for alpha sent meanwhile are not held back before that point."""
    node = NodeProcess(tmp_path, "--config", str(_config(tmp_path, model_path, model_switch_after_s=3.0))).start()
    try:
        with node.client(timeout=120) as c:
            long = {"messages": MSG, "max_tokens": 400, "temperature": 0, "logit_bias": {"0": -100, "2": -100}}
            rid = c.post("/predict_async", json=long).json()["result"]["request_id"]
            ended: dict[str, float] = {}

            def timed(model: str) -> httpx.Response:
                r = _chat(c, model)
                ended[model] = time.monotonic()
                return r

            with ThreadPoolExecutor(2) as pool:
                beta = pool.submit(timed, "beta")
                wait_until(lambda: _waiting(node, "beta") >= 1, 60, "beta's request to wait for its model")
                alpha = timed("alpha")  # sent after beta's, served by the loaded model meanwhile
                answer = beta.result(timeout=120)
            assert alpha.status_code == 200 and alpha.json()["model"] == "alpha"
            assert ended["alpha"] < ended["beta"]  # beta waited for the switch; alpha was not held back
            assert answer.status_code == 200 and answer.json()["model"] == "beta"
            done = _final(c, rid, 120)
            assert done["status"] == "completed", done
    finally:
        node.stop()


def _waiting(node: NodeProcess, model: str) -> int:
    """How many requests for `model` wait for it to be loaded (/health's view of each model)."""
    models = httpx.get(node.base + "/health", timeout=10).json()["result"]["engine"]["models"]
    return next(m["waiting"] for m in models if m["id"] == model)


def test_idle_unload_returns_the_worker_and_the_next_request_loads_it_again(tmp_path, model_path):
    node = NodeProcess(tmp_path, "--config", str(_config(tmp_path, model_path, idle_unload_s=2))).start()
    try:
        with node.client(timeout=120) as c:
            assert _chat(c, "alpha").status_code == 200
            pid = node.worker_pid()
            engine = wait_until(
                lambda: (e := c.get("/health").json()["result"]["engine"])["worker_state"] == "unloaded" and e,
                30,
                "the idle unload",
            )
            assert engine["worker_pid"] is None and engine["loaded_model"] is None
            # the worker process ends (its memory goes back with it) once it has had its Shutdown
            wait_until(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), 30, "the worker's exit")
            assert c.get("/health").status_code == 200  # the node still takes work
            assert _models(c)["alpha"]["state"] == "unloaded"
            woken = _chat(c, "alpha")
            assert woken.status_code == 200 and woken.json()["model"] == "alpha"
            assert node.worker_pid() != pid
    finally:
        node.stop()


def _final(c: httpx.Client, rid: str, timeout: float) -> dict:
    def ended():
        r = c.get("/request_status", params={"request_id": rid}).json()["result"]
        return r if r["status"] in ("completed", "failed") else None

    return wait_until(ended, timeout, f"request {rid}")


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def test_requests_waiting_for_an_unloaded_model_survive_a_node_restart(tmp_path, model_path):
    """Async requests for beta wait while alpha is busy (a long switch bound); the node is killed with
    SIGKILL; the next node re-dispatches them from the registry, each to the model it named."""
    config = _config(tmp_path, model_path, model_switch_after_s=600)
    node = NodeProcess(tmp_path, "--config", str(config)).start()
    try:
        with node.client(timeout=60) as c:
            long = {"messages": MSG, "max_tokens": 300, "temperature": 0, "logit_bias": {"0": -100, "2": -100}}
            first = c.post("/predict_async", json=long).json()["result"]["request_id"]
            ids = [
                c.post("/predict_async", json={"messages": MSG, "max_tokens": 16, "model": "beta"}).json()["result"][
                    "request_id"
                ]
                for _ in range(3)
            ]
            assert _models(c)["beta"]["waiting"] == 3
    finally:
        node.stop(signal.SIGKILL)
    node = NodeProcess(tmp_path, "--config", str(config), port=node.port).start()
    try:
        with node.client(timeout=60) as c:
            for rid in ids:
                done = _final(c, rid, 180)
                assert done["status"] == "completed", done
                assert done["result"]["MODEL_NAME"] == "beta"
            # and the default model's request, recovered before the engine started, ran too
            done = _final(c, first, 180)
            assert done["status"] == "completed" and done["result"]["MODEL_NAME"] == "alpha", done
    finally:
        node.stop()

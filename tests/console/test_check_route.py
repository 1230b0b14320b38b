"""/console/api/check gives the real route's verdict on media: the same media policy, no bytes loaded.

A real node with a (random-weight) vision projector and one media folder: every reference the policy
refuses (a remote URL with remote media off, a path outside media_dirs, a missing file, audio for a
model without an audio projector) is refused by the check exactly as /v1/chat/completions refuses it,
and a reference it allows passes the check without being read.
"""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest

from tests.nodeproc import NodeProcess
from tools.build_mmproj import build_vision_mmproj

N_EMBD = 576  # the bundled SmolLM2-135M


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("check-media")
    ok, buf = cv2.imencode(".png", np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    assert ok
    (folder / "a.png").write_bytes(buf.tobytes())
    return folder


@pytest.fixture(scope="module")
def vision_node(tmp_path_factory, media_dir):
    state = tmp_path_factory.mktemp("check-node")
    mmproj = state / "vision.gguf"
    build_vision_mmproj(mmproj, n_embd_text=N_EMBD)
    config = state / "node.yaml"
    config.write_text(f"mmproj_path: {mmproj}\nmedia_dirs: [{media_dir}]\nn_slots: 2\nn_ctx: 2048\n")
    node = NodeProcess(state, "--config", str(config)).start()
    yield node
    node.stop()


def body(model: str, part: dict) -> dict:
    content = [{"type": "text", "text": "What is in this picture?"}, part]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1}


def post(c, path: str, payload: dict):
    return c.post(path, content=json.dumps(payload), headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    "part,fragment",
    [
        ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}, "remote media URLs are disabled"),
        ({"type": "image_url", "image_url": {"url": "/etc/hostname"}}, "outside the configured media_dirs"),
        ({"type": "image", "image": "{media}/../secret.png"}, "outside the configured media_dirs"),
        ({"type": "image_url", "image_url": {"url": "{media}/missing.png"}}, "no such file"),
        ({"type": "image_url", "image_url": {"url": "a.png"}}, "relative path"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "this model takes no audio"),
    ],
)
def test_check_refuses_media_the_real_route_refuses(vision_node, media_dir, part, fragment):
    part = json.loads(json.dumps(part).replace("{media}", str(media_dir)))
    with vision_node.client() as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        real = post(c, "/v1/chat/completions", body(model, part))
        check = post(c, "/console/api/check", body(model, part))
    assert real.status_code == 400, real.text
    assert check.status_code == 400, check.text
    assert fragment in check.json()["error"]["message"]
    assert check.json()["error"] == real.json()["error"]


def test_check_passes_media_the_policy_allows(vision_node, media_dir):
    part = {"type": "image_url", "image_url": {"url": str(media_dir / "a.png")}}
    with vision_node.client() as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        check = post(c, "/console/api/check", body(model, part))
        real = post(c, "/v1/chat/completions", body(model, part))
    assert check.status_code == 200 and check.json()["ok"] is True, check.text
    assert real.status_code == 200, real.text

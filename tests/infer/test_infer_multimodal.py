"""`edgellm infer` with image and audio items (TensorRT-Edge-LLM format) on the real engine, with a vision
projector the test builds (random weights; tools/build_mmproj.py). Files are resolved against the input
file's folder; every problem with one request's media fails that request only."""

from __future__ import annotations

import json
import subprocess
import sys
import wave
from pathlib import Path

import cv2
import numpy as np
import pytest

from edgellm.infer.contract import load_job
from edgellm.infer.runner import InferOptions, run_job
from edgellm.runtime.settings import load_settings
from tools.build_mmproj import build_vision_mmproj

N_EMBD = 576  # the bundled SmolLM2-135M


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("proj") / "vision.gguf"
    build_vision_mmproj(path, n_embd_text=N_EMBD)  # image_size 32
    return path


@pytest.fixture(scope="module")
def options(model_path, mmproj) -> InferOptions:
    settings = load_settings(None, model_path=model_path, mmproj_path=str(mmproj))
    return InferOptions(model=settings.model(), max_seq_len=512)


def picture(path: Path, seed: int, size: tuple[int, int] = (48, 64)) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))
    return path.name if path.parent.name == "files" else str(path)


def request(*items: dict, text: str = "Describe this image.") -> dict:
    return {"messages": [{"role": "user", "content": [*items, {"type": "text", "text": text}]}]}


def test_images_run_and_every_bad_item_fails_alone(options, tmp_path):
    folder = tmp_path / "files"
    picture(folder / "a.png", 1)
    picture(folder / "b.jpg", 2)
    picture(folder / "exact.png", 3, (32, 32))
    picture(folder / "wrong.png", 4, (30, 32))
    picture(tmp_path / "outside.png", 5)
    (folder / "garbage.png").write_bytes(b"not an image at all")
    with wave.open(str(folder / "clip.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(bytes(3200))
    data = {
        "batch_size": 4,
        "temperature": 0.0,
        "max_generate_length": 8,
        "requests": [
            request({"type": "image", "image": "a.png"}),
            request({"type": "image", "image": "b.jpg"}),
            request({"type": "image", "image": str(folder / "a.png")}),
            request({"type": "image", "image": "exact.png", "do_resize": False}),
            request({"type": "image", "image": "wrong.png", "do_resize": False}),
            request({"type": "image", "image": "../outside.png"}),
            request({"type": "image", "image": "missing.png"}),
            request({"type": "image", "image": "garbage.png"}),
            request({"type": "audio", "audio": "clip.wav"}),
            {"messages": [{"role": "user", "content": "Say hi."}]},
        ],
    }
    src = folder / "in.json"
    src.write_text(json.dumps(data))
    result = run_job(load_job(src), options)
    r = result.document["responses"]
    for ok in (0, 1, 2, 3, 9):
        assert "error" not in r[ok], r[ok]
        assert r[ok]["finish_reason"] in ("end-of-sequence", "max-length"), r[ok]
    assert r[0]["output_text"] == r[2]["output_text"]  # the same file, named relatively and absolutely
    assert r[0]["output_text"] != r[1]["output_text"]
    assert "<__media__>" in r[0]["formatted_complete_request"]
    assert r[0]["usage"]["prompt_tokens"] > 16  # the image's 16 embeddings count
    expected = {
        4: "32x30",
        5: "media_dirs",
        6: "missing.png",
        7: "decode",
        8: "no audio",
    }
    for i, fragment in expected.items():
        assert r[i]["finish_reason"] == "error" and fragment in r[i]["error"], (i, r[i])
        assert r[i]["error"].startswith(f"requests[{i}]")
    assert result.failed == len(expected)


def test_the_cli_with_a_projector_in_the_settings(model_path, mmproj, tmp_path):
    picture(tmp_path / "a.png", 1)
    src = tmp_path / "in.json"
    src.write_text(json.dumps({"max_generate_length": 4, "requests": [request({"type": "image", "image": "a.png"})]}))
    config = tmp_path / "node.yaml"
    config.write_text(f"mmproj_path: {mmproj}\n")
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "edgellm", "infer", "--input", str(src), "--output", str(out), "--config", str(config)]
    done = subprocess.run([*cmd, "--model", model_path, "-q"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    response = json.loads(out.read_text())["responses"][0]
    assert response["finish_reason"] in ("end-of-sequence", "max-length") and "error" not in response

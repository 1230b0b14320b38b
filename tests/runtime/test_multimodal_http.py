"""Images and audio on every HTTP route of the real node, with projectors this test builds (random weights,
tools/build_mmproj.py): the OpenAI route through the official client, the seed endpoints (sync and async),
every error as a clear 4xx, and text requests running next to image requests.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import shutil
import signal
import subprocess
import time
import wave
from pathlib import Path

import cv2
import numpy as np
import openai
import pytest

from tests.nodeproc import NodeProcess
from tools.build_mmproj import build_audio_mmproj, build_vision_mmproj

N_EMBD = 576  # the bundled SmolLM2-135M
IMAGE_TOKENS = 16


def png(seed: int, width: int = 64, height: int = 48) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    ok, buf = cv2.imencode(".png", pixels)
    assert ok
    return buf.tobytes()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def wav(kind: str, seconds: float = 1.0, rate: int = 22050) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    pcm = np.sin(2 * np.pi * 440 * t) if kind == "tone" else np.random.default_rng(3).uniform(-1, 1, t.size)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((0.4 * pcm * 32767).astype("<i2").tobytes())
    return out.getvalue()


def image_message(url: str, text: str = "What is in this picture?") -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}
    ]


def post(c, path: str, body: dict):
    """JSON as a client library writes it: ensure_ascii escapes lone surrogates as \\udXXX (httpx's json= cannot)."""
    return c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def served_model(node) -> str:
    with node.client() as c:
        return c.get("/v1/models").json()["data"][0]["id"]


def node_with(tmp_path_factory, mmproj: Path, media_dir: Path, **settings) -> NodeProcess:
    state = tmp_path_factory.mktemp("mmnode")
    lines = [f"mmproj_path: {mmproj}", f"media_dirs: [{media_dir}]", "n_slots: 4", "n_ctx: 4096"]
    lines += [f"{k}: {v}" for k, v in settings.items()]
    config = state / "node.yaml"
    config.write_text("\n".join(lines) + "\n")
    return NodeProcess(state, "--config", str(config)).start()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "a.png").write_bytes(png(1))
    return folder


# Class-scoped: the vision node stops before the audio node starts (never two engines at once).
@pytest.fixture(scope="class")
def vision_node(tmp_path_factory, media_dir):
    mmproj = tmp_path_factory.mktemp("proj") / "vision.gguf"
    build_vision_mmproj(mmproj, n_embd_text=N_EMBD)
    proc = node_with(tmp_path_factory, mmproj, media_dir, max_image_pixels=1_000_000)
    yield proc
    proc.stop()


@pytest.fixture(scope="class")
def audio_node(tmp_path_factory, media_dir):
    mmproj = tmp_path_factory.mktemp("proj") / "audio.gguf"
    build_audio_mmproj(mmproj, n_embd_text=N_EMBD)
    proc = node_with(tmp_path_factory, mmproj, media_dir)
    yield proc
    proc.stop()


class TestVision:
    @pytest.fixture
    def node(self, vision_node):
        return vision_node

    @pytest.fixture
    def client(self, vision_node):
        return openai.OpenAI(base_url=vision_node.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    def test_health_status_and_models_say_images_are_taken(self, node, client):
        with node.client() as c:
            media = c.get("/health").json()["result"]["media"]
            assert media["vision"] is True and media["audio"] is False and media["projector_type"] == "mlp"
            assert c.get("/status").json()["result"]["engine_info"]["media"]["vision"] is True
        assert client.models.list().data[0].input_modalities == ["text", "image"]

    def test_openai_client_with_images(self, client):
        model = client.models.list().data[0].id

        def ask(url: str):
            return client.chat.completions.create(
                model=model, messages=image_message(url), temperature=0, max_tokens=16
            )

        a1, b, a2 = ask(data_url(png(1))), ask(data_url(png(2))), ask(data_url(png(1)))
        assert a1.choices[0].message.content == a2.choices[0].message.content
        assert a1.choices[0].message.content != b.choices[0].message.content
        text_only = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is in this picture?"}], max_tokens=1
        )
        assert a1.usage.prompt_tokens == text_only.usage.prompt_tokens + IMAGE_TOKENS

    def test_ollama_images_are_the_same_image_parts(self, node, client):
        """Ollama's `images` (base64, no data: prefix) go through the same media path: the same answer and
        prompt count as the OpenAI route's image part."""
        import ollama

        model = client.models.list().data[0].id
        ask = "What is in this picture?"
        want = client.chat.completions.create(
            model=model, messages=image_message(data_url(png(1)), ask), temperature=0, max_tokens=16
        )
        olla = ollama.Client(host=node.base, timeout=120)
        got = olla.chat(
            model=model,
            messages=[{"role": "user", "content": ask, "images": [png(1)]}],
            options={"temperature": 0, "num_predict": 16},
        )
        assert got.message.content == want.choices[0].message.content
        assert got.prompt_eval_count == want.usage.prompt_tokens
        assert "vision" in olla.show(model).capabilities
        g = olla.generate(model=model, prompt=ask, images=[png(2)], options={"temperature": 0, "num_predict": 4})
        assert g.done and g.prompt_eval_count == want.usage.prompt_tokens

    def test_a_jpeg_file_from_media_dirs_and_the_same_pixels_as_png_agree(self, client, media_dir):
        pixels = cv2.imdecode(np.frombuffer(png(1), np.uint8), cv2.IMREAD_COLOR)
        lossless = media_dir / "same.bmp"
        cv2.imwrite(str(lossless), pixels)
        model = client.models.list().data[0].id
        from_file = client.chat.completions.create(
            model=model, messages=image_message(str(lossless)), temperature=0, max_tokens=12
        )
        from_png = client.chat.completions.create(
            model=model, messages=image_message(data_url(png(1))), temperature=0, max_tokens=12
        )
        assert from_file.choices[0].message.content == from_png.choices[0].message.content
        as_url = client.chat.completions.create(
            model=model, messages=image_message(lossless.as_uri()), temperature=0, max_tokens=12
        )
        assert as_url.choices[0].message.content == from_png.choices[0].message.content

    def test_seed_endpoints_take_the_same_content_arrays(self, node):
        body = {"messages": image_message(data_url(png(1))), "temperature": 0, "max_tokens": 16}
        trt = {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in this picture?"},
                        {"type": "image", "image": str(Path(node.state_dir).parent.parent / "x")},
                    ],
                }
            ]
        }
        with node.client() as c:
            sync = c.post("/create_chat_completion", json=body)
            assert sync.status_code == 200, sync.text
            text = sync.json()["result"]["TEXT_RESPONSE"][0]
            ack = c.post("/predict_async", json=body).json()["result"]
            deadline = time.monotonic() + 60
            while (done := c.get("/request_status", params={"request_id": ack["request_id"]}).json()["result"])[
                "status"
            ] == "pending" and time.monotonic() < deadline:
                time.sleep(0.2)
            assert done["status"] == "completed", done
            assert done["result"]["TEXT_RESPONSE"][0] == text
            plain = c.post("/predict", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16})
            assert plain.status_code == 200  # string content as before
            outside = c.post("/predict", json=trt)  # a path outside media_dirs
            assert outside.status_code == 400 and "media_dirs" in outside.json()["result"]["error"]

    @pytest.mark.parametrize(
        ("content", "status", "fragment"),
        [
            ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, 400, "decode"),
            ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, 400, "base64"),
            ({"type": "image_url", "image_url": {"url": "/etc/hostname"}}, 400, "media_dirs"),
            ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}, 400, "allow_remote_media"),
            ({"type": "image_url", "image_url": {"url": "ftp://host/x.png"}}, 400, ""),
            ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, 400, "no audio"),
            ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "ogg"}}, 400, "format"),
            ({"type": "video_url", "video_url": {"url": "x"}}, 400, "not supported"),
            ({"type": "image_url"}, 400, "image_url"),
            ({"type": "image_url", "image_url": {"url": "data:image/png;base64,\ud800"}}, 400, "surrogate"),
        ],
    )
    def test_bad_media_is_a_clear_400(self, node, content, status, fragment):
        messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, content]}]
        body = {"model": served_model(node), "messages": messages}
        with node.client() as c:
            r = post(c, "/v1/chat/completions", body)
            assert r.status_code == status, r.text
            assert fragment.lower() in r.json()["error"]["message"].lower()
            seed = post(c, "/predict", {"messages": messages})
            assert seed.status_code == status, seed.text

    def test_too_many_pixels_is_refused(self, node):
        ok, big = cv2.imencode(".png", np.zeros((1200, 1000, 3), np.uint8))  # 1.2 MP > max_image_pixels 1 MP
        with node.client() as c:
            r = c.post("/predict", json={"messages": image_message(data_url(big.tobytes()))})
        assert r.status_code in (400, 413), r.text
        assert "pixels" in r.json()["result"]["error"]

    def test_images_only_in_user_messages(self, node):
        system = {"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url(png(1))}}]}
        with node.client() as c:
            r = c.post("/predict", json={"messages": [system, {"role": "user", "content": "Hi"}]})
        assert r.status_code == 400 and "user messages" in r.json()["result"]["error"]

    def test_text_and_image_requests_finish_together(self, node):
        def one(i: int) -> int:
            messages = (
                image_message(data_url(png(20 + i))) if i % 2 else [{"role": "user", "content": f"Count to {i}."}]
            )
            with node.client() as c:
                return c.post("/predict", json={"messages": messages, "max_tokens": 24}).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(8))) == [200] * 8
        with node.client() as c:
            assert c.get("/health").json()["result"]["engine"]["restarts"] == 0


class TestAudio:
    @pytest.fixture
    def node(self, audio_node):
        return audio_node

    def ask(self, node, data: bytes, fmt: str) -> tuple[int, dict]:
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}
        body = {
            "model": served_model(node),
            "temperature": 0,
            "max_tokens": 12,
            "messages": [{"role": "user", "content": [part]}],
        }
        with node.client() as c:
            r = c.post("/v1/chat/completions", json=body)
        return r.status_code, r.json()

    def test_wav_steers_the_output_and_an_image_is_refused(self, node):
        s1, tone = self.ask(node, wav("tone"), "wav")
        s2, noise = self.ask(node, wav("noise"), "wav")
        s3, again = self.ask(node, wav("tone"), "wav")
        assert (s1, s2, s3) == (200, 200, 200), (tone, noise)
        assert tone["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
        assert tone["choices"][0]["message"]["content"] != noise["choices"][0]["message"]["content"]
        with node.client() as c:
            assert c.get("/health").json()["result"]["media"]["audio_sample_rate"] == 16000
            r = c.post("/predict", json={"messages": image_message(data_url(png(1)))})
        assert r.status_code == 400 and "no images" in r.json()["result"]["error"]

    @pytest.mark.parametrize("fmt", ["mp3", "flac"])
    def test_mp3_and_flac_made_by_sox(self, node, tmp_path, fmt):
        if shutil.which("sox") is None:  # a missing tool fails, as everywhere in the suite (make system-deps)
            pytest.fail("sox is not installed: `make system-deps` installs the Debian packages sox, libsox-fmt-mp3")
        src = tmp_path / "tone.wav"
        src.write_bytes(wav("tone"))
        out = tmp_path / f"tone.{fmt}"
        subprocess.run(["sox", str(src), str(out)], check=True, capture_output=True)
        status, body = self.ask(node, out.read_bytes(), fmt)
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] > 150


def test_pending_async_image_requests_finish_after_a_kill_9_restart(tmp_path_factory, media_dir):
    """The registry keeps each part's source, so a recovered request loads its image again."""
    mmproj = tmp_path_factory.mktemp("proj") / "vision.gguf"
    build_vision_mmproj(mmproj, n_embd_text=N_EMBD)
    node = node_with(tmp_path_factory, mmproj, media_dir)
    long = {"logit_bias": {"0": -100, "2": -100}, "temperature": 0, "max_tokens": 300}  # no end token: runs 300
    with node.client() as c:
        ids = [
            c.post("/predict_async", json={"messages": image_message(data_url(png(40 + i))), **long}).json()["result"][
                "request_id"
            ]
            for i in range(3)
        ]
        text_only = c.post(
            "/predict", json={"messages": [{"role": "user", "content": "What is in this picture?"}], "max_tokens": 16}
        )
        base_tokens = text_only.json()["result"]["FULL_OUTPUT"][0]["usage"]["prompt_tokens"]
    node.stop(signal.SIGKILL)
    again = NodeProcess(node.state_dir, *node.args).start()
    try:
        with again.client() as c:
            for rid in ids:
                deadline = time.monotonic() + 180
                while True:
                    done = c.get("/request_status", params={"request_id": rid, "return_full": "true"}).json()["result"]
                    if done["status"] != "pending" or time.monotonic() > deadline:
                        break
                    time.sleep(0.3)
                assert done["status"] == "completed" and done["attempts"] == 2, done
                usage = done["result"]["FULL_OUTPUT"][0]["usage"]
                assert usage["completion_tokens"] == 300 and usage["prompt_tokens"] == base_tokens + IMAGE_TOKENS
    finally:
        again.stop()

"""Images and audio through the real scheduler: llama.cpp's mtmd encodes them with a projector this
test builds (tools/build_mmproj.py: tiny random weights, output size = the bundled model's embedding
size), and their embeddings are decoded into the slot's sequence inside the continuous batch.

The projectors are random, so the outputs mean nothing; what is checked is that the media reach the
model (different images steer greedy decoding differently, the same image identically), that they
count in prompt_tokens, share the prefix cache by content, and fail alone when they are bad.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgellm.engine.projector import Projector, attach_projector, probe
from edgellm.engine.types import EngineRequest, SamplingParams
from edgellm.errors import EngineError
from edgellm.media.types import AudioInput, ImageInput
from tools.build_mmproj import build_audio_mmproj, build_vision_mmproj

N_EMBD = 576  # SmolLM2-135M
IMAGE_TOKENS = 16  # (image_size 32 / patch 8)^2 with the test projector
AUDIO_TOKENS = 150  # one 30 s window, stack factor 10


@pytest.fixture(scope="module")
def mmproj_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mmproj")
    vision, audio = folder / "vision.gguf", folder / "audio.gguf"
    build_vision_mmproj(vision, n_embd_text=N_EMBD)
    build_audio_mmproj(audio, n_embd_text=N_EMBD)
    return str(vision), str(audio)


def _with_projector(engine, path: str):
    """The session's scheduler with a projector attached (one engine per test session: never a second)."""
    sched = engine.scheduler
    projector = Projector(path, sched.model.model, n_threads=1, use_gpu=False)
    sched.projector, sched.projector_error = projector, None
    return projector


@pytest.fixture
def vision(engine, mmproj_files):
    projector = _with_projector(engine, mmproj_files[0])
    yield engine
    engine.scheduler.projector = None
    for slot in engine.scheduler.kv.slots:  # cached stand-ins mean nothing to the next projector
        slot.cached = []
    projector.close()


@pytest.fixture
def audio(engine, mmproj_files):
    projector = _with_projector(engine, mmproj_files[1])
    yield engine
    engine.scheduler.projector = None
    for slot in engine.scheduler.kv.slots:
        slot.cached = []
    projector.close()


def picture(seed: int, width: int = 64, height: int = 48) -> ImageInput:
    rng = np.random.default_rng(seed)
    return ImageInput.of(width, height, rng.integers(0, 256, (height, width, 3), dtype=np.uint8).tobytes())


def sound(kind: str, seconds: float = 1.0, rate: int = 16000) -> AudioInput:
    t = np.arange(int(seconds * rate)) / rate
    if kind == "tone":
        pcm = 0.5 * np.sin(2 * np.pi * 440 * t)
    else:
        pcm = np.random.default_rng(1).uniform(-0.5, 0.5, t.size)
    return AudioInput.of(rate, pcm.astype(np.float32).tobytes())


def ask(rid: str, media: list, text: str = "Describe this.", **kw) -> EngineRequest:
    parts = [{"type": "media", "index": i} for i in range(len(media))] + [{"type": "text", "text": text}]
    sampling = SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 12))
    return EngineRequest(
        rid, [{"role": "user", "content": parts}], sampling, media=media, **{"cache_lookup": False, **kw}
    )


def test_images_steer_the_output_and_the_same_image_gives_the_same_text(vision):
    a, b = picture(1), picture(2)
    outs = vision.run([ask("a1", [a]), ask("b1", [b]), ask("a2", [a])])
    assert all(o.error is None for o in outs.values()), {k: o.error for k, o in outs.items()}
    assert outs["a1"].text == outs["a2"].text
    assert outs["a1"].text != outs["b1"].text


def test_media_tokens_count_in_prompt_tokens(vision):
    text_only = EngineRequest("t", [{"role": "user", "content": "Describe this."}], SamplingParams(max_tokens=1))
    outs = vision.run(
        [text_only, ask("one", [picture(3)], max_tokens=1), ask("two", [picture(3), picture(4)], max_tokens=1)]
    )
    assert outs["one"].prompt_tokens == outs["t"].prompt_tokens + IMAGE_TOKENS
    assert outs["two"].prompt_tokens == outs["t"].prompt_tokens + 2 * IMAGE_TOKENS


def test_the_same_image_reuses_the_cached_prefix_a_different_one_does_not(vision):
    first = vision.one(ask("c1", [picture(5)], cache_lookup=True, max_tokens=2))
    assert first.error is None
    again = vision.one(ask("c2", [picture(5)], text="And now in one word?", cache_lookup=True, max_tokens=2))
    other = vision.one(ask("c3", [picture(6)], text="And now in one word?", cache_lookup=True, max_tokens=2))
    # Both share the template text before the image; only the same image extends the reused prefix past it.
    assert other.cached_tokens > 0
    assert again.cached_tokens >= other.cached_tokens + IMAGE_TOKENS, (again.cached_tokens, other.cached_tokens)


def test_text_and_image_requests_run_together(vision):
    requests = [ask(f"img{i}", [picture(10 + i)], max_tokens=16) for i in range(3)]
    requests += [
        EngineRequest(f"txt{i}", [{"role": "user", "content": f"Count to {i + 3}."}], SamplingParams(max_tokens=16))
        for i in range(5)
    ]
    outs = vision.run(requests)
    assert len(outs) == 8
    assert all(o.error is None and o.completion_tokens > 0 for o in outs.values()), {
        k: o.error for k, o in outs.items()
    }
    assert vision.scheduler.stats.media_chunks >= 3


def test_a_raw_prompt_that_ends_with_an_image_is_refused_alone(vision):
    bad = EngineRequest(
        "ends-with-image",
        [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "media", "index": 0}]}],
        SamplingParams(max_tokens=4),
        media=[picture(7)],
        apply_chat_template=False,
    )
    outs = vision.run([bad, ask("fine", [picture(7)], max_tokens=4)])
    assert "ends with image" in outs["ends-with-image"].error
    assert outs["fine"].error is None


def test_audio_into_a_vision_projector_fails_that_request_only(vision):
    outs = vision.run([ask("snd", [sound("tone")]), ask("pic", [picture(8)], max_tokens=4)])
    assert "no audio" in outs["snd"].error
    assert outs["pic"].error is None


def test_media_without_a_projector_is_a_clear_error(engine):
    assert engine.scheduler.projector is None
    out = engine.one(ask("no-proj", [picture(9)]))
    assert out.error and "text only" in out.error and "mmproj_path" in out.error


def test_audio_steers_the_output(audio):
    outs = audio.run([ask("tone1", [sound("tone")]), ask("noise", [sound("noise")]), ask("tone2", [sound("tone")])])
    assert all(o.error is None for o in outs.values()), {k: o.error for k, o in outs.items()}
    assert outs["tone1"].text == outs["tone2"].text
    assert outs["tone1"].text != outs["noise"].text


def test_long_audio_is_several_windows(audio):
    short = audio.one(ask("short", [sound("tone", 2.0)], max_tokens=1))
    long = audio.one(ask("long", [sound("tone", 40.0)], max_tokens=1))
    assert long.error is None, long.error
    assert long.prompt_tokens == short.prompt_tokens + AUDIO_TOKENS  # 40 s = two 30 s windows


def test_probe_reports_caps_and_refuses_a_file_that_is_not_a_projector(mmproj_files, model_path, tmp_path):
    caps = probe(mmproj_files[0], model_path)
    assert caps.vision and not caps.audio and caps.image_size == 32 and caps.projector_type == "mlp"
    caps = probe(mmproj_files[1], model_path)
    assert caps.audio and caps.audio_sample_rate == 16000
    with pytest.raises(EngineError, match="failed its check"):
        probe(model_path, model_path)  # a text model is not a projector
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF" + bytes(64))
    projector, why = attach_projector(str(bogus), model_path, None, n_threads=1, use_gpu=False)
    assert projector is None and "failed its check" in why

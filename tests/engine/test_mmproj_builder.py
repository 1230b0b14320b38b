"""tools/build_mmproj.py: the random-weight projectors it writes load in llama.cpp's mtmd next to the bundled model.

Low-level, over llama-cpp-python's ctypes bindings (llama_cpp.mtmd_cpp), as the engine will drive it: tokenize a
prompt with the media marker into chunks, encode the media chunk, decode its embeddings with an embd llama_batch,
then greedy-decode text. Different images must steer the output differently, the same image identically.
"""

from __future__ import annotations

import ctypes
import logging

import llama_cpp as L
import llama_cpp.mtmd_cpp as M
import numpy as np
import pytest
from llama_cpp._logger import llama_log_callback

from tools.build_mmproj import build_audio_mmproj, build_vision_mmproj, gguf_metadata, main, text_model_n_embd

N_BATCH = 256
N_GEN = 8
MARKER = M.mtmd_default_marker().decode()


def chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


class TextModel:
    """The bundled model with one sequence, a token batch and an embedding batch."""

    def __init__(self, path: str):
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        assert self.model
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_embd = L.llama_model_n_embd_inp(self.model)
        cp = L.llama_context_default_params()
        cp.n_ctx = 512
        cp.n_batch = cp.n_ubatch = N_BATCH
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = 2
        self.ctx = L.llama_init_from_model(self.model, cp)
        assert self.ctx
        self.mem = L.llama_get_memory(self.ctx)
        self.tokens = L.llama_batch_init(N_BATCH, 0, 1)
        self.embd = L.llama_batch_init(N_BATCH, self.n_embd, 1)

    def _fill(self, b, i: int, pos: int, logits: bool) -> None:
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = 0
        b.logits[i] = 1 if logits else 0

    def decode_tokens(self, tokens: list[int], pos: int, *, logits_last: bool) -> int:
        assert 0 < len(tokens) <= N_BATCH
        b = self.tokens
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i] = t
            self._fill(b, i, pos + i, logits_last and i == len(tokens) - 1)
        assert L.llama_decode(self.ctx, b) == 0
        return pos + len(tokens)

    def decode_embd(self, embd: np.ndarray, pos: int) -> None:
        """embd: (n, n_embd) float32 rows, one position each (no M-RoPE)."""
        n = embd.shape[0]
        assert 0 < n <= N_BATCH and embd.shape[1] == self.n_embd
        b = self.embd
        b.n_tokens = n
        ctypes.memmove(b.embd, np.ascontiguousarray(embd, dtype=np.float32).ctypes.data, embd.nbytes)
        for i in range(n):
            self._fill(b, i, pos + i, False)
        assert L.llama_decode(self.ctx, b) == 0

    def greedy(self, pos: int) -> list[int]:
        out: list[int] = []
        for _ in range(N_GEN):
            row = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))
            out.append(int(np.argmax(row)))
            if L.llama_vocab_is_eog(self.vocab, out[-1]):
                break
            pos = self.decode_tokens(out[-1:], pos, logits_last=True)
        return out

    def close(self) -> None:
        L.llama_batch_free(self.tokens)
        L.llama_batch_free(self.embd)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)


@pytest.fixture(scope="module")
def text(model_path):
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    M.mtmd_helper_log_set(llama_log_callback, None)  # mtmd and clip log through llama-cpp-python's logger too
    t = TextModel(model_path)
    yield t
    t.close()


def open_mtmd(path, text: TextModel):
    p = M.mtmd_context_params_default()
    p.use_gpu = False
    # one thread: the tiny graphs take well under a millisecond, and with two OpenMP threads on a busy 2-core
    # runner an encode can stall ~250 ms at a barrier
    p.n_threads = 1
    p.print_timings = False
    return M.mtmd_init_from_file(str(path).encode(), text.model, p)


@pytest.fixture(scope="module")
def vision(tmp_path_factory, text):
    path = build_vision_mmproj(tmp_path_factory.mktemp("mmproj") / "vision.gguf", n_embd_text=text.n_embd)
    ctx = open_mtmd(path, text)
    assert ctx, "mtmd_init_from_file refused the built vision projector"
    yield ctx
    M.mtmd_free(ctx)


@pytest.fixture(scope="module")
def audio(tmp_path_factory, text):
    path = build_audio_mmproj(tmp_path_factory.mktemp("mmproj") / "audio.gguf", n_embd_text=text.n_embd)
    ctx = open_mtmd(path, text)
    assert ctx, "mtmd_init_from_file refused the built audio projector"
    yield ctx
    M.mtmd_free(ctx)


def image_bitmap(rgb: np.ndarray):
    ny, nx, _ = rgb.shape
    data = np.ascontiguousarray(rgb, dtype=np.uint8)
    return M.mtmd_bitmap_init(nx, ny, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))


def audio_bitmap(pcm: np.ndarray):
    data = np.ascontiguousarray(pcm, dtype=np.float32)
    return M.mtmd_bitmap_init_from_audio(len(data), data.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))


def tokenize(mctx, prompt: str, bitmap):
    chunks = M.mtmd_input_chunks_init()
    raw = prompt.encode()
    txt = M.mtmd_input_text(text=raw, text_len=len(raw), add_special=True, parse_special=True)
    rc = M.mtmd_tokenize(mctx, chunks, ctypes.byref(txt), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1)
    M.mtmd_bitmap_free(bitmap)  # the chunks keep their own preprocessed copy
    assert rc == 0, f"mtmd_tokenize returned {rc}"
    return chunks


def chunk_list(chunks) -> list:
    return [M.mtmd_input_chunks_get(chunks, i) for i in range(M.mtmd_input_chunks_size(chunks))]


def generate(mctx, text: TextModel, prompt: str, bitmap) -> tuple[list[int], list[tuple[int, int]]]:
    """Evaluate the chunks by hand (text: token batch; media: encode, then embd batch), then greedy-decode."""
    chunks = tokenize(mctx, prompt, bitmap)
    try:
        L.llama_memory_clear(text.mem, True)
        pos, shapes = 0, []
        items = chunk_list(chunks)
        for i, ch in enumerate(items):
            kind = M.mtmd_input_chunk_get_type(ch)
            n_tok = M.mtmd_input_chunk_get_n_tokens(ch)
            shapes.append((kind, n_tok))
            if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                ptr = M.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
                pos = text.decode_tokens([ptr[j] for j in range(n.value)], pos, logits_last=i == len(items) - 1)
                continue
            assert M.mtmd_encode_chunk(mctx, ch) == 0
            embd = np.ctypeslib.as_array(M.mtmd_get_output_embd(mctx), shape=(n_tok, text.n_embd)).copy()
            assert np.isfinite(embd).all()
            assert not M.mtmd_decode_use_non_causal(mctx, ch) and not M.mtmd_decode_use_mrope(mctx)
            text.decode_embd(embd, pos)
            assert M.mtmd_input_chunk_get_n_pos(ch) == n_tok
            pos += n_tok
        return text.greedy(pos), shapes
    finally:
        M.mtmd_input_chunks_free(chunks)


def test_cli_reads_the_text_models_embedding_size(tmp_path, model_path, capsys):
    assert text_model_n_embd(model_path) == 576
    out = tmp_path / "cli.gguf"
    assert main(["--out", str(out), "--model", model_path]) == 0
    assert "n_embd 576" in capsys.readouterr().out
    caps = M.mtmd_get_cap_from_file(str(out).encode())
    assert caps.inp_vision and not caps.inp_audio
    keys = {"clip.projector_type", "clip.vision.image_size", "clip.vision.patch_size", "clip.vision.projection_dim"}
    assert gguf_metadata(out, keys) == {
        "clip.projector_type": "mlp",
        "clip.vision.image_size": 32,
        "clip.vision.patch_size": 8,
        "clip.vision.projection_dim": 576,
    }
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGML not a gguf")
    with pytest.raises(ValueError, match="not a GGUF"):
        gguf_metadata(bogus, keys)


def test_vision_projector_loads(vision):
    assert M.mtmd_support_vision(vision)
    assert not M.mtmd_support_audio(vision)
    assert M.mtmd_get_audio_sample_rate(vision) == -1
    assert not M.mtmd_decode_use_mrope(vision)
    assert not M.mtmd_decode_use_non_causal(vision, None)


def test_a_projector_for_another_embedding_size_is_refused(tmp_path, text):
    path = build_vision_mmproj(tmp_path / "wrong.gguf", n_embd_text=text.n_embd + 8)
    assert not open_mtmd(path, text)  # NULL, not a crash


def test_images_steer_greedy_decoding(vision, text):
    rng = np.random.default_rng(1)
    noise = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)  # neither square nor image_size: mtmd resizes
    red = np.full((32, 32, 3), (200, 30, 30), dtype=np.uint8)
    prompt = chat(f"{MARKER}\nWhat is in the picture?")

    out_a, shapes = generate(vision, text, prompt, image_bitmap(noise))
    kinds = [k for k, _ in shapes]
    assert kinds == [M.MTMD_INPUT_CHUNK_TYPE_TEXT, M.MTMD_INPUT_CHUNK_TYPE_IMAGE, M.MTMD_INPUT_CHUNK_TYPE_TEXT]
    assert shapes[1][1] == (32 // 8) ** 2  # (image_size / patch_size)^2 embeddings, whatever the input size
    out_a2, _ = generate(vision, text, prompt, image_bitmap(noise))
    out_b, _ = generate(vision, text, prompt, image_bitmap(red))
    assert out_a == out_a2
    assert out_a != out_b


def test_hand_evaluation_matches_mtmd_helper(vision, text):
    """The embd-batch path gives what mtmd_helper_eval_chunks (llama.cpp's own) gives."""
    img = np.random.default_rng(2).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    prompt = chat(f"Look: {MARKER} Describe it.")
    ours, _ = generate(vision, text, prompt, image_bitmap(img))

    chunks = tokenize(vision, prompt, image_bitmap(img))
    L.llama_memory_clear(text.mem, True)
    n_past = L.llama_pos(0)
    assert M.mtmd_helper_eval_chunks(vision, text.ctx, chunks, 0, 0, N_BATCH, True, ctypes.byref(n_past)) == 0
    assert n_past.value == M.mtmd_helper_get_n_pos(chunks)
    M.mtmd_input_chunks_free(chunks)
    assert text.greedy(n_past.value) == ours


def test_audio_projector_loads_and_steers(audio, text):
    assert M.mtmd_support_audio(audio) and not M.mtmd_support_vision(audio)
    sr = M.mtmd_get_audio_sample_rate(audio)
    assert sr == 16000

    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(3 * sr) / sr)).astype(np.float32)  # 3 s
    noise = np.random.default_rng(3).uniform(-0.3, 0.3, 3 * sr).astype(np.float32)

    prompt = chat(f"{MARKER}\nWhat did you hear?")
    out_a, shapes = generate(audio, text, prompt, audio_bitmap(tone))
    assert shapes[1] == (M.MTMD_INPUT_CHUNK_TYPE_AUDIO, 150)  # a 30 s window: 3000 mel frames / 2 / stack 10
    out_a2, _ = generate(audio, text, prompt, audio_bitmap(tone))
    out_b, _ = generate(audio, text, prompt, audio_bitmap(noise))
    assert out_a == out_a2
    assert out_a != out_b

"""End-to-end proof of mtmd over llama-cpp-python 0.3.36's ctypes bindings, with the built test projectors.

Builds a random-weight "mlp" vision mmproj and an "ultravox" audio mmproj (tools/build_mmproj.py) sized for the
bundled text model, loads them with mtmd_init_from_file next to that model, tokenizes prompts carrying the media
marker into chunks, encodes the media chunks, decodes their embeddings into a llama context with an embd
llama_batch (no helper), continues with greedy sampling, and checks:

  - two different images give different greedy outputs, the same image twice gives identical ones;
  - the hand-written chunk evaluation gives the same greedy output as mtmd_helper_eval_chunks;
  - the audio projector loads and encodes a chunk.

    flock /tmp/edgellm-engine.lock .venv/bin/python notes/mtmd_e2e.py
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp as L
import llama_cpp.mtmd_cpp as M
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.build_mmproj import build_audio_mmproj, build_vision_mmproj  # noqa: E402

N_THREADS = 2
N_BATCH = 512
N_GEN = 12


def quiet_logs() -> None:
    """llama-cpp-python routes llama.cpp's log through its "llama-cpp-python" logger (llama_cpp._logger sets
    llama_log_set at import); mtmd and clip keep their own callback, stderr by default. Point them at the same
    callback so one logger level governs all three. mtmd_helper_log_set also calls mtmd_log_set (mtmd + clip)."""
    from llama_cpp._logger import llama_log_callback

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    M.mtmd_helper_log_set(llama_log_callback, None)


class Text:
    def __init__(self, model_path: str):
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(model_path.encode(), mp)
        assert self.model, model_path
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        # mtmd checks the projector's output size against llama_model_n_embd_inp (the input embedding size)
        self.n_embd = L.llama_model_n_embd_inp(self.model)
        cp = L.llama_context_default_params()
        cp.n_ctx = 2048
        cp.n_batch = N_BATCH
        cp.n_ubatch = N_BATCH  # a non-causal image must fit in one ubatch; the helper warns about that
        cp.n_seq_max = 1
        cp.n_threads = N_THREADS
        cp.n_threads_batch = N_THREADS
        self.ctx = L.llama_init_from_model(self.model, cp)
        assert self.ctx
        self.mem = L.llama_get_memory(self.ctx)
        self.tok_batch = L.llama_batch_init(N_BATCH, 0, 1)  # token batch: batch.token set, batch.embd NULL
        self.embd_batch = L.llama_batch_init(N_BATCH, self.n_embd, 1)  # embd batch: batch.embd set, token NULL

    def reset(self) -> None:
        L.llama_memory_clear(self.mem, True)

    def decode_tokens(self, tokens: list[int], pos0: int, *, logits_last: bool) -> int:
        b = self.tok_batch
        for start in range(0, len(tokens), N_BATCH):
            part = tokens[start : start + N_BATCH]
            b.n_tokens = len(part)
            for j, t in enumerate(part):
                b.token[j] = t
                b.pos[j] = pos0 + start + j
                b.n_seq_id[j] = 1
                b.seq_id[j][0] = 0
                b.logits[j] = 0
            if logits_last and start + len(part) == len(tokens):
                b.logits[len(part) - 1] = 1
            rc = L.llama_decode(self.ctx, b)
            assert rc == 0, rc
        return pos0 + len(tokens)

    def decode_embd(self, embd: np.ndarray, pos0: int) -> None:
        """embd: (n_tokens, n_embd) float32, row-major; each row is one position (non-M-RoPE models)."""
        b = self.embd_batch
        n = embd.shape[0]
        for start in range(0, n, N_BATCH):
            part = np.ascontiguousarray(embd[start : start + N_BATCH], dtype=np.float32)
            b.n_tokens = part.shape[0]
            ctypes.memmove(b.embd, part.ctypes.data, part.nbytes)
            for j in range(part.shape[0]):
                b.pos[j] = pos0 + start + j
                b.n_seq_id[j] = 1
                b.seq_id[j][0] = 0
                b.logits[j] = 0
            rc = L.llama_decode(self.ctx, b)
            assert rc == 0, rc

    def greedy(self, pos: int, n: int) -> list[int]:
        out = []
        for _ in range(n):
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))
            t = int(np.argmax(logits))
            out.append(t)
            if L.llama_vocab_is_eog(self.vocab, t):
                break
            pos = self.decode_tokens([t], pos, logits_last=True)
        return out

    def detok(self, tokens: list[int]) -> str:
        buf = ctypes.create_string_buffer(256)
        parts = []
        for t in tokens:
            n = L.llama_token_to_piece(self.vocab, t, buf, len(buf), 0, False)
            parts.append(buf.raw[:n])
        return b"".join(parts).decode("utf-8", "replace")

    def close(self) -> None:
        L.llama_batch_free(self.tok_batch)
        L.llama_batch_free(self.embd_batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)


def mtmd_open(mmproj: str, text: Text):
    p = M.mtmd_context_params_default()
    p.use_gpu = False
    # 1 thread: these graphs are tiny, and with 2 OpenMP threads on a loaded 2-core box an encode stalls ~250 ms
    p.n_threads = 1
    p.print_timings = False
    p.warmup = True  # one encode at init so the first real encode is not slower
    ctx = M.mtmd_init_from_file(mmproj.encode(), text.model, p)
    assert ctx, mmproj
    return ctx


def image_bitmap(rgb: np.ndarray, bitmap_id: str | None = None):
    """rgb: (ny, nx, 3) uint8. mtmd copies the bytes, so the array may be freed after this call."""
    ny, nx, _ = rgb.shape
    data = np.ascontiguousarray(rgb, dtype=np.uint8)
    bmp = M.mtmd_bitmap_init(nx, ny, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
    assert bmp
    if bitmap_id is not None:
        M.mtmd_bitmap_set_id(bmp, bitmap_id.encode())
    return bmp


def tokenize(mctx, prompt: str, bitmaps: list):
    chunks = M.mtmd_input_chunks_init()
    raw = prompt.encode()
    txt = M.mtmd_input_text(text=raw, text_len=len(raw), add_special=True, parse_special=True)
    arr = (M.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
    rc = M.mtmd_tokenize(mctx, chunks, ctypes.byref(txt), arr, len(bitmaps))
    assert rc == 0, f"mtmd_tokenize returned {rc}"
    return chunks


def describe_chunks(chunks) -> list[dict]:
    out = []
    for i in range(M.mtmd_input_chunks_size(chunks)):
        ch = M.mtmd_input_chunks_get(chunks, i)
        kind = M.mtmd_input_chunk_get_type(ch)
        d = {
            "type": {0: "text", 1: "image", 2: "audio"}[kind],
            "n_tokens": M.mtmd_input_chunk_get_n_tokens(ch),
            "n_pos": M.mtmd_input_chunk_get_n_pos(ch),
        }
        if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t(0)
            ptr = M.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
            d["tokens"] = [ptr[j] for j in range(n.value)]
        else:
            cid = M.mtmd_input_chunk_get_id(ch)
            d["id"] = cid.decode() if cid else None
        out.append(d)
    return out


def eval_by_hand(mctx, text: Text, chunks) -> tuple[int, list[float]]:
    """Chunk by chunk, as the engine would: text tokens in token batches, media embeddings in embd batches."""
    pos = 0
    encode_ms = []
    n = M.mtmd_input_chunks_size(chunks)
    for i in range(n):
        ch = M.mtmd_input_chunks_get(chunks, i)
        kind = M.mtmd_input_chunk_get_type(ch)
        last = i == n - 1
        if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
            cnt = ctypes.c_size_t(0)
            ptr = M.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(cnt))
            pos = text.decode_tokens([ptr[j] for j in range(cnt.value)], pos, logits_last=last)
            continue
        t0 = time.perf_counter()
        rc = M.mtmd_encode_chunk(mctx, ch)
        encode_ms.append((time.perf_counter() - t0) * 1e3)
        assert rc == 0, rc
        n_tok = M.mtmd_input_chunk_get_n_tokens(ch)
        # valid until the next encode; copy it out (the engine would keep it per request)
        embd = np.ctypeslib.as_array(M.mtmd_get_output_embd(mctx), shape=(n_tok, text.n_embd)).copy()
        assert not M.mtmd_decode_use_mrope(mctx)
        non_causal = M.mtmd_decode_use_non_causal(mctx, ch)
        if non_causal:
            L.llama_set_causal_attn(text.ctx, False)
        text.decode_embd(embd, pos)
        if non_causal:
            L.llama_set_causal_attn(text.ctx, True)
        pos += M.mtmd_input_chunk_get_n_pos(ch)
        assert not last, "a prompt ending in a media chunk needs a text token after it to get logits"
    return pos, encode_ms


def run_vision(mctx, text: Text, images: list[np.ndarray], prompt: str) -> tuple[list[int], list[float], list]:
    bitmaps = [image_bitmap(img, f"img{i}") for i, img in enumerate(images)]
    chunks = tokenize(mctx, prompt, bitmaps)
    for b in bitmaps:
        M.mtmd_bitmap_free(b)  # the chunks hold their own preprocessed copy
    text.reset()
    pos, enc = eval_by_hand(mctx, text, chunks)
    out = text.greedy(pos, N_GEN)
    info = describe_chunks(chunks)
    M.mtmd_input_chunks_free(chunks)
    return out, enc, info


def run_helper(mctx, text: Text, images: list[np.ndarray], prompt: str) -> list[int]:
    bitmaps = [image_bitmap(img) for img in images]
    chunks = tokenize(mctx, prompt, bitmaps)
    for b in bitmaps:
        M.mtmd_bitmap_free(b)
    text.reset()
    new_pos = L.llama_pos(0)
    rc = M.mtmd_helper_eval_chunks(mctx, text.ctx, chunks, 0, 0, N_BATCH, True, ctypes.byref(new_pos))
    assert rc == 0, rc
    M.mtmd_input_chunks_free(chunks)
    return text.greedy(new_pos.value, N_GEN)


def two_sequences(mctx, model, images: list[np.ndarray], prompt: str) -> list[list[int]]:
    """The engine's way: one context with a sequence per request; every stage batches all sequences together.

    Stage 1 decodes every sequence's text before the image in one token batch, stage 2 every sequence's image
    embeddings in ONE embd batch (rows carry their own seq_id and positions), stage 3 the text after the image,
    then greedy decoding steps all live sequences in one token batch. (Prompts with one image each.)
    """
    n_seq = len(images)
    cp = L.llama_context_default_params()
    cp.n_ctx = 1024 * n_seq
    cp.n_batch = cp.n_ubatch = N_BATCH
    cp.n_seq_max = n_seq
    cp.kv_unified = False
    cp.n_threads = cp.n_threads_batch = N_THREADS
    ctx = L.llama_init_from_model(model, cp)
    n_embd = L.llama_model_n_embd_inp(model)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    tb = L.llama_batch_init(N_BATCH, 0, n_seq)
    eb = L.llama_batch_init(N_BATCH, n_embd, n_seq)

    stages = []  # per sequence: [head tokens, image embeddings, tail tokens]
    for img in images:
        chunks = tokenize(mctx, prompt, [image_bitmap(img)])
        parts = []
        for i in range(M.mtmd_input_chunks_size(chunks)):
            ch = M.mtmd_input_chunks_get(chunks, i)
            if M.mtmd_input_chunk_get_type(ch) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                cnt = ctypes.c_size_t(0)
                ptr = M.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(cnt))
                parts.append([ptr[j] for j in range(cnt.value)])
            else:
                assert M.mtmd_encode_chunk(mctx, ch) == 0
                k = M.mtmd_input_chunk_get_n_tokens(ch)
                parts.append(np.ctypeslib.as_array(M.mtmd_get_output_embd(mctx), shape=(k, n_embd)).copy())
        M.mtmd_input_chunks_free(chunks)
        stages.append(parts)

    pos = [0] * n_seq

    def token_step(rows: list[tuple[int, int, bool]]) -> None:  # (seq, token, want logits)
        tb.n_tokens = len(rows)
        for j, (s, t, lg) in enumerate(rows):
            tb.token[j], tb.pos[j], tb.n_seq_id[j], tb.logits[j] = t, pos[s], 1, int(lg)
            tb.seq_id[j][0] = s
            pos[s] += 1
        assert L.llama_decode(ctx, tb) == 0

    token_step([(s, t, False) for s in range(n_seq) for t in stages[s][0]])
    rows = np.concatenate([stages[s][1] for s in range(n_seq)])
    eb.n_tokens = rows.shape[0]
    ctypes.memmove(eb.embd, rows.ctypes.data, rows.nbytes)
    j = 0
    for s in range(n_seq):
        for _ in range(stages[s][1].shape[0]):
            eb.pos[j], eb.n_seq_id[j], eb.logits[j] = pos[s], 1, 0
            eb.seq_id[j][0] = s
            pos[s] += 1
            j += 1
    assert L.llama_decode(ctx, eb) == 0
    token_step([(s, t, i == len(stages[s][2]) - 1) for s in range(n_seq) for i, t in enumerate(stages[s][2])])

    outs: list[list[int]] = [[] for _ in range(n_seq)]
    live = list(range(n_seq))  # logits rows come in batch order of the rows that asked for them
    for _ in range(N_GEN):
        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(live), n_vocab))
        nxt = []
        for r, s in enumerate(live):
            t = int(np.argmax(logits[r]))
            outs[s].append(t)
            if not L.llama_vocab_is_eog(vocab, t):
                nxt.append((s, t, True))
        live = [s for s, _, _ in nxt]
        if not nxt:
            break
        token_step(nxt)
    L.llama_batch_free(tb)
    L.llama_batch_free(eb)
    L.llama_free(ctx)
    return outs


def main() -> int:
    from edgellm.runtime.model_sizing import bundled_model_path

    if "-v" not in sys.argv:
        quiet_logs()
    model_path = str(bundled_model_path())
    text = Text(model_path)
    print(f"text model {os.path.basename(model_path)}: n_embd_inp {text.n_embd}, n_vocab {text.n_vocab}")
    tmp = Path(tempfile.mkdtemp(prefix="mmproj-"))

    t0 = time.perf_counter()
    vpath = build_vision_mmproj(tmp / "vision.gguf", n_embd_text=text.n_embd)
    print(f"built {vpath.name}: {vpath.stat().st_size} bytes in {(time.perf_counter() - t0) * 1e3:.0f} ms")
    t0 = time.perf_counter()
    mctx = mtmd_open(str(vpath), text)
    print(f"mtmd_init_from_file (with warmup) {(time.perf_counter() - t0) * 1e3:.0f} ms")
    print(
        f"vision {M.mtmd_support_vision(mctx)} audio {M.mtmd_support_audio(mctx)} "
        f"mrope {M.mtmd_decode_use_mrope(mctx)} non_causal {M.mtmd_decode_use_non_causal(mctx, None)} "
        f"marker {M.mtmd_get_marker(mctx)!r} default {M.mtmd_default_marker()!r}"
    )

    rng = np.random.default_rng(1)
    img_a = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)  # not square, not image_size: mtmd resizes
    img_b = np.full((32, 32, 3), (200, 30, 30), dtype=np.uint8)
    marker = M.mtmd_default_marker().decode()
    prompt = f"<|im_start|>user\n{marker}\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n"

    out_a, enc_a, info = run_vision(mctx, text, [img_a], prompt)
    for d in info:
        extra = f" tokens[:8]={d['tokens'][:8]}" if d["type"] == "text" else f" id={d['id']}"
        print(f"  chunk {d['type']}: n_tokens {d['n_tokens']} n_pos {d['n_pos']}{extra}")
    out_a2, enc_a2, _ = run_vision(mctx, text, [img_a], prompt)
    out_b, enc_b, _ = run_vision(mctx, text, [img_b], prompt)
    print(f"A : {out_a} {text.detok(out_a)!r}")
    print(f"A': {out_a2} {text.detok(out_a2)!r}")
    print(f"B : {out_b} {text.detok(out_b)!r}")
    print(f"encode ms: {[round(x, 2) for x in enc_a + enc_a2 + enc_b]}")
    assert out_a == out_a2, "same image, different output"
    assert out_a != out_b, "different images, same output"

    out_h = run_helper(mctx, text, [img_a], prompt)
    print(f"helper A: {out_h}")
    assert out_h == out_a, "mtmd_helper_eval_chunks disagrees with the hand-written evaluation"

    two = f"<|im_start|>user\n{marker} and {marker}: same?<|im_end|>\n<|im_start|>assistant\n"
    out_ab, _, info2 = run_vision(mctx, text, [img_a, img_b], two)
    print(f"two images: chunks {[d['type'] for d in info2]} -> {text.detok(out_ab)!r}")

    multi = two_sequences(mctx, text.model, [img_a, img_b], prompt)
    print(f"two sequences, images in one embd batch: {multi}")
    assert multi == [out_a, out_b], "continuous-batch evaluation differs from one sequence at a time"
    M.mtmd_free(mctx)

    apath = build_audio_mmproj(tmp / "audio.gguf", n_embd_text=text.n_embd)
    t0 = time.perf_counter()
    actx = mtmd_open(str(apath), text)
    print(f"audio mtmd_init_from_file {(time.perf_counter() - t0) * 1e3:.0f} ms")
    sr = M.mtmd_get_audio_sample_rate(actx)
    print(f"vision {M.mtmd_support_vision(actx)} audio {M.mtmd_support_audio(actx)} sample_rate {sr}")
    outs = []
    for freq in (440.0, 1000.0, 440.0):
        pcm = (0.3 * np.sin(2 * np.pi * freq * np.arange(sr * 2) / sr)).astype(np.float32)  # 2 s
        bmp = M.mtmd_bitmap_init_from_audio(len(pcm), pcm.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        chunks = tokenize(
            actx, f"<|im_start|>user\n{marker}\nWhat did you hear?<|im_end|>\n<|im_start|>assistant\n", [bmp]
        )
        M.mtmd_bitmap_free(bmp)
        info = describe_chunks(chunks)
        text.reset()
        pos, enc = eval_by_hand(actx, text, chunks)
        outs.append(text.greedy(pos, N_GEN))
        print(
            f"  audio {freq:.0f} Hz: chunks {[(d['type'], d['n_tokens'], d['n_pos']) for d in info]} "
            f"encode {enc[0]:.0f} ms -> {text.detok(outs[-1])!r}"
        )
        M.mtmd_input_chunks_free(chunks)
    assert outs[0] == outs[2] and outs[0] != outs[1]
    M.mtmd_free(actx)
    text.close()
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

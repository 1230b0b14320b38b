"""Build tiny random-weight mmproj GGUFs that llama.cpp's mtmd library loads (tests' multimodal fixture).

Nothing is downloaded: the weights are random, seeded, and small, so a test can build the projector in its
tmp_path in milliseconds and load it next to the bundled text model. The output embedding size is the text
model's n_embd (mtmd refuses a projector whose output size differs from the text model's input size).

Vision: projector type "mlp" (LLaVA-1.5 style): a ViT over patch_size x patch_size patches of an
image_size x image_size image, then mm.0 (linear) -> GELU -> mm.2 (linear) to n_embd_text. mtmd's preprocessing
for it is a fixed-size resize (pad to square, resize to image_size), it adds no text around the image, and the
text model decodes the image with its ordinary causal attention, so one image is (image_size / patch_size)^2
embeddings, each one position. Note the LLaVA graph runs layers - 1 ViT blocks (it takes the second-to-last
layer's output, as LLaVA does); the last block's tensors must still be in the file.

Audio: projector type "ultravox": a Whisper-style encoder (two conv1d over the log-mel spectrogram, the second
with stride 2, learned positions, pre-LN blocks, a final LN), frames stacked by stack_factor, then RMS norm
(mm.a.norm_pre) -> mm.a.mlp.1 -> SwiGLU -> RMS norm (mm.a.norm_mid) -> mm.a.mlp.2 to n_embd_text. mtmd cuts audio
into 30 s chunks of 16 kHz mono float PCM, 3000 mel frames each, which give 3000 / 2 / stack_factor embeddings
per chunk.

The key names, tensor names and shapes follow llama.cpp's tools/mtmd (clip-impl.h, clip.cpp load_hparams and
load_tensors, models/llava.cpp and models/whisper-enc.cpp) at the version llama-cpp-python 0.3.36 vendors. Shapes
below are numpy (row-major) shapes; GGUF/ggml stores them reversed (ne[0] is the last numpy dimension).

    python tools/build_mmproj.py --out mmproj.gguf --model text.gguf [--audio]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf  # the gguf package (pip install gguf), a project dependency
import numpy as np

from edgellm.engine.gguf_header import read_metadata as gguf_metadata

# clip.cpp reads these (clip-impl.h KEY_*); "%s" is "vision" or "audio"
KEY_PROJ_TYPE = "clip.projector_type"
KEY_HAS_VISION = "clip.has_vision_encoder"
KEY_HAS_AUDIO = "clip.has_audio_encoder"
KEY_USE_GELU = "clip.use_gelu"


def _hparam_keys(modality: str) -> dict[str, str]:
    return {
        "n_embd": f"clip.{modality}.embedding_length",
        "n_ff": f"clip.{modality}.feed_forward_length",
        "n_layer": f"clip.{modality}.block_count",
        "proj_dim": f"clip.{modality}.projection_dim",
        "n_head": f"clip.{modality}.attention.head_count",
        "eps": f"clip.{modality}.attention.layer_norm_epsilon",
    }


class _Weights:
    """Seeded random tensors. Linear weights are (out, in) as in PyTorch, scaled so activations stay O(1)."""

    def __init__(self, writer: gguf.GGUFWriter, seed: int):
        self.writer = writer
        self.rng = np.random.default_rng(seed)

    def linear(self, name: str, n_out: int, n_in: int, *, bias: bool = True, gain: float = 1.0) -> None:
        w = self.rng.standard_normal((n_out, n_in), dtype=np.float32) * np.float32(gain / np.sqrt(n_in))
        self.writer.add_tensor(f"{name}.weight", w)
        if bias:
            self.writer.add_tensor(f"{name}.bias", self.rng.standard_normal(n_out, dtype=np.float32) * np.float32(0.02))

    def norm(self, name: str, n: int, *, bias: bool = True) -> None:
        w = np.float32(1.0) + self.rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
        self.writer.add_tensor(f"{name}.weight", w)
        if bias:
            self.writer.add_tensor(f"{name}.bias", np.zeros(n, dtype=np.float32))

    def raw(self, name: str, shape: tuple[int, ...], scale: float) -> None:
        self.writer.add_tensor(name, self.rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))

    def block(self, prefix: str, il: int, n_embd: int, n_ff: int, *, k_bias: bool = True) -> None:
        """One pre-LN transformer block: ln1, attn_q/k/v/out, ln2, ffn_up/ffn_down (clip.cpp TN_* names)."""
        blk = f"{prefix}.blk.{il}"
        self.norm(f"{blk}.ln1", n_embd)
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            self.linear(f"{blk}.{proj}", n_embd, n_embd, bias=k_bias or proj != "attn_k")
        self.norm(f"{blk}.ln2", n_embd)
        # clip.cpp swaps up/down of old LLaVA files when ffn_down's ne[0] == n_embd; n_ff != n_embd avoids that
        self.linear(f"{blk}.ffn_up", n_ff, n_embd)
        self.linear(f"{blk}.ffn_down", n_embd, n_ff)


def _writer(path: Path, name: str) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(str(path), arch="clip")
    w.add_name(name)
    w.add_description("random-weight test projector built by edgellm tools/build_mmproj.py")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    return w


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _encoder_header(
    w, modality: str, projector: str, hidden: int, ffn: int, layers: int, heads: int, n_embd_text: int, eps: float
) -> None:
    """The keys every clip encoder reads: which modality, the projector type and the transformer's sizes."""
    w.add_bool(KEY_HAS_VISION, modality == "vision")
    w.add_bool(KEY_HAS_AUDIO, modality == "audio")
    w.add_string(KEY_PROJ_TYPE, projector)
    keys = _hparam_keys(modality)
    w.add_uint32(keys["n_embd"], hidden)
    w.add_uint32(keys["n_ff"], ffn)
    w.add_uint32(keys["n_layer"], layers)
    w.add_uint32(keys["proj_dim"], n_embd_text)
    w.add_uint32(keys["n_head"], heads)
    w.add_float32(keys["eps"], eps)


def build_vision_mmproj(
    path: str | Path,
    *,
    n_embd_text: int,
    image_size: int = 32,
    patch_size: int = 8,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    ffn: int | None = None,
    proj_hidden: int | None = None,
    out_gain: float = 4.0,
    seed: int = 0,
) -> Path:
    """Write an "mlp" (LLaVA-1.5 style) vision projector; return its path.

    One image becomes (image_size // patch_size) ** 2 embeddings of size n_embd_text. out_gain scales the last
    projection so the embeddings are big enough, next to the text model's token embeddings, for different
    images to steer greedy decoding differently.
    """
    if image_size % patch_size:
        raise ValueError("image_size must be a multiple of patch_size")
    if hidden % heads:
        raise ValueError("hidden must be a multiple of heads")
    if layers < 1:
        raise ValueError("layers must be >= 1 (the LLaVA graph runs layers - 1 of them)")
    ffn = ffn or 2 * hidden + 8  # != hidden, see _Weights.block
    proj_hidden = proj_hidden or 2 * hidden
    path = Path(path)
    n_patches = (image_size // patch_size) ** 2

    w = _writer(path, "edgellm-test-vision-mlp")
    _encoder_header(w, "vision", "mlp", hidden, ffn, layers, heads, n_embd_text, 1e-6)
    w.add_uint32("clip.vision.image_size", image_size)
    w.add_uint32("clip.vision.patch_size", patch_size)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_bool(KEY_USE_GELU, True)

    t = _Weights(w, seed)
    # conv2d patch embedding, PyTorch layout (out_channels, in_channels, kh, kw) -> ggml ne [kw, kh, 3, hidden]
    t.raw("v.patch_embd.weight", (hidden, 3, patch_size, patch_size), 1.0 / np.sqrt(3 * patch_size * patch_size))
    t.raw("v.patch_embd.bias", (hidden,), 0.02)
    t.raw("v.position_embd.weight", (n_patches, hidden), 0.5)  # the LLaVA graph requires learned positions
    t.norm("v.pre_ln", hidden)
    for il in range(layers):
        t.block("v", il, hidden, ffn)
    t.linear("mm.0", proj_hidden, hidden)
    t.linear("mm.2", n_embd_text, proj_hidden, gain=out_gain)
    _finish(w)
    return path


def build_audio_mmproj(
    path: str | Path,
    *,
    n_embd_text: int,
    n_mel: int = 128,
    hidden: int = 64,
    layers: int = 1,
    heads: int = 4,
    ffn: int | None = None,
    stack_factor: int = 10,
    proj_hidden: int | None = None,
    out_gain: float = 1.0,
    seed: int = 0,
) -> Path:
    """Write an "ultravox" (Whisper encoder + stacked-frame SwiGLU MLP) audio projector; return its path.

    mtmd's Whisper preprocessing gives 3000 mel frames per 30 s chunk (shorter audio is padded to 30 s); the
    encoder halves them and the projector stacks stack_factor of them, so one chunk is 1500 / stack_factor
    embeddings (150 by default). The encoder's learned positions cover 1500 frames, as Whisper's do.

    stack_factor must divide 1500: clip.cpp counts the output tokens as ceil(3000 / stack_factor) / 2 (floor)
    while the graph makes ceil(1500 / stack_factor), and aborts the process (GGML_ABORT "Invalid number of output
    tokens") at the first encode when the two differ, e.g. with Ultravox's own stack_factor 8.
    """
    if hidden % heads:
        raise ValueError("hidden must be a multiple of heads")
    if 1500 % stack_factor:
        raise ValueError("stack_factor must divide 1500 (see the docstring)")
    ffn = ffn or 2 * hidden + 8
    proj_hidden = proj_hidden or 2 * hidden
    n_ctx = 1500  # whisper positions after the stride-2 conv over 3000 frames
    path = Path(path)

    w = _writer(path, "edgellm-test-audio-ultravox")
    _encoder_header(w, "audio", "ultravox", hidden, ffn, layers, heads, n_embd_text, 1e-5)
    w.add_uint32("clip.audio.num_mel_bins", n_mel)
    w.add_uint32("clip.audio.projector.stack_factor", stack_factor)

    t = _Weights(w, seed)
    # conv1d kernels, PyTorch layout (out_channels, in_channels, kernel) -> ggml ne [3, in, out]
    t.raw("a.conv1d.1.weight", (hidden, n_mel, 3), 1.0 / np.sqrt(3 * n_mel))
    # the bias adds to the conv output, ne [frames, hidden], so it is a (hidden, 1) column (ggml ne [1, hidden])
    t.raw("a.conv1d.1.bias", (hidden, 1), 0.02)
    t.raw("a.conv1d.2.weight", (hidden, hidden, 3), 1.0 / np.sqrt(3 * hidden))
    t.raw("a.conv1d.2.bias", (hidden, 1), 0.02)
    t.raw("a.position_embd.weight", (n_ctx, hidden), 0.5)
    for il in range(layers):
        t.block("a", il, hidden, ffn, k_bias=False)  # whisper-enc.cpp asserts attn_k has no bias
    t.norm("a.post_ln", hidden)
    # UltravoxProjector: RMS norm (mm.a.norm_pre) over the stacked frames, mm.a.mlp.1 to 2 * proj_hidden, SwiGLU
    # (ggml_swiglu_swapped) to proj_hidden, RMS norm (mm.a.norm_mid), mm.a.mlp.2 to n_embd_text; no biases
    t.norm("mm.a.norm_pre", hidden * stack_factor, bias=False)
    t.linear("mm.a.mlp.1", 2 * proj_hidden, hidden * stack_factor, bias=False)
    t.norm("mm.a.norm_mid", proj_hidden, bias=False)
    t.linear("mm.a.mlp.2", n_embd_text, proj_hidden, bias=False, gain=out_gain)
    _finish(w)
    return path


def text_model_n_embd(model_path: str | Path) -> int:
    """The text model's embedding size, from its GGUF metadata (<general.architecture>.embedding_length)."""
    arch = gguf_metadata(model_path, {"general.architecture"}).get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{model_path}: no general.architecture")
    key = f"{arch}.embedding_length"
    n_embd = gguf_metadata(model_path, {key}).get(key)
    if not isinstance(n_embd, int):
        raise ValueError(f"{model_path}: no {key}")
    return n_embd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the mmproj GGUF to write")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="text model GGUF: its embedding length is the projector's output size")
    src.add_argument("--n-embd", type=int, help="the projector's output size, instead of --model")
    p.add_argument("--audio", action="store_true", help="an ultravox audio projector instead of a vision one")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--patch-size", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=None, help="encoder blocks (default: 2 vision, 1 audio)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    n_embd = args.n_embd if args.n_embd is not None else text_model_n_embd(args.model)
    if args.audio:
        out = build_audio_mmproj(
            args.out, n_embd_text=n_embd, hidden=args.hidden, layers=args.layers or 1, seed=args.seed
        )
    else:
        out = build_vision_mmproj(
            args.out,
            n_embd_text=n_embd,
            image_size=args.image_size,
            patch_size=args.patch_size,
            hidden=args.hidden,
            layers=args.layers or 2,
            seed=args.seed,
        )
    print(f"{out} ({out.stat().st_size} bytes, n_embd {n_embd})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

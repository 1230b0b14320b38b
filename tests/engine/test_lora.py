"""LoRA adapters on the bundled model through llama.cpp's adapter API: GGUF adapters, PEFT safetensors converted in
process, the q/k rope row order, and the path rules. Real model, real llama.cpp; adapters are made here with numpy."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from edgellm.engine.config import ModelConfig
from edgellm.engine.lora import gguf_adapter, model_shape, permute_rope_rows
from edgellm.engine.lora_adapters import AdapterCache, apply_adapters, free_adapter, load_adapter
from edgellm.engine.lora_paths import resolve_adapter_path
from edgellm.engine.model import LlamaModel
from edgellm.errors import LoraError

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM = 576, 9, 3, 64  # SmolLM2-135M
OUT = {"q_proj": N_HEAD * HEAD_DIM, "k_proj": N_HEAD_KV * HEAD_DIM, "v_proj": N_HEAD_KV * HEAD_DIM, "o_proj": N_EMBD}
GGUF_NAME = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
LAYERS = (0, 1, 2, 3)
RANK, ALPHA = 8, 16.0
N_GEN = 12


# -- adapters, made with numpy --------------------------------------------------------------------------


def random_lora(seed: int, modules: tuple[str, ...], *, zero_b: bool = False) -> dict[tuple[int, str], tuple]:
    """(layer, module) -> (lora_A [r, in], lora_B [out, r]) in HF layout."""
    rng = np.random.default_rng(seed)
    weights = {}
    for layer in LAYERS:
        for m in modules:
            a = rng.normal(0, 0.3, (RANK, N_EMBD)).astype(np.float32)
            b = rng.normal(0, 0.3, (OUT[m], RANK)).astype(np.float32)
            weights[(layer, m)] = (a, np.zeros_like(b) if zero_b else b)
    return weights


def write_peft(folder: Path, weights: dict, **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (layer, m), (a, b) in weights.items():
        prefix = f"base_model.model.model.layers.{layer}.self_attn.{m}"
        tensors[f"{prefix}.lora_A.weight"] = a
        tensors[f"{prefix}.lora_B.weight"] = b
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": sorted({m for _, m in weights}),
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
        "modules_to_save": None,
        **config,
    }
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder / "adapter_model.safetensors"


def write_gguf(path: Path, weights: dict, *, arch: str = "llama", alpha: float = ALPHA, general_type="adapter") -> Path:
    """A GGUF LoRA adapter written directly: the arrays go in as they are (no rope reordering)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_string("general.type", general_type)
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for (layer, m), (a, b) in sorted(weights.items()):
        writer.add_tensor(f"blk.{layer}.{GGUF_NAME[m]}.weight.lora_a", a)
        writer.add_tensor(f"blk.{layer}.{GGUF_NAME[m]}.weight.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_rows_from_llama(rows: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of llama.cpp's q/k row order, written independently: llama row 2i is HF row i, 2i+1 is i + d/2."""
    d = rows.shape[0] // n_head
    heads = rows.reshape(n_head, d, *rows.shape[1:])
    return np.concatenate([heads[:, 0::2], heads[:, 1::2]], axis=1).reshape(rows.shape)


def read_gguf_tensors(path: Path) -> dict[str, np.ndarray]:
    reader = gguf.GGUFReader(path)
    return {t.name: np.array(t.data).reshape([int(d) for d in reversed(t.shape.tolist())]) for t in reader.tensors}


# -- the model ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(model_path):
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    m = LlamaModel(ModelConfig(model_path, n_ctx=512, n_slots=1, n_threads=2))
    yield m
    m.close()


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:
    return model.chat_tokens([{"role": "user", "content": "What is the capital of France?"}])


def greedy(model, prompt: list[int], n: int = N_GEN) -> list[int]:
    model.trim_sequence(0, 0)
    k = len(prompt)
    logits = model.decode(prompt, list(range(k)), [0] * k, [False] * (k - 1) + [True])
    out: list[int] = []
    for pos in range(k, k + n):
        token = int(np.argmax(logits[-1]))
        out.append(token)
        logits = model.decode([token], [pos], [0], [True])
    model.trim_sequence(0, 0)
    return out


@pytest.fixture(scope="module")
def base_tokens(model, prompt) -> list[int]:
    return greedy(model, prompt)


def run_with(model, prompt, gguf_path: Path, scale: float = 1.0) -> list[int]:
    handle = load_adapter(model, gguf_path)
    try:
        apply_adapters(model, [(handle, scale)])
        return greedy(model, prompt)
    finally:
        apply_adapters(model, [])
        free_adapter(handle)


# -- GGUF adapters -------------------------------------------------------------------------------------


def test_gguf_adapter_changes_output_and_clearing_restores_it(model, model_path, prompt, base_tokens, tmp_path):
    path = write_gguf(tmp_path / "a.gguf", random_lora(1, ("q_proj", "k_proj", "v_proj", "o_proj")))
    assert gguf_adapter(path, model_path, tmp_path / "cache") == path  # checked, used as is
    handle = load_adapter(model, path)
    try:
        apply_adapters(model, [(handle, 1.0)])
        with_adapter = greedy(model, prompt)
        assert with_adapter != base_tokens
        assert greedy(model, prompt) == with_adapter  # deterministic
        apply_adapters(model, [])
        assert greedy(model, prompt) == base_tokens  # cleared: exactly the base output
        apply_adapters(model, [(handle, 0.0)])
        assert greedy(model, prompt) == base_tokens  # scale 0
    finally:
        apply_adapters(model, [])
        free_adapter(handle)
    assert greedy(model, prompt) == base_tokens


def test_zero_adapter_leaves_output_unchanged(model, prompt, base_tokens, tmp_path):
    path = write_gguf(tmp_path / "zero.gguf", random_lora(2, ("q_proj", "k_proj", "v_proj", "o_proj"), zero_b=True))
    assert run_with(model, prompt, path) == base_tokens


def test_adapter_cache_loads_once_and_switches(model, prompt, base_tokens, tmp_path):
    a = write_gguf(tmp_path / "a.gguf", random_lora(1, ("v_proj", "o_proj")))
    b = write_gguf(tmp_path / "b.gguf", random_lora(3, ("v_proj", "o_proj")))
    cache = AdapterCache()
    try:
        cache.activate(model, a, 1.0)
        out_a = greedy(model, prompt)
        handle_a = cache.load(model, a)
        cache.activate(model, b, 1.0)
        out_b = greedy(model, prompt)
        assert out_a != base_tokens and out_b != base_tokens and out_a != out_b
        cache.activate(model, None)
        assert cache.active is None
        assert greedy(model, prompt) == base_tokens
        cache.activate(model, a, 1.0)
        assert cache.load(model, a) is handle_a  # loaded once
        assert cache.loaded == [os.fspath(a), os.fspath(b)]
        assert cache.active == (os.fspath(a), 1.0)
        assert greedy(model, prompt) == out_a
    finally:
        cache.close()
    assert cache.loaded == [] and cache.active is None
    assert greedy(model, prompt) == base_tokens  # close() cleared the context


# -- PEFT safetensors ---------------------------------------------------------------------------------------


def test_peft_adapter_is_converted_and_cached(model, model_path, prompt, base_tokens, tmp_path):
    st = write_peft(tmp_path / "french", random_lora(4, ("q_proj", "k_proj", "v_proj", "o_proj")))
    cache_dir = tmp_path / "cache"
    out = gguf_adapter(st, model_path, cache_dir)
    assert out.parent == cache_dir and out.suffix == ".gguf" and len(out.stem) == 64
    assert [p.name for p in cache_dir.iterdir()] == [out.name]  # no temp file left behind
    before = out.stat()
    assert gguf_adapter(st, model_path, cache_dir) == out
    after = out.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # reused, not rewritten
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["adapter.type"].contents() == "lora"
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["adapter.lora.alpha"].contents() == ALPHA
    assert run_with(model, prompt, out) not in (base_tokens,)
    # Another config is another adapter: another cache file.
    (st.parent / "adapter_config.json").write_text(
        json.dumps({**json.loads((st.parent / "adapter_config.json").read_text()), "lora_alpha": 8})
    )
    assert gguf_adapter(st, model_path, cache_dir) != out


def test_peft_v_o_matches_direct_gguf(model, model_path, prompt, base_tokens, tmp_path):
    weights = random_lora(5, ("v_proj", "o_proj"))
    direct = run_with(model, prompt, write_gguf(tmp_path / "direct.gguf", weights))
    converted = run_with(model, prompt, gguf_adapter(write_peft(tmp_path / "peft", weights), model_path, tmp_path))
    assert direct != base_tokens
    assert converted == direct


def test_peft_q_k_rows_are_reordered_for_llama_rope(model, model_path, prompt, base_tokens, tmp_path):
    x = random_lora(6, ("q_proj", "k_proj"))
    heads = {"q_proj": N_HEAD, "k_proj": N_HEAD_KV}
    hf = {key: (a, hf_rows_from_llama(b, heads[key[1]])) for key, (a, b) in x.items()}
    direct = run_with(model, prompt, write_gguf(tmp_path / "x.gguf", x))
    converted_path = gguf_adapter(write_peft(tmp_path / "hf", hf), model_path, tmp_path / "cache")
    converted = run_with(model, prompt, converted_path)
    assert direct != base_tokens
    assert converted == direct
    stored = read_gguf_tensors(converted_path)
    np.testing.assert_array_equal(stored["blk.0.attn_q.weight.lora_b"], x[(0, "q_proj")][1])
    np.testing.assert_array_equal(stored["blk.3.attn_k.weight.lora_b"], x[(3, "k_proj")][1])
    np.testing.assert_array_equal(stored["blk.0.attn_q.weight.lora_a"], x[(0, "q_proj")][0])
    # The reordering matters for this adapter: X taken as HF rows gives other tokens.
    unreordered = gguf_adapter(write_peft(tmp_path / "raw", x), model_path, tmp_path / "cache")
    assert run_with(model, prompt, unreordered) != direct


def test_permute_rope_rows_maps_hf_rotate_half_to_llama_pairs():
    """Rope on HF rows (rotate i with i + d/2), then reordered == llama.cpp rope (rotate 2i with 2i+1) on reordered
    rows: the reordering is what makes HF q/k weights (and lora_B) fit llama.cpp's rope."""
    n_head, d, pos, base = 3, 8, 7, 10000.0
    rng = np.random.default_rng(0)
    q = rng.normal(size=n_head * d)
    theta = pos * base ** (-np.arange(d // 2) * 2 / d)
    cos, sin = np.cos(theta), np.sin(theta)

    def hf_rope(v):
        h = v.reshape(n_head, d)
        x1, x2 = h[:, : d // 2], h[:, d // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1).reshape(-1)

    def llama_rope(v):
        h = v.reshape(n_head, d // 2, 2)
        x0, x1 = h[..., 0], h[..., 1]
        return np.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(-1)

    np.testing.assert_allclose(permute_rope_rows(hf_rope(q), n_head), llama_rope(permute_rope_rows(q, n_head)))
    np.testing.assert_array_equal(hf_rows_from_llama(permute_rope_rows(q, n_head), n_head), q)


def test_rslora_and_alpha_pattern_fold_into_lora_b(model_path, tmp_path):
    weights = random_lora(7, ("v_proj", "o_proj"))
    st = write_peft(tmp_path / "rs", weights, use_rslora=True, alpha_pattern={"o_proj": 4.0})
    stored = read_gguf_tensors(gguf_adapter(st, model_path, tmp_path / "cache"))
    # llama.cpp scales by alpha / r; PEFT by alpha_m / sqrt(r): lora_B carries alpha_m / alpha * sqrt(r).
    np.testing.assert_allclose(stored["blk.1.attn_v.weight.lora_b"], weights[(1, "v_proj")][1] * np.sqrt(RANK))
    np.testing.assert_allclose(
        stored["blk.1.attn_output.weight.lora_b"], weights[(1, "o_proj")][1] * (4.0 / ALPHA) * np.sqrt(RANK), rtol=1e-6
    )
    np.testing.assert_array_equal(stored["blk.1.attn_v.weight.lora_a"], weights[(1, "v_proj")][0])


def test_bf16_safetensors_are_read(model_path, tmp_path):
    """PEFT often saves bfloat16, which numpy (and safetensors.numpy) cannot hold: the converter widens it itself."""
    weights = random_lora(8, ("v_proj",))
    st = write_peft(tmp_path / "bf16", weights)
    a = np.tile(np.array([1.0, -2.5, 0.15625, 3.0e-3], dtype=np.float32), (RANK, N_EMBD // 4))
    a = (a.view(np.uint32) & 0xFFFF0000).view(np.float32)  # values bfloat16 holds exactly
    tensors = {}
    for (layer, m), (la, lb) in weights.items():
        prefix = f"base_model.model.model.layers.{layer}.self_attn.{m}"
        tensors[f"{prefix}.lora_A.weight"] = ("F32", la.tobytes(), la.shape)
        tensors[f"{prefix}.lora_B.weight"] = ("F32", lb.tobytes(), lb.shape)
    bf16 = (a.view(np.uint32) >> 16).astype("<u2").tobytes()
    tensors["base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"] = ("BF16", bf16, a.shape)
    header, offset = {}, 0
    for name, (dtype, raw, shape) in tensors.items():  # the safetensors layout, written by hand
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    head = json.dumps(header).encode()
    st.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(raw for _, raw, _ in tensors.values()))
    stored = read_gguf_tensors(gguf_adapter(st, model_path, tmp_path / "cache"))
    np.testing.assert_array_equal(stored["blk.0.attn_v.weight.lora_a"], a)
    np.testing.assert_array_equal(stored["blk.1.attn_v.weight.lora_a"], weights[(1, "v_proj")][0])


# -- refusals ------------------------------------------------------------------------------------------------


def refused(fragment: str, fn, *args, **kwargs) -> LoraError:
    with pytest.raises(LoraError) as info:
        fn(*args, **kwargs)
    assert fragment in str(info.value), str(info.value)
    assert info.value.error_type == "lora" and info.value.http_status == 400
    return info.value


def test_path_rules(tmp_path):
    allowed = tmp_path / "adapters"
    outside = tmp_path / "elsewhere"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "a.gguf").write_bytes(b"x")
    (outside / "secret.gguf").write_bytes(b"x")
    (allowed / "link.gguf").symlink_to(outside / "secret.gguf")
    (allowed / "notes").mkdir()

    assert resolve_adapter_path("a.gguf", [allowed], base_dir=allowed) == allowed / "a.gguf"
    assert resolve_adapter_path(str(allowed / "a.gguf"), [str(allowed)]) == allowed / "a.gguf"
    assert resolve_adapter_path("adapters/./a.gguf", [allowed], base_dir=tmp_path) == allowed / "a.gguf"

    e = refused(
        "is outside the allowed adapter directories", resolve_adapter_path, str(outside / "secret.gguf"), [allowed]
    )
    assert str(outside / "secret.gguf") in str(e) and str(allowed) in str(e)
    e = refused(
        f"resolves to {outside / 'secret.gguf'}) is outside the",
        resolve_adapter_path,
        "link.gguf",
        [allowed],
        base_dir=allowed,
    )
    assert str(allowed) in str(e)
    refused(
        "'../elsewhere/secret.gguf' (resolves to",
        resolve_adapter_path,
        "../elsewhere/secret.gguf",
        [allowed],
        base_dir=allowed,
    )
    refused("none configured", resolve_adapter_path, "a.gguf", [], base_dir=allowed)
    refused(
        "LoRA adapter 'missing.gguf' (resolves to", resolve_adapter_path, "missing.gguf", [allowed], base_dir=allowed
    )
    refused("not found", resolve_adapter_path, "missing.gguf", [allowed], base_dir=allowed)
    refused(
        "is a directory without a PEFT adapter (adapter_model.safetensors + adapter_config.json)",
        resolve_adapter_path,
        "notes",
        [allowed],
        base_dir=allowed,
    )
    refused("LoRA adapter path is empty", resolve_adapter_path, " ", [allowed])
    # An allowed directory given through a symlink is compared by its real path too.
    (tmp_path / "adapters-link").symlink_to(allowed)
    assert resolve_adapter_path("a.gguf", [tmp_path / "adapters-link"], base_dir=allowed) == allowed / "a.gguf"


def test_peft_directory_means_its_adapter(tmp_path):
    allowed = tmp_path / "adapters"
    st = write_peft(allowed / "french", random_lora(9, ("v_proj",)))
    assert resolve_adapter_path("french", [allowed], base_dir=allowed) == st
    # A PEFT folder whose files link outside is refused too.
    outside = write_peft(tmp_path / "out", random_lora(9, ("v_proj",)))
    linked = allowed / "linked"
    linked.mkdir()
    (linked / "adapter_model.safetensors").symlink_to(outside)
    (linked / "adapter_config.json").write_text("{}")
    refused("adapter_model.safetensors resolves to", resolve_adapter_path, "linked", [allowed], base_dir=allowed)
    (linked / "adapter_model.safetensors").unlink()
    (linked / "adapter_model.safetensors").write_bytes(b"x")
    (linked / "adapter_config.json").unlink()
    (linked / "adapter_config.json").symlink_to(outside.parent / "adapter_config.json")
    refused("its adapter_config.json resolves to", resolve_adapter_path, "linked", [allowed], base_dir=allowed)


def test_wrong_files_refused(model_path, tmp_path):
    cache = tmp_path / "cache"
    (tmp_path / "a.bin").write_bytes(b"\0" * 16)
    refused("is neither a GGUF adapter (.gguf) nor PEFT weights", gguf_adapter, tmp_path / "a.bin", model_path, cache)
    (tmp_path / "text.gguf").write_text("not gguf")
    refused("is not a readable GGUF file", gguf_adapter, tmp_path / "text.gguf", model_path, cache)
    refused(
        "is not a LoRA adapter: its general.type is 'model', expected 'adapter'",
        gguf_adapter,
        Path(model_path),
        model_path,
        cache,
    )
    weights = random_lora(10, ("v_proj",))
    refused(
        "is for the 'qwen2' architecture but the model is 'llama'",
        gguf_adapter,
        write_gguf(tmp_path / "qwen.gguf", weights, arch="qwen2"),
        model_path,
        cache,
    )
    lone = tmp_path / "lone" / "adapter_model.safetensors"
    lone.parent.mkdir()
    save_file({"x": np.zeros(2, np.float32)}, str(lone))
    refused("adapter_config.json not found next to the safetensors", gguf_adapter, lone, model_path, cache)
    (lone.parent / "adapter_config.json").write_text("{")
    refused("is not valid JSON", gguf_adapter, lone, model_path, cache)
    garbage = write_peft(tmp_path / "garbage", weights)
    garbage.write_bytes(b"\xff" * 64)
    refused("is not a valid safetensors file", gguf_adapter, garbage, model_path, cache)
    assert not cache.exists() or not list(cache.iterdir())


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"use_dora": True}, "DoRA adapters (use_dora: true) are not supported by llama.cpp"),
        ({"peft_type": "LOHA"}, "only LoRA adapters are supported (peft_type is 'LOHA')"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head'] are fully trained modules"),
        ({"lora_bias": True}, "LoRA biases (lora_bias: true) are not supported"),
        ({"lora_alpha": 0}, "lora_alpha must be a positive number, got 0"),
        ({"r": 4}, "has rank 8 but adapter_config.json says r=4"),
        ({"rank_pattern": {"v_proj": 16}}, "has rank 8 but adapter_config.json says r=16"),
        ({"alpha_pattern": {"(": 2}}, "pattern '(' is not a valid regular expression"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out (Conv1D) layouts are not supported"),
    ],
)
def test_peft_configs_refused(model_path, tmp_path, config, fragment):
    st = write_peft(tmp_path / "p", random_lora(11, ("v_proj",)), **config)
    refused(fragment, gguf_adapter, st, model_path, tmp_path / "cache")


def test_peft_tensors_refused(model_path, tmp_path):
    cache = tmp_path / "cache"
    a, b = np.zeros((RANK, N_EMBD), np.float32), np.zeros((OUT["v_proj"], RANK), np.float32)

    def peft(name: str, tensors: dict) -> Path:
        st = write_peft(tmp_path / name, {})
        save_file(tensors, str(st))
        return st

    v = "base_model.model.model.layers.0.self_attn.v_proj"
    refused(
        f"shape mismatch for model.layers.0.self_attn.v_proj: lora_A [{RANK}, 512] and lora_B [192, {RANK}] "
        f"do not fit the model's blk.0.attn_v.weight [192, {N_EMBD}]",
        gguf_adapter,
        peft("shape", {f"{v}.lora_A.weight": np.zeros((RANK, 512), np.float32), f"{v}.lora_B.weight": b}),
        model_path,
        cache,
    )
    refused(
        "unknown tensor name 'base_model.model.model.layers.0.self_attn.v_proj.weight'",
        gguf_adapter,
        peft("unknown", {f"{v}.weight": b}),
        model_path,
        cache,
    )
    refused(
        "DoRA is not supported",
        gguf_adapter,
        peft(
            "dora",
            {f"{v}.lora_A.weight": a, f"{v}.lora_B.weight": b, f"{v}.lora_magnitude_vector": np.ones(192, np.float32)},
        ),
        model_path,
        cache,
    )
    refused(
        "embedding LoRA, which cannot be converted",
        gguf_adapter,
        peft("emb", {"base_model.model.model.embed_tokens.lora_embedding_A": a}),
        model_path,
        cache,
    )
    refused(
        "LoRA on lm_head (embeddings / lm_head) is not supported",
        gguf_adapter,
        peft(
            "head",
            {
                "base_model.model.lm_head.lora_A.weight": a,
                "base_model.model.lm_head.lora_B.weight": np.zeros((49152, RANK), np.float32),
            },
        ),
        model_path,
        cache,
    )
    refused(
        "cannot map module 'model.layers.30.self_attn.v_proj' to a tensor of the 'llama' model",
        gguf_adapter,
        peft(
            "layer",
            {
                "base_model.model.model.layers.30.self_attn.v_proj.lora_A.weight": a,
                "base_model.model.model.layers.30.self_attn.v_proj.lora_B.weight": b,
            },
        ),
        model_path,
        cache,
    )
    refused(
        "module model.layers.0.self_attn.v_proj has no lora_B tensor",
        gguf_adapter,
        peft("half", {f"{v}.lora_A.weight": a}),
        model_path,
        cache,
    )
    refused("holds no LoRA tensors", gguf_adapter, peft("empty", {}), model_path, cache)


def test_gguf_adapter_tensors_checked(model_path, tmp_path):
    bad = {(0, "v_proj"): (np.zeros((RANK, N_EMBD), np.float32), np.zeros((OUT["q_proj"], RANK), np.float32))}
    refused(
        f"shape mismatch for blk.0.attn_v.weight: lora_a [{RANK}, {N_EMBD}] and lora_b [576, {RANK}]",
        gguf_adapter,
        write_gguf(tmp_path / "bad.gguf", bad),
        model_path,
        tmp_path,
    )
    beyond = {(30, "v_proj"): random_lora(13, ("v_proj",))[(0, "v_proj")]}
    refused(
        "tensor blk.30.attn_v.weight does not exist in the model",
        gguf_adapter,
        write_gguf(tmp_path / "beyond.gguf", beyond),
        model_path,
        tmp_path,
    )


def test_model_shape_reads_the_bundled_model(model_path):
    shape = model_shape(model_path)
    assert (shape.arch, shape.n_block, shape.n_embd) == ("llama", 30, N_EMBD)
    assert set(shape.head_count) == {N_HEAD} and set(shape.head_count_kv) == {N_HEAD_KV}
    assert shape.shapes["blk.0.attn_k.weight"] == (N_HEAD_KV * HEAD_DIM, N_EMBD)


def test_lora_module_does_not_import_llama_cpp(model_path, tmp_path):
    """The API process resolves and converts adapters; only the engine process may load llama_cpp."""
    st = write_peft(tmp_path / "p", random_lora(12, ("v_proj",)))
    code = (
        "import sys; from pathlib import Path; from edgellm.engine import lora, lora_paths; "
        f"p = lora_paths.resolve_adapter_path('p', [{str(tmp_path)!r}], base_dir=Path({str(tmp_path)!r})); "
        f"lora.gguf_adapter(p, {model_path!r}, Path({str(tmp_path / 'cache')!r})); "
        "print('llama_cpp' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert str(st) and len(list((tmp_path / "cache").iterdir())) == 1


def test_odd_peft_adapters_refused(model_path, tmp_path):
    shape = model_shape(model_path)
    good = random_lora(5, ("v_proj",))
    cases = [
        ({"use_rslora": "false"}, good, "use_rslora must be true or false"),
        ({"rank_pattern": {"v_proj": "8"}}, good, "rank_pattern['v_proj'] must be a positive integer"),
    ]
    for i, (config, weights, fragment) in enumerate(cases):
        path = write_peft(tmp_path / f"c{i}", weights, **config)
        refused(fragment, gguf_adapter, path, model_path, tmp_path / "cache")
    nan = {k: (a, b * np.nan) for k, (a, b) in good.items()}
    refused("NaN or infinite", gguf_adapter, write_peft(tmp_path / "nan", nan), model_path, tmp_path / "cache")
    assert shape.arch == "llama"

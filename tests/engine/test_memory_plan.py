"""Memory planning from the GGUF header (engine/memory_plan.py). Nothing here loads a model into llama.cpp:
shapes come from headers or are written out by hand."""

from __future__ import annotations

import json
import os

import pytest
from gguf import GGUFWriter

from edgellm.engine.gguf_header import array_length, read_metadata
from edgellm.engine.memory_budget import default_budget_bytes, parse_size
from edgellm.engine.memory_costs import GIB, MIB, compute_bytes, kv_bytes_per_token, kv_cells
from edgellm.engine.memory_plan import format_plan, main, plan_memory
from edgellm.engine.shape import ModelShape
from edgellm.runtime.model_sizing import bundled_model_path

# Qwen2.5-1.5B-Instruct as a Q4_K_M GGUF: 28 layers, 12 heads (2 KV), hidden 1536, head dim 128, FFN 8960.
QWEN_1_5B = ModelShape(
    n_layer=28,
    n_head=12,
    n_head_kv=2,
    n_embd=1536,
    head_dim_k=128,
    head_dim_v=128,
    n_ctx_train=32768,
    n_vocab=151936,
    file_bytes=1_117_320_480,
    n_ff=8960,
)


@pytest.fixture(scope="module")
def smol(model_path) -> ModelShape:
    return ModelShape.from_gguf(model_path)


def write_meminfo(tmp_path, available_kb: int | None) -> str:
    lines = ["MemTotal:        7620000 kB", "MemFree:          512000 kB"]
    if available_kb is not None:
        lines.append(f"MemAvailable:    {available_kb} kB")
    lines.append("Buffers:           40000 kB")
    path = tmp_path / "meminfo"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def write_gguf(path, arch: str = "llama", **extra) -> str:
    """A header-only GGUF (no tensors) with a small llama-like shape; extra keys override or add."""
    values: dict[str, object] = {
        f"{arch}.block_count": 4,
        f"{arch}.context_length": 2048,
        f"{arch}.embedding_length": 256,
        f"{arch}.attention.head_count": 8,
        f"{arch}.attention.head_count_kv": 2,
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(1000)],
    }
    values.update(extra)
    w = GGUFWriter(str(path), arch)
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return str(path)


# -- the model's shape -------------------------------------------------------------------------------------
def test_bundled_model_shape_from_header(smol, model_path):
    # SmolLM2-135M: 30 layers, 9 heads of 64 over n_embd 576, 3 KV heads, 8k training context, 49152 tokens.
    assert (smol.n_layer, smol.n_head, smol.n_head_kv, smol.n_embd) == (30, 9, 3, 576)
    assert (smol.head_dim_k, smol.head_dim_v) == (64, 64)
    assert smol.n_ctx_train == 8192
    assert smol.n_vocab == 49152
    assert smol.n_ff == 1536
    assert smol.file_bytes == os.path.getsize(model_path)
    # The header helpers agree: the tokenizer array has one entry per token; scalars are not arrays.
    assert array_length(model_path, "tokenizer.ggml.tokens") == 49152
    assert array_length(model_path, "llama.block_count") is None
    assert array_length(model_path, "no.such.key") is None
    assert read_metadata(model_path, ["llama.vocab_size", "general.architecture"]) == {
        "llama.vocab_size": 49152,
        "general.architecture": "llama",
    }


def test_vocab_from_the_token_array_and_per_layer_kv_heads(tmp_path):
    # No {arch}.vocab_size (Qwen2 GGUFs have none): the tokenizer array's length is the vocabulary. A
    # per-layer head_count_kv array falls back to head_count, the most any layer can have.
    path = write_gguf(tmp_path / "m.gguf", **{"llama.attention.head_count_kv": [2, 4, 8, 2]})
    shape = ModelShape.from_gguf(path)
    assert shape.n_vocab == 1000
    assert shape.n_head_kv == 8
    assert shape.head_dim_k == shape.head_dim_v == 32  # embedding_length / head_count without key_length
    assert shape.n_ff == 0


def test_explicit_key_and_value_lengths(tmp_path):
    path = write_gguf(
        tmp_path / "m.gguf",
        arch="gemma",
        **{"gemma.attention.key_length": 128, "gemma.attention.value_length": 96, "gemma.vocab_size": 4096},
    )
    shape = ModelShape.from_gguf(path)
    assert (shape.head_dim_k, shape.head_dim_v, shape.n_vocab) == (128, 96, 4096)


def test_missing_keys_are_clear_errors(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", **{"llama.context_length": None})
    with pytest.raises(ValueError, match="llama.context_length"):
        ModelShape.from_gguf(path)
    path = write_gguf(tmp_path / "v.gguf", **{"tokenizer.ggml.tokens": None})
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens"):
        ModelShape.from_gguf(path)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"nope" * 8)
    with pytest.raises(ValueError, match="not a GGUF"):
        ModelShape.from_gguf(not_gguf)


# -- KV cache and compute buffers ----------------------------------------------------------------------------
def test_kv_bytes_per_token(smol):
    # 30 layers x 3 KV heads x (64 + 64) elements = 11520 per token.
    assert kv_bytes_per_token(smol, "f16") == 23040
    assert kv_bytes_per_token(smol, "f32") == 46080
    assert kv_bytes_per_token(smol, "q8_0") == 12240  # 11520 / 32 blocks x 34 bytes
    # Qwen2.5-1.5B: 28 x 2 x 256 = 14336 elements.
    assert kv_bytes_per_token(QWEN_1_5B, "f16") == 28672
    with pytest.raises(ValueError, match="kv_type"):
        kv_bytes_per_token(smol, "q4_0")


def test_kv_cells_follow_llama_cpp_padding():
    # One unified pool (the engine's): llama.cpp pads n_ctx to a multiple of 256, whatever n_seq_max is.
    assert kv_cells(8192) == 8192
    assert kv_cells(999) == 1024
    assert kv_cells(3000) == 3072
    assert kv_cells(16384) == 16384


@pytest.mark.parametrize(
    ("shape_name", "n_ctx", "n_slots", "flash_attn", "measured_mib"),
    [
        # CPU "compute buffer size" printed by llama.cpp 0.3.36 (llama-cpp-python), n_batch = n_ubatch = 512;
        # smol measured with the engine's unified pool, qwen (1 slot: the same either way; 4: split streams).
        ("smol", 8192, 4, True, 98.25),
        ("smol", 8192, 1, False, 166.38),
        ("smol", 16384, 1, False, 326.38),
        ("qwen", 16384, 4, True, 302.75),  # a zero-weight GGUF with Qwen2.5-1.5B's tensor shapes
        ("qwen", 16384, 1, False, 432.01),
    ],
)
def test_compute_estimate_covers_llama_cpp(smol, shape_name, n_ctx, n_slots, flash_attn, measured_mib):
    shape = smol if shape_name == "smol" else QWEN_1_5B
    # What llama.cpp holds at most: its compute buffer plus the logits buffer grown to n_batch rows.
    needed = measured_mib * MIB + shape.n_vocab * 4 * 512
    estimate = compute_bytes(shape, 512, n_slots, n_ctx, flash_attn=flash_attn)
    assert needed <= estimate <= 1.3 * needed


# -- planning ----------------------------------------------------------------------------------------------
def test_auto_plan_for_the_bundled_model_under_6_gib(smol):
    plan = plan_memory(smol, budget_bytes=6 * GIB)
    assert plan.fits and plan.refusal() is None
    assert plan.n_slots == 4
    assert plan.n_ctx == 4 * 4096  # capped at max_slot_ctx per slot
    assert plan.kv_cells == plan.n_ctx
    assert plan.kv_bytes == 16384 * 23040
    assert plan.weights_bytes == smol.file_bytes
    assert plan.total_bytes == plan.weights_bytes + plan.kv_bytes + plan.compute_bytes + plan.overhead_bytes
    # With a larger per-slot cap, the training context (8192) is the cap.
    wide = plan_memory(smol, budget_bytes=6 * GIB, max_slot_ctx=65536)
    assert wide.n_ctx == 4 * 8192 and wide.fits


def test_auto_n_ctx_is_the_largest_that_fits(smol):
    # A budget that lands between the minimum and the cap.
    floor = plan_memory(smol, budget_bytes=GIB, n_ctx=4 * 512, n_slots=4)
    budget = floor.total_bytes + 3000 * 23040  # room for ~3000 more tokens
    plan = plan_memory(smol, budget_bytes=budget, n_slots=4)
    assert plan.fits and plan.auto_ctx
    assert plan.n_ctx % 256 == 0 and plan.seq_ctx == min(plan.kv_cells, smol.n_ctx_train)  # the whole pool
    assert 4 * 512 < plan.n_ctx < 4 * 4096
    assert plan.kv_cells == plan.n_ctx  # no padding by llama.cpp beyond what was planned
    one_more = plan_memory(smol, budget_bytes=budget, n_ctx=plan.n_ctx + 4 * 256, n_slots=4)
    assert not one_more.fits


def test_tiny_budget_refuses_with_sizes(smol):
    plan = plan_memory(smol, budget_bytes=50 * MIB)
    assert not plan.fits
    message = plan.refusal()
    assert message is not None
    assert "weights (94 MiB)" in message
    assert "memory_budget is 50 MiB" in message
    assert "smaller model or quant" in message
    assert plan.n_slots == 1  # auto slots went all the way down before giving up
    assert plan.n_ctx == 512  # the minimum it would have needed


def test_budget_too_small_for_the_cache_names_the_cache(smol):
    base = plan_memory(smol, budget_bytes=GIB, n_ctx=8192, n_slots=4).base_bytes
    plan = plan_memory(smol, budget_bytes=base + 10 * MIB, n_ctx=8192, n_slots=4, kv_type="f16")
    assert not plan.fits
    message = plan.refusal()
    assert "a KV pool of n_ctx=8192 cells" in message
    assert "180 MiB of f16 KV cache" in message  # 8192 x 23040 bytes
    assert "kv_cache_type to q8_0" in message


def test_auto_slots_shrink_under_a_tight_budget(smol):
    two = plan_memory(smol, budget_bytes=GIB, n_ctx=2 * 512, n_slots=2)
    # Enough for 2 slots of 512 tokens, not for 3 or 4.
    plan = plan_memory(smol, budget_bytes=two.total_bytes + 1000)
    assert plan.fits
    assert plan.n_slots == 2
    assert plan.n_ctx == 1024


def test_auto_slots_with_an_explicit_context(smol):
    assert plan_memory(smol, budget_bytes=6 * GIB, n_ctx=8192).n_slots == 4
    assert plan_memory(smol, budget_bytes=6 * GIB, n_ctx=1024).n_slots == 2
    assert plan_memory(smol, budget_bytes=6 * GIB, n_ctx=300).n_slots == 1


def test_explicit_values_are_kept(smol):
    plan = plan_memory(smol, budget_bytes=600 * MIB, n_ctx=100_000, n_slots=2, kv_type="q8_0")
    assert (plan.n_ctx, plan.n_slots, plan.kv_type) == (100_000, 2, "q8_0")
    assert not plan.auto_ctx and not plan.fits
    assert "q8_0" in plan.refusal() and "kv_cache_type" not in plan.refusal()
    with pytest.raises(ValueError, match="n_ctx"):
        plan_memory(smol, budget_bytes=GIB, n_ctx=0)
    with pytest.raises(ValueError, match="n_slots"):
        plan_memory(smol, budget_bytes=GIB, n_slots="many")  # type: ignore[arg-type]


def test_q8_0_cache_gives_more_context(smol):
    budget = plan_memory(smol, budget_bytes=GIB, n_ctx=4 * 1024, n_slots=4).total_bytes
    f16 = plan_memory(smol, budget_bytes=budget, n_slots=4, kv_type="f16")
    q8 = plan_memory(smol, budget_bytes=budget, n_slots=4, kv_type="q8_0")
    assert f16.n_ctx == 4 * 1024
    assert q8.n_ctx > f16.n_ctx and q8.fits


def test_to_dict_for_status(smol):
    plan = plan_memory(smol, budget_bytes=6 * GIB)
    d = plan.to_dict()
    json.dumps(d)
    assert d["budget_mib"] == 6144.0
    assert d["weights_bytes"] == smol.file_bytes
    assert d["weights_mib"] == round(smol.file_bytes / MIB, 1)
    assert d["total_bytes"] == plan.total_bytes
    assert (d["n_ctx"], d["n_slots"], d["kv_type"], d["fits"]) == (16384, 4, "f16", True)


def test_qwen_1_5b_on_an_8_gb_orin_nano(tmp_path):
    # An 8 GB Orin Nano shows ~7.2 GiB MemAvailable after boot; the node plans with 75 % of it.
    budget = default_budget_bytes(write_meminfo(tmp_path, int(7.2 * 1024 * 1024)))
    assert abs(budget - 0.75 * 7.2 * GIB) < 1024
    plan = plan_memory(QWEN_1_5B, budget_bytes=budget)
    print()
    print(format_plan(plan, QWEN_1_5B))
    print(json.dumps(plan.to_dict()))
    assert plan.fits
    assert (plan.n_slots, plan.n_ctx) == (4, 16384)
    assert plan.kv_bytes == 448 * MIB  # 16384 cells x 28672 bytes, as llama.cpp prints for this shape
    q8 = plan_memory(QWEN_1_5B, budget_bytes=budget, kv_type="q8_0")
    assert q8.kv_bytes == 238 * MIB
    assert plan.total_bytes < budget / 2  # room to spare: a 3B or 4B model would fit as well


# -- settings ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("6GiB", 6 * GIB),
        ("6.5G", int(6.5 * GIB)),
        ("512MiB", 512 * MIB),
        ("1500000000", 1_500_000_000),
        (1_500_000_000, 1_500_000_000),
        ("6GB", 6_000_000_000),
        ("2 gi", 2 * GIB),
        (" 100k ", 102_400),
        ("4096B", 4096),
        ("1TiB", 1024 * GIB),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["", "lots", "6 GiBs", "GiB", "6iB", "1e9", "6..5G", "-1G", "0", "0.0001", 0, -5, True])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        parse_size(bad)


def test_default_budget_from_meminfo(tmp_path):
    path = write_meminfo(tmp_path, 4_000_000)
    assert default_budget_bytes(path) == int(4_000_000 * 1024 * 0.75)
    assert default_budget_bytes(path, share=0.5) == 2_000_000 * 1024
    with pytest.raises(ValueError, match="share"):
        default_budget_bytes(path, share=0)
    with pytest.raises(ValueError, match="MemAvailable"):
        default_budget_bytes(write_meminfo(tmp_path, None))


# -- the command line --------------------------------------------------------------------------------------
def test_main_prints_the_plan(model_path, capsys):
    assert main([model_path, "--budget", "6GiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["n_ctx"] == 16384 and d["budget_mib"] == 6144.0
    assert main([model_path, "--budget", "6GiB", "--kv", "q8_0", "--n-slots", "2"]) == 0
    out = capsys.readouterr().out
    assert "KV cache (q8_0" in out and "fits: yes" in out
    assert "a KV pool of 8192 cells (n_ctx 8192 auto) for 2 slot(s); one request up to 8192" in out
    assert main([model_path, "--budget", "6GiB", "--n-slots", "2", "--no-kv-unified"]) == 0
    out = capsys.readouterr().out
    assert "8192 KV cells (n_ctx 8192 auto), each of 2 slot(s) owning its share; one request up to 4096 tokens" in out


def test_main_refuses_a_plan_that_does_not_fit(model_path, capsys):
    assert main([model_path, "--budget", "64MiB"]) == 1
    err = capsys.readouterr().err
    assert "memory_budget is 64 MiB" in err
    assert main([model_path, "--budget", "plenty"]) == 2
    assert "cannot read 'plenty'" in capsys.readouterr().err


def test_embeddings_are_planned_for():
    from edgellm.engine.memory_costs import embedding_bytes

    shape = ModelShape.from_gguf(bundled_model_path())
    context = embedding_bytes(shape, 512)
    # measured for the bundled model's embedding context at 512 tokens (llama.cpp 0.3.36, CPU): 100 MiB
    # compute buffer, ~96 MiB output buffer, 11 MiB KV
    assert 200 * MIB < context < 260 * MIB
    assert embedding_bytes(shape, 0) == 0
    assert embedding_bytes(shape, 512, shape) == context + shape.file_bytes  # a dedicated model's weights too
    with_embeddings = plan_memory(shape, budget_bytes=4 * GIB, embedding_ctx=512)
    without = plan_memory(shape, budget_bytes=4 * GIB)
    assert with_embeddings.total_bytes - without.total_bytes == context


def test_the_slot_layout_pads_each_slot_and_limits_a_request_to_its_share(smol):
    pool = plan_memory(smol, budget_bytes=6 * GIB, n_ctx=1000, n_slots=3)  # the default
    slots = plan_memory(smol, budget_bytes=6 * GIB, n_ctx=1000, n_slots=3, kv_unified=False)
    assert (pool.kv_cells, pool.seq_ctx) == (1024, 1024)
    assert (slots.kv_cells, slots.seq_ctx) == (1536, 512)  # 333 a slot -> 999 -> 1024 -> 341 -> 512 a slot
    assert slots.kv_bytes > pool.kv_bytes and not slots.to_dict()["kv_unified"]
    assert "each of 3 slot(s) owning its share" in format_plan(slots)

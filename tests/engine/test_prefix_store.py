"""The persistent prefix KV cache (engine/prefix_store.py) on the bundled model: a saved prefix restored
into another sequence of a fresh model instance gives the logits a fresh prefill gives; corrupt, foreign
and mismatching files are refused and removed; LRU eviction by size; disk errors turn the store off."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from types import SimpleNamespace

import numpy as np
import pytest

from edgellm.engine import kv_fingerprint
from edgellm.engine import prefix_store as ps
from edgellm.engine.config import ModelConfig
from edgellm.engine.kv_fingerprint import model_fingerprint
from edgellm.engine.model import LlamaModel
from edgellm.engine.prefix_store import Entry, PrefixStore, token_digest

MIB = 1024 * 1024
SEQ_LONG, SEQ_SHORT = 0, 1  # the module model's sequences holding the 1000- and 300-token prefixes


def config(model_path: str) -> ModelConfig:
    return ModelConfig(path=model_path, n_ctx=4096, n_slots=4)


@pytest.fixture(scope="module")
def model(model_path):
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    m = LlamaModel(config(model_path))
    yield m
    m.close()


def prefill(model: LlamaModel, seq_id: int, tokens: list[int], start: int = 0) -> np.ndarray:
    """Decode tokens[start:] at their positions in `seq_id`; the logits row of the last one."""
    out = None
    for i in range(start, len(tokens), model.n_batch):
        chunk = tokens[i : i + model.n_batch]
        out = model.decode(
            chunk, list(range(i, i + len(chunk))), [seq_id] * len(chunk), [False] * (len(chunk) - 1) + [True]
        )
    return out[-1]


def span(model: LlamaModel, seq_id: int) -> tuple[int, int]:
    import llama_cpp as L

    return L.llama_memory_seq_pos_min(model.memory, seq_id), L.llama_memory_seq_pos_max(model.memory, seq_id)


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:
    text = " ".join(f"rule {i}: answer in the style of entry {i * 7 % 13}." for i in range(160))
    tokens = model.with_bos(model.tokenize(text))
    assert len(tokens) > 1010
    return tokens[:1010]


@pytest.fixture(scope="module")
def long_prefix(model, prompt):
    """Seq 0 holds prompt[:1000], freshly prefilled: (tokens, prefill ms)."""
    model.trim_sequence(SEQ_LONG, 0)
    t = time.perf_counter()
    prefill(model, SEQ_LONG, prompt[:1000])
    return prompt[:1000], 1000 * (time.perf_counter() - t)


@pytest.fixture(scope="module")
def short_prefix(model, prompt) -> list[int]:
    """Seq 1 holds prompt[:300] (tests that trim it leave at least a prefix of it)."""
    model.trim_sequence(SEQ_SHORT, 0)
    prefill(model, SEQ_SHORT, prompt[:300])
    return prompt[:300]


def store_for(model, tmp_path, **kw) -> PrefixStore:
    kw.setdefault("max_bytes", 512 * MIB)
    return PrefixStore(str(tmp_path / "prefix-cache"), model_fingerprint(model), **kw)


def refill_short(model, prompt) -> None:
    """Make seq 1 hold prompt[:300] again after a test trimmed it."""
    _, top = span(model, SEQ_SHORT)
    if top + 1 < 300:
        model.trim_sequence(SEQ_SHORT, top + 1)
        prefill(model, SEQ_SHORT, prompt[:300], start=top + 1)


# -- (1) a restart: save, then restore into another sequence of a fresh model ------------------------
def test_restored_prefix_after_a_restart_gives_the_logits_of_a_fresh_prefill(
    model, model_path, prompt, long_prefix, tmp_path
):
    tokens, prefill_ms = long_prefix
    store = store_for(model, tmp_path)
    t = time.perf_counter()
    assert store.save(model, SEQ_LONG, tokens)
    save_ms = 1000 * (time.perf_counter() - t)
    assert not store.save(model, SEQ_LONG, tokens)  # already stored
    files = os.listdir(store.root)
    assert token_digest(tokens) + ".kv" in files and "index.json" in files
    # The same model decodes prompt[1000] after its own prefill of prompt[:1000] (one batch of 1 token).
    reference = model.decode([prompt[1000]], [1000], [SEQ_LONG], [True])[0]

    fresh = LlamaModel(config(model_path))  # the node after a restart
    try:
        assert model_fingerprint(fresh) == store.fingerprint
        again = PrefixStore(os.path.dirname(store.root), model_fingerprint(fresh), 512 * MIB)
        entry = again.lookup(prompt)
        assert entry is not None and entry.n_tokens == 1000
        assert again.better_than(0, prompt) is entry and again.better_than(990, prompt) is None
        t = time.perf_counter()
        assert again.restore(fresh, 2, entry, prompt) == 1000
        restore_ms = 1000 * (time.perf_counter() - t)
        assert span(fresh, 2) == (0, 999)
        row = fresh.decode([prompt[1000]], [1000], [2], [True])[0]
    finally:
        fresh.close()
    np.testing.assert_allclose(row, reference, rtol=0, atol=1e-5)
    assert int(np.argmax(row)) == int(np.argmax(reference))
    size = entry.size / MIB
    print(
        f"\n1000-token prefix: prefill {prefill_ms:.0f} ms, save {save_ms:.0f} ms, restore {restore_ms:.0f} ms "
        f"(file {size:.1f} MiB), max |logit diff| {np.abs(row - reference).max():.2e}"
    )
    model.trim_sequence(SEQ_LONG, 1000)


# -- (2) corrupt files ------------------------------------------------------------------------------------
# A file cut short with an index made to agree (size, crc32) is not among these: in the engine's unified KV pool
# llama.cpp aborts the process on it (GGML_ASSERT in state_seq_load_file) instead of refusing it; the store
# drops such a file at the next start (test_a_file_whose_load_never_returned_is_dropped_at_the_next_start).
@pytest.mark.parametrize("damage", ["truncate", "flip_kv_bytes", "flip_header", "missing"])
def test_a_corrupt_file_is_removed_and_restores_nothing(model, prompt, short_prefix, tmp_path, damage):
    store = store_for(model, tmp_path)
    assert store.save(model, SEQ_SHORT, short_prefix)
    entry = store.lookup(prompt)
    path = store.path_of(entry)
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip_kv_bytes":  # inside the KV data: only the checksum can tell
        for i in range(len(data) // 2, len(data) // 2 + 64):
            data[i] ^= 0x5A
    elif damage == "flip_header":
        data[0] ^= 0xFF
        data[9] ^= 0xFF
    if damage == "missing":
        os.unlink(path)
    else:
        open(path, "wb").write(bytes(data))
    model.trim_sequence(3, 0)
    prefill(model, 3, prompt[:10])  # whatever the sequence held goes, a failed restore leaves it empty
    assert store.restore(model, 3, entry, prompt) == 0
    assert span(model, 3) == (-1, -1)
    assert not os.path.exists(path) and store.entries == {} and store.lookup(prompt) is None
    assert json.load(open(os.path.join(store.root, "index.json")))["entries"] == []
    assert store.enabled and store.counters["rejected"] == 1


def test_the_index_is_reconciled_with_the_folder_at_start(model, prompt, short_prefix, tmp_path):
    store = store_for(model, tmp_path)
    assert store.save(model, SEQ_SHORT, short_prefix)
    open(os.path.join(store.root, "stray" + ps.SUFFIX), "wb").write(b"x")  # no entry: removed
    open(os.path.join(store.root, ".half.tmp"), "wb").write(b"x")  # a save cut short: removed
    again = store_for(model, tmp_path)
    assert list(again.entries) == list(store.entries)
    assert sorted(os.listdir(again.root)) == sorted(["index.json", token_digest(short_prefix) + ".kv"])
    open(os.path.join(again.root, "index.json"), "w").write("{not json")  # unreadable: empty, files removed
    third = store_for(model, tmp_path)
    assert third.entries == {} and not [n for n in os.listdir(third.root) if n.endswith(".kv")]


def test_a_file_whose_load_never_returned_is_dropped_at_the_next_start(model, short_prefix, tmp_path, monkeypatch):
    store = store_for(model, tmp_path)
    assert store.save(model, SEQ_SHORT, short_prefix)
    entry = store.lookup(short_prefix)
    seen = []
    real_load = model.load_sequence

    def load_and_look(seq_id, path, max_tokens):  # observes the index while llama.cpp would be loading
        seen.append(json.load(open(os.path.join(store.root, ps.INDEX)))["entries"][0]["loading"])
        return real_load(seq_id, path, max_tokens)

    monkeypatch.setattr(model, "load_sequence", load_and_look)
    assert store.restore(model, 3, entry, short_prefix) == len(short_prefix)
    assert seen == [True] and not json.load(open(os.path.join(store.root, ps.INDEX)))["entries"][0]["loading"]
    # As the index is left when the process dies inside llama.cpp's load (an abort on a malformed file):
    index = json.load(open(os.path.join(store.root, ps.INDEX)))
    index["entries"][0]["loading"] = True
    json.dump(index, open(os.path.join(store.root, ps.INDEX), "w"))
    again = store_for(model, tmp_path)
    assert again.entries == {} and not [n for n in os.listdir(again.root) if n.endswith(ps.SUFFIX)]


# -- (3) foreign files --------------------------------------------------------------------------------------
def test_the_fingerprint_covers_what_makes_a_state_file_foreign(model, tmp_path):
    base = kv_fingerprint.fingerprint_parts(model)
    assert base["model"].startswith(f"{os.path.getsize(model.config.path)}-")
    variants = [
        {"seq_ctx": model.seq_ctx // 2},
        {"kv_cache_type": "q8_0"},
        {"flash_attn": not model.config.flash_attn},
        {"n_gpu_layers": 99, "device": "gpu"},
        {"llama_cpp": "0.0.0"},
        {"model": "1-abc"},
    ]
    prints = {kv_fingerprint.fingerprint({**base, **v}) for v in variants}
    assert len(prints) == len(variants) and model_fingerprint(model) not in prints
    # Another model file (a copy with one byte changed in its last MiB) has another identity.
    other = tmp_path / "other.gguf"
    shutil.copyfile(model.config.path, other)
    with open(other, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    assert kv_fingerprint.file_identity(str(other)) != kv_fingerprint.file_identity(model.config.path)
    fake = SimpleNamespace(config=model.config, seq_ctx=model.seq_ctx * 2, offload=model.offload)
    assert model_fingerprint(fake) != model_fingerprint(model)


def test_another_fingerprint_never_reads_the_files(model, prompt, short_prefix, tmp_path):
    store = store_for(model, tmp_path)
    assert store.save(model, SEQ_SHORT, short_prefix)
    other = PrefixStore(str(tmp_path / "prefix-cache"), "0" * 32, 512 * MIB)
    assert other.root != store.root and other.entries == {} and other.lookup(prompt) is None
    assert os.path.exists(store.path_of(store.lookup(prompt)))  # and it leaves them alone


def test_a_state_file_for_other_tokens_is_refused_by_the_token_check(model, prompt, short_prefix, tmp_path):
    store = store_for(model, tmp_path)
    assert store.save(model, SEQ_SHORT, short_prefix)
    real = store.lookup(prompt)
    # The file of prompt[:300] copied under the name (and an index entry) of other tokens: size and
    # checksum are right, the tokens inside are not.
    other_prompt = [*prompt[:150], *reversed(prompt[150:300]), *prompt[300:]]
    key = token_digest(other_prompt[:300])
    shutil.copyfile(store.path_of(real), os.path.join(store.root, key + ps.SUFFIX))
    fake = Entry(key, 300, real.size, real.crc32, time.time())
    store.entries[key] = fake
    assert store.lookup(other_prompt) is fake
    assert store.restore(model, 3, fake, other_prompt) == 0
    assert span(model, 3) == (-1, -1)
    assert key not in store.entries and not os.path.exists(store.path_of(fake))
    assert store.lookup(prompt) is real and os.path.exists(store.path_of(real))  # the genuine one stays


# -- (4) LRU eviction by size ---------------------------------------------------------------------------
def test_least_recently_used_entries_are_evicted_by_size(model, prompt, short_prefix, tmp_path):
    sizes = {}
    probe = store_for(model, tmp_path / "probe", min_tokens=64)
    for n in (300, 230, 160, 90):
        model.trim_sequence(SEQ_SHORT, n)
        assert probe.save(model, SEQ_SHORT, prompt[:n])
        sizes[n] = probe.entries[token_digest(prompt[:n])].size
    refill_short(model, prompt)
    limit = sizes[230] + sizes[160] + sizes[90] // 2  # 230 + 160 fit, 300 + 230 and 230 + 160 + 90 do not
    assert sizes[230] + sizes[160] < limit < sizes[230] + sizes[160] + sizes[90] < sizes[300] + sizes[230]
    store = store_for(model, tmp_path, max_bytes=limit, min_tokens=64)

    def held() -> set[int]:
        return {e.n_tokens for e in store.entries.values()}

    assert store.save(model, SEQ_SHORT, prompt[:300])
    model.trim_sequence(SEQ_SHORT, 230)
    assert store.save(model, SEQ_SHORT, prompt[:230])
    assert held() == {230}  # 300 + 230 is over the limit: the older one went
    model.trim_sequence(SEQ_SHORT, 160)
    assert store.save(model, SEQ_SHORT, prompt[:160])
    assert held() == {230, 160}
    entry = store.entries[token_digest(prompt[:230])]
    assert store.restore(model, 3, entry, prompt) == 230  # 230 is now the most recently used
    model.trim_sequence(SEQ_SHORT, 90)
    assert store.save(model, SEQ_SHORT, prompt[:90])
    assert held() == {230, 90} and store.total_bytes <= limit
    assert sorted(n for n in os.listdir(store.root) if n.endswith(".kv")) == sorted(
        token_digest(prompt[:n]) + ".kv" for n in (230, 90)
    )
    assert store.counters["evictions"] == 2
    # A restart with a smaller budget evicts down to it (230, restored before 90 was saved, goes first).
    smaller = store_for(model, tmp_path, max_bytes=sizes[230] + 1, min_tokens=64)
    assert {e.n_tokens for e in smaller.entries.values()} == {90}
    # A state larger than max_bytes is never written.
    tiny = store_for(model, tmp_path / "tiny", max_bytes=sizes[90] - 1, min_tokens=64)
    assert not tiny.save(model, SEQ_SHORT, prompt[:90]) and tiny.entries == {} and tiny.enabled
    refill_short(model, prompt)


def test_save_skips_short_media_and_covered_prefixes(model, prompt, short_prefix, tmp_path):
    store = store_for(model, tmp_path)
    model.trim_sequence(SEQ_SHORT, 200)
    assert not store.save(model, SEQ_SHORT, prompt[:200])  # under min_tokens (256)
    refill_short(model, prompt)
    assert not store.save(model, SEQ_SHORT, [*prompt[:299], -1])  # a media stand-in
    assert store.save(model, SEQ_SHORT, prompt[:300])
    low = store_for(model, tmp_path / "low", min_tokens=64)
    assert low.save(model, SEQ_SHORT, prompt[:300])
    model.trim_sequence(SEQ_SHORT, 250)
    assert low.save(model, SEQ_SHORT, prompt[:250])  # shorter: not covered by the longer entry
    model.trim_sequence(SEQ_SHORT, 200)
    assert low.save(model, SEQ_SHORT, prompt[:200])
    # prompt[:260] is within min_gain (64) of the stored prompt[:250]: not worth a file.
    prefill(model, SEQ_SHORT, prompt[:260], start=200)
    assert not low.save(model, SEQ_SHORT, prompt[:260])
    refill_short(model, prompt)


# -- (5) lookup ---------------------------------------------------------------------------------------------
def test_lookup_takes_the_longest_stored_prefix_and_ignores_non_prefixes(tmp_path):
    store = PrefixStore(str(tmp_path), "fp", 512 * MIB)
    prompt = list(range(1000, 1600))
    other = list(range(5000, 5600))
    bent = [*prompt[:250], 7, *prompt[251:]]  # differs from prompt at 250

    def add(tokens):
        store.entries[token_digest(tokens)] = Entry(token_digest(tokens), len(tokens), 1, 0, 0.0)

    for tokens in (prompt[:100], prompt[:200], other[:150], bent[:300], other[:500]):
        add(tokens)
    assert store.lookup(prompt).n_tokens == 200
    assert store.lookup(bent).n_tokens == 300
    assert store.lookup(other).n_tokens == 500
    assert store.lookup(prompt[:199]).n_tokens == 100
    assert store.lookup(list(range(9000, 9600))) is None
    assert store.lookup([]) is None
    # Never past a media stand-in (negative ids), even where the hashes would match around it.
    with_media = [*prompt[:150], -1, -1, *prompt[152:]]
    assert store.lookup(with_media).n_tokens == 100
    assert store.lookup([-3, *prompt]) is None
    # better_than: only a gain of min_gain (64) reusable tokens over what the best slot shares.
    assert store.better_than(0, prompt).n_tokens == 200
    assert store.better_than(136, prompt).n_tokens == 200
    assert store.better_than(137, prompt) is None
    assert store.better_than(0, prompt[:201]).n_tokens == 200  # 200 of 201: all but the last token
    assert store.better_than(0, prompt[:150]).n_tokens == 100
    assert store.better_than(40, prompt[:150]) is None  # 100 - 40 < 64
    add(prompt[:50])
    assert store.better_than(0, prompt[:60]) is None  # 50 reusable tokens: under min_gain


# -- (6) disk errors ----------------------------------------------------------------------------------------
def test_a_full_disk_turns_the_store_off(model, prompt, short_prefix, tmp_path, caplog):
    store = store_for(model, tmp_path)
    # The temp file lands on /dev/full: llama.cpp's writes fail with ENOSPC.
    os.symlink("/dev/full", os.path.join(store.root, f".{token_digest(short_prefix)}.tmp"))
    with caplog.at_level(logging.WARNING, logger="edgellm.engine.prefix_store"):
        assert store.save(model, SEQ_SHORT, short_prefix) is False
    assert not store.enabled and "disabled" in caplog.text
    assert store.entries == {} and not [n for n in os.listdir(store.root) if n.endswith((".kv", ".tmp"))]
    assert store.lookup(prompt) is None and store.save(model, SEQ_SHORT, short_prefix) is False


def test_too_little_free_space_turns_the_store_off(model, prompt, short_prefix, tmp_path, monkeypatch):
    store = store_for(model, tmp_path)
    monkeypatch.setattr(ps.os, "statvfs", lambda _p: SimpleNamespace(f_bavail=10, f_frsize=4096))
    assert store.save(model, SEQ_SHORT, short_prefix) is False
    assert not store.enabled and "free space" in store.disabled_reason
    assert store.stats()["enabled"] is False


def test_a_folder_that_cannot_be_made_turns_the_store_off(tmp_path):
    (tmp_path / "state").write_text("a file where the folder should be")
    store = PrefixStore(str(tmp_path / "state" / "prefix-cache"), "fp", 512 * MIB)
    assert not store.enabled and store.lookup([1, 2, 3]) is None


def test_a_read_only_folder_turns_the_store_off(model, prompt, short_prefix, tmp_path):
    store = store_for(model, tmp_path)
    if os.geteuid() != 0:
        os.chmod(store.root, 0o555)
    else:  # root writes through a read-only mode: the folder turns into a file, writes fail the same way
        shutil.rmtree(store.root)
        open(store.root, "w").close()
    try:
        assert store.save(model, SEQ_SHORT, short_prefix) is False
    finally:
        if os.path.isdir(store.root):
            os.chmod(store.root, 0o755)
    assert not store.enabled and store.entries == {}


def test_a_store_that_fails_to_write_its_index_turns_off(model, prompt, short_prefix, tmp_path, monkeypatch):
    store = store_for(model, tmp_path)
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith("index.json"):
            raise OSError(errno.EROFS, "Read-only file system", dst)
        return real_replace(src, dst)

    monkeypatch.setattr(ps.os, "replace", replace)
    store.save(model, SEQ_SHORT, short_prefix)  # the state file lands, its index does not: off, no exception
    assert not store.enabled and "Read-only" in store.disabled_reason
    monkeypatch.undo()
    again = store_for(model, tmp_path)  # the next start drops the file no index names
    assert again.enabled and again.entries == {}
    assert not [n for n in os.listdir(again.root) if n.endswith(".kv")]


def test_for_model_follows_the_config(model, tmp_path):
    assert PrefixStore.for_model(model) is None  # prefix_cache_dir None: off
    on = SimpleNamespace(**vars(model))
    on.config = ModelConfig(
        path=model.config.path, n_ctx=4096, n_slots=4, prefix_cache_dir=str(tmp_path), prefix_cache_bytes=MIB
    )
    store = PrefixStore.for_model(on)
    assert store is not None and store.max_bytes == MIB and store.fingerprint == model_fingerprint(model)
    assert json.load(open(os.path.join(store.root, "fingerprint.json")))["seq_ctx"] == model.seq_ctx
    on.partial_trim = False
    assert PrefixStore.for_model(on) is None


def test_settings_turn_it_on_under_the_state_dir(tmp_path, monkeypatch):
    from edgellm.runtime.settings import load_settings

    monkeypatch.delenv("EDGELLM_PREFIX_CACHE", raising=False)
    monkeypatch.setenv("EDGELLM_PREFIX_CACHE_MB", "64")
    cfg = load_settings(state_dir=str(tmp_path)).model()
    assert cfg.prefix_cache_dir == os.path.join(str(tmp_path), "prefix-cache")
    assert cfg.prefix_cache_bytes == 64 * MIB
    monkeypatch.setenv("EDGELLM_PREFIX_CACHE", "false")
    assert load_settings(state_dir=str(tmp_path)).model().prefix_cache_dir is None
    assert ModelConfig(path="x").prefix_cache_dir is None  # a config built directly: off


@pytest.mark.parametrize("index", ['{"format": %d, "entries": null}', '{"format": %d, "entries": 7}', "[1, 2]", "{"])
def test_a_damaged_index_starts_the_store_empty_never_stops_the_engine(tmp_path, index):
    folder = tmp_path / "fp"
    folder.mkdir()
    (folder / ps.INDEX).write_text(index % kv_fingerprint.FORMAT if "%d" in index else index)
    store = PrefixStore(str(tmp_path), "fp", 1 << 20)
    assert store.entries == {}
    assert store.lookup([1, 2, 3]) is None

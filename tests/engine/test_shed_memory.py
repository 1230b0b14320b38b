"""What the engine gives back under critical memory pressure with its model loaded (EngineCore.shed_memory;
the worker calls it on the API's ShedMemory): the embedding context, idle LoRA adapters, the compiled
grammars, the prefix store's page cache. Each is made again by the next request that needs it."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np

from edgellm.engine import guide_llguidance
from edgellm.engine.prefix_store import Entry, PrefixStore
from edgellm.engine.types import EngineOutput, EngineRequest, EngineTask, GuideKind, GuideSpec
from tests.engine.conftest import req
from tests.engine.test_lora import random_lora, write_gguf


def run(engine, requests: list[EngineRequest]) -> dict[str, EngineOutput]:
    outs: dict[str, EngineOutput] = {}
    for r in requests:
        assert engine.core.add(r) is None
    engine.core.run_until_idle(on_output=lambda o: outs.__setitem__(o.request_id, o) if o.finished else None)
    return outs


def embed(rid: str, text: str) -> EngineRequest:
    return EngineRequest(rid, [], task=EngineTask.EMBED, payload={"inputs": [text], "normalize": True})


def test_the_embedding_context_is_freed_and_made_again(engine):
    tasks = engine.core.scheduler.tasks
    first = run(engine, [embed("e1", "The cat sat on the mat.")])["e1"]
    assert first.error is None and tasks.embedder is not None
    freed = engine.core.shed_memory()
    assert f"embedding context freed ({tasks.embed_ctx} tokens)" in freed, freed
    assert tasks.embedder is None
    assert "embedding context freed" not in " ".join(engine.core.shed_memory())  # nothing held: nothing said
    again = run(engine, [embed("e2", "The cat sat on the mat.")])["e2"]
    assert again.error is None and tasks.embedder is not None
    # A new context, the same vector (each batch starts from an empty cache).
    assert np.abs(again.result["embeddings"] - first.result["embeddings"]).max() < 1e-5


def test_compiled_grammars_are_dropped_and_compiled_again(engine):
    spec = GuideSpec(GuideKind.REGEX, r"[0-9]{3}-[0-9]{4}")
    out = engine.one(req("g1", "Give me a phone number.", guide=spec, max_tokens=16, temperature=0))
    assert out.error is None
    held = guide_llguidance.compile_cached.cache_info().currsize
    assert held >= 1
    assert f"{held} compiled grammar{'' if held == 1 else 's'} dropped" in engine.core.shed_memory()
    assert guide_llguidance.compile_cached.cache_info().currsize == 0
    again = engine.one(req("g2", "Give me a phone number.", guide=spec, max_tokens=16, temperature=0))
    assert again.error is None and again.text == out.text


def test_idle_lora_adapters_are_freed_the_active_one_kept(engine, tmp_path):
    a = write_gguf(tmp_path / "a.gguf", random_lora(1, ("v_proj", "o_proj")))
    b = write_gguf(tmp_path / "b.gguf", random_lora(3, ("v_proj", "o_proj")))

    def under(rid: str, path: Path | None):
        r = req(rid, "Say hi.", max_tokens=4, temperature=0)
        r.lora_path = os.fspath(path) if path is not None else None
        return engine.one(r)

    first_a = under("la1", a)
    assert under("lb1", b).error is None and first_a.error is None
    adapters = engine.core.scheduler.admission.adapters
    assert adapters.loaded == [os.fspath(a), os.fspath(b)] and adapters.active == (os.fspath(b), 1.0)
    assert "1 idle LoRA adapter freed" in engine.core.shed_memory()
    assert adapters.loaded == [os.fspath(b)]  # b is on the context: a slot may be running under it
    again_a = under("la2", a)  # loaded again from its file
    assert again_a.error is None and again_a.text == first_a.text
    under("base", None)  # back to the base model: no adapter active, so both are idle now
    assert "2 idle LoRA adapters freed" in engine.core.shed_memory()
    assert adapters.loaded == []


def _resident_bytes(path: Path) -> int:
    """The bytes of a file in the page cache (mincore over a private mapping of it)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        start = ctypes.c_char.from_buffer(m)
        try:
            assert libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vec) == 0
        finally:
            del start
    return sum(v & 1 for v in vec) * mmap.PAGESIZE


def test_the_prefix_store_files_leave_the_page_cache(tmp_path):
    store = PrefixStore(str(tmp_path), "fp", max_bytes=64 << 20)
    assert store.drop_page_cache() == (0, 0)
    path = Path(store.root) / ("ab" * 32 + ".kv")
    with open(path, "wb") as f:
        f.write(os.urandom(4 << 20))
        os.fsync(f.fileno())  # written back, as a saved state file is soon after its save
    path.read_bytes()
    store.entries["ab" * 32] = Entry("ab" * 32, 300, 4 << 20, 0, 0.0)
    assert _resident_bytes(path) == 4 << 20
    assert store.drop_page_cache() == (1, 4 << 20)
    assert _resident_bytes(path) == 0 and path.exists()  # the file stays, only its cached pages went

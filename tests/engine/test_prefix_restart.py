"""The persistent prefix cache through the scheduler: a system prompt two requests share is saved, and
after a restart (a new engine on the same state folder) the next request with it starts from the
file instead of prefilling it."""

from __future__ import annotations

import pytest

from edgellm.engine.config import ModelConfig
from edgellm.engine.core import EngineCore
from edgellm.engine.types import EngineRequest, SamplingParams
from tests.engine.conftest import EngineHarness

RULES = " ".join(
    f"Rule {i}: when the greenhouse sensor S-{i} reads above {30 + i} percent moisture, close valve V-{i} "
    f"and log the time, the reading and the operator's name."
    for i in range(12)
)
SYSTEM = f"You are the maintenance assistant of a farm. Follow these rules exactly.\n{RULES}"


def ask(rid: str, question: str) -> EngineRequest:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return EngineRequest(rid, messages, SamplingParams(temperature=0.0, max_tokens=24))


def engine_on(model_path: str, folder: str) -> EngineHarness:
    config = ModelConfig(path=model_path, n_ctx=4096, n_slots=2, prefix_cache_dir=folder)
    return EngineHarness(EngineCore(config))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("prefix-cache"))


def test_a_shared_system_prompt_survives_a_restart(model_path, folder):
    first = engine_on(model_path, folder)
    try:
        system_tokens = len(first.scheduler.model.chat_tokens([{"role": "system", "content": SYSTEM}]))
        assert system_tokens > 300
        assert first.one(ask("a", "What do I do when S-3 reads 40 percent?")).error is None
        assert first.one(ask("b", "Which valve goes with sensor S-7?")).error is None  # reuses: saved
        store = first.scheduler.prefix_store
        assert store is not None and store.stats()["entries"] == 1
        warm = first.one(ask("c", "Who must be logged?"))
        assert first.scheduler.stats.restored_tokens == 0  # the slots' own caches served these
    finally:
        first.core.close()

    second = engine_on(model_path, folder)  # the restart
    try:
        cold_start = second.one(ask("c2", "Who must be logged?"))
        stats = second.scheduler.stats
        assert stats.restored_tokens >= system_tokens - 8, (stats.restored_tokens, system_tokens)
        assert cold_start.error is None and cold_start.text.strip() and warm.text.strip()
        # The restored KV is bit for bit the one saved (tests/engine/test_prefix_store.py checks the
        # logits); the texts are not compared here: the rest of each prompt is decoded in batches whose
        # shape (and thread count, which follows the machine's load) llama.cpp's CPU numbers depend on.
        assert cold_start.cached_tokens >= system_tokens - 8
    finally:
        second.core.close()


def test_a_damaged_file_is_dropped_and_the_request_prefills(model_path, folder):
    import glob

    for path in glob.glob(f"{folder}/*/*.kv"):
        with open(path, "r+b") as f:
            f.seek(4096)
            f.write(b"\xff" * 64)
    engine = engine_on(model_path, folder)
    try:
        out = engine.one(ask("d", "Who must be logged?"))
        assert out.error is None and engine.scheduler.stats.restored_tokens == 0
        assert engine.scheduler.prefix_store.stats()["entries"] == 0  # removed, never loaded
        assert not glob.glob(f"{folder}/*/*.kv")
    finally:
        engine.core.close()

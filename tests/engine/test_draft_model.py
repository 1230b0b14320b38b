"""Draft-model speculation's engine side (engine/draft_model.py), on the real bundled model.

With the draft model equal to the target, every draft token must be what the target itself samples at
that position (same penalties, same sampler, same (seed, position) draw), at temperature 0 and above:
the drafts are compared with a real generation of the engine with speculation off. The draft model is
loaded once for the module, beside the session's engine (2 cores: no more models than needed).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from edgellm.engine.draft_model import DraftAsk, DraftModel
from edgellm.engine.types import EngineRequest, FinishReason, SamplingParams
from edgellm.errors import EngineError

SLOTS = 4
SLOT_CTX = 1024
STORY = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
FACTS = [{"role": "user", "content": "List three facts about the moon, one per line."}]


@pytest.fixture(scope="module")
def target(engine):
    return engine.scheduler.model


@pytest.fixture(scope="module")
def draft(model_path, target):
    d = DraftModel(model_path, target, n_slots=SLOTS, n_ctx=SLOT_CTX, n_threads=2, n_gpu_layers=0)
    yield d
    d.close()


def generate(engine, target, rid: str, messages: list[dict], params: SamplingParams) -> tuple[list[int], list[int]]:
    """The prompt and the tokens the engine generates for it, without speculation (logprobs carry the ids)."""
    prompt = target.chat_tokens(messages)
    request = EngineRequest(rid, messages, replace(params, num_logprobs=1), cache_lookup=False, speculative=False)
    out = engine.one(request)
    assert out.error is None and out.logprobs, out.error
    return prompt, [lp.token_id for lp in out.logprobs]


def ask_after(seq_id: int, prompt: list[int], generated: list[int], k: int, params: SamplingParams) -> DraftAsk:
    """What the scheduler asks when the slot has generated `generated` (the pending token last)."""
    history = [*prompt[-params.repeat_last_n :], *generated]  # Slot.history
    return DraftAsk(seq_id, [*prompt, *generated], k, params, len(generated), history, list(generated))


GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
SAMPLED = SamplingParams(
    temperature=0.8, top_p=0.95, seed=1234, max_tokens=32, repeat_penalty=1.1, presence_penalty=0.3
)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "t0.8"])
def test_drafts_equal_the_targets_own_samples(engine, target, draft, params):
    prompt, generated = generate(engine, target, f"dm-{params.temperature}", STORY, params)
    assert len(generated) >= 20
    k = 6
    for cut in (0, 1, 7, 14):  # cut 0: nothing generated yet (the first sample itself)
        want = generated[cut : cut + k]
        got = draft.propose([ask_after(0, prompt, generated[:cut], k, params)])
        assert got == [want], f"after {cut} tokens"


def test_a_draft_stops_at_end_of_generation(engine, target, draft):
    params = SamplingParams(temperature=0.0, max_tokens=64)
    question = [{"role": "user", "content": "What is 2+2? Answer with just the number."}]  # "2 + 2 = 4", then EOS
    prompt, generated = generate(engine, target, "dm-eos", question, params)
    assert len(generated) < 12  # ended by the model (an EOS), well before max_tokens
    got = draft.propose([ask_after(1, prompt, generated[:1], 16, params)])
    assert got == [generated[1:]]  # everything the target writes after the first token, not past its end


def test_batched_asks_draft_as_each_alone(target, draft):
    story, facts = target.chat_tokens(STORY), target.chat_tokens(FACTS)
    asks = [
        DraftAsk(0, story, 5, GREEDY, 0, story[-64:], []),
        DraftAsk(2, facts, 5, SAMPLED, 0, facts[-64:], []),
    ]
    alone = []
    for a in asks:
        draft.forget(a.seq_id)
        alone += draft.propose([a])
    for a in asks:
        draft.forget(a.seq_id)
    decodes = draft.stats.decodes
    together = draft.propose(asks)
    assert together == alone and all(len(d) == 5 for d in together)
    assert draft.stats.decodes - decodes == 5  # one catch-up decode, then one per draft step after the first


def test_the_cached_prefix_is_reused(target, draft):
    context = target.chat_tokens(FACTS)
    draft.forget(3)
    before = draft.stats.catchup_tokens
    first = draft.propose([DraftAsk(3, context, 4, GREEDY, 0)])[0]
    assert len(first) == 4 and draft.stats.catchup_tokens - before == len(context)
    assert draft.cached[3] == context + first[:3]  # the last draft is sampled, never fed

    # The target accepted every draft and sampled one more token: only the last draft and that token
    # are new to the draft KV.
    longer = context + first + [first[0]]
    before = draft.stats.catchup_tokens
    second = draft.propose([DraftAsk(3, longer, 4, GREEDY, 5)])[0]
    assert draft.stats.catchup_tokens - before == 2

    # The same, from an empty sequence: the reused KV gives the same drafts.
    draft.forget(3)
    assert draft.propose([DraftAsk(3, longer, 4, GREEDY, 5)])[0] == second

    # Rejected drafts: the context diverges after two of them; the KV is cut there, one token fed.
    diverged = context + first[:2] + [first[0]]
    draft.propose([DraftAsk(3, context, 4, GREEDY, 0)])
    before = draft.stats.catchup_tokens
    draft.propose([DraftAsk(3, diverged, 4, GREEDY, 3)])
    assert draft.stats.catchup_tokens - before == 1

    # A context the KV already holds in full: its last token is fed again for its logits row.
    before = draft.stats.catchup_tokens
    draft.propose([DraftAsk(3, diverged, 2, GREEDY, 3)])
    assert draft.stats.catchup_tokens - before == 1


def test_asks_that_get_no_draft(target, draft):
    context = target.chat_tokens(FACTS)
    decodes = draft.stats.decodes
    got = draft.propose(
        [
            DraftAsk(0, context, 0, GREEDY, 0),  # k = 0
            DraftAsk(1, [*context[:5], -1, *context[5:]], 4, GREEDY, 0),  # a media stand-in
            DraftAsk(2, [context[0]] * SLOT_CTX, 4, GREEDY, 0),  # no room left in the slot
        ]
    )
    assert got == [[], [], []] and draft.stats.decodes == decodes
    with pytest.raises(EngineError, match="two draft asks"):
        draft.propose([DraftAsk(0, context, 1, GREEDY, 0), DraftAsk(0, context, 1, GREEDY, 0)])
    with pytest.raises(EngineError, match="outside"):
        draft.propose([DraftAsk(SLOTS, context, 1, GREEDY, 0)])


def test_drafts_never_pass_the_pool(target, draft):
    context = (target.chat_tokens(STORY) * 100)[: SLOT_CTX - 3]
    for seq_id in range(SLOTS):  # the pool's SLOT_CTX cells are all this sequence's to take
        draft.forget(seq_id)
    got = draft.propose([DraftAsk(0, context, 8, GREEDY, 0)])[0]
    assert len(got) <= 3 and len(draft.cached[0]) < SLOT_CTX


def test_forget_and_close_are_idempotent(model_path, target):
    d = DraftModel(model_path, target, n_slots=1, n_ctx=256, n_threads=2, n_gpu_layers=0)
    assert d.n_params > 0 and d.size_bytes == Path(model_path).stat().st_size
    context = target.chat_tokens(FACTS)
    assert len(d.propose([DraftAsk(0, context, 2, GREEDY, 0)])[0]) == 2
    d.forget(0)
    d.forget(0)
    assert 0 not in d.cached
    d.close()
    d.close()
    d.forget(0)  # nothing left to clear
    with pytest.raises(EngineError, match="closed"):
        d.propose([DraftAsk(0, context, 2, GREEDY, 0)])


def swapped_vocabulary_copy(src: str, out_dir: Path, a: int = 1000, b: int = 1001) -> Path:
    """A copy of the GGUF whose tokens a and b trade strings: same size, another vocabulary."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    out = out_dir / "smollm2-swapped-vocab.gguf"
    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field("general.architecture").contents()
    tokens = list(reader.get_field("tokenizer.ggml.tokens").contents())
    tokens[a], tokens[b] = tokens[b], tokens[a]
    writer = gguf.GGUFWriter(str(out), arch=arch, endianess=reader.endianess)
    new = {
        "tokenizer.ggml.tokens": MetadataDetails(gguf.GGUFValueType.ARRAY, tokens, sub_type=gguf.GGUFValueType.STRING)
    }
    copy_with_new_metadata(reader, writer, new, [])
    return out


def test_another_vocabulary_is_refused(model_path, target, tmp_path):
    other = swapped_vocabulary_copy(model_path, tmp_path)
    with pytest.raises(EngineError, match="differ at token 1000") as info:
        DraftModel(str(other), target, n_slots=1, n_ctx=256, n_threads=2, n_gpu_layers=0)
    assert str(other) in str(info.value) and model_path in str(info.value)

    class Bigger:  # a target whose vocabulary has one token more
        n_vocab = target.n_vocab + 1
        name = "bigger.gguf"

    with pytest.raises(EngineError, match="49152 tokens.*bigger.gguf one of 49153"):
        DraftModel(model_path, Bigger(), n_slots=1, n_ctx=256, n_threads=2, n_gpu_layers=0)


def test_a_missing_file_is_refused(target, tmp_path):
    with pytest.raises(EngineError, match="draft model file not found"):
        DraftModel(str(tmp_path / "none.gguf"), target, n_slots=1, n_ctx=256, n_threads=2, n_gpu_layers=0)


def test_the_engine_generation_finished_normally(engine, target):
    """The reference runs above end as the engine ends them (a sanity check on the harness use)."""
    out = engine.one(
        EngineRequest("dm-sanity", FACTS, SamplingParams(temperature=0.0, max_tokens=8), speculative=False)
    )
    assert out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


def test_settings_pass_the_draft_model_on(model_path, tmp_path, monkeypatch):
    from edgellm.engine.memory_costs import MIB
    from edgellm.runtime.settings import SettingsError, load_settings

    with pytest.raises(SettingsError, match="draft model file not found"):
        load_settings(draft_model_path=str(tmp_path / "none.gguf")).model()
    monkeypatch.setenv("EDGELLM_DRAFT_MODEL_PATH", model_path)
    s = load_settings(n_ctx=2048, n_slots=2, memory_budget="4GiB")
    assert s.model().draft_model_path == model_path
    plan = s.memory_report()
    assert plan["draft_mib"] > round(Path(model_path).stat().st_size / MIB, 1)  # weights, buffers and its KV
    monkeypatch.delenv("EDGELLM_DRAFT_MODEL_PATH")
    plain = load_settings(n_ctx=2048, n_slots=2, memory_budget="4GiB")
    plain.model()
    assert plain.memory_report()["total_bytes"] + plan["draft_bytes"] == plan["total_bytes"]
    off = load_settings(speculative_decoding=False, draft_model_path=model_path)
    assert off.model().draft_model_path is None  # no speculation: the draft model is not loaded

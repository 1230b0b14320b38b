"""The typed messages between the API process and the engine worker (edgellm/runtime/supervision/ipc.py): each
pickles as it is, is immutable, and needs nothing of llama.cpp."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest

from edgellm.engine.info import EngineInfo, EngineLoad, EngineStats
from edgellm.engine.types import EngineOutput, EngineRequest, SamplingParams
from edgellm.errors import ErrorType
from edgellm.runtime.supervision import ipc


def _info() -> EngineInfo:
    return EngineInfo(
        model_name="m.gguf", model_path="/m.gguf", n_slots=2, seq_ctx=1024, n_ctx=1024, n_threads=2,
        n_vocab=100, offload={"gpu_supported": False, "n_gpu_layers": 0, "n_layers": 4,
                              "fallback_reason": None, "device": "cpu"},
        warmup_ms=1.5, self_test={"sequences": 2}, media={"vision": False, "audio": False, "error": None}, pid=1,
    )  # fmt: skip


MESSAGES = [
    ipc.Submit((EngineRequest("a", [{"role": "user", "content": "hi"}], SamplingParams()),)),
    ipc.Abort("a"),
    ipc.Ping(),
    ipc.Shutdown(),
    ipc.Phase("loading"),
    ipc.Ready(_info()),
    ipc.Outputs((EngineOutput.failure("a", "boom", ErrorType.ENGINE_ERROR),)),
    ipc.Pong(EngineStats(EngineLoad(2, 1, 0, 2, 0))),
    ipc.Fatal("EngineError: no model"),
    ipc.ShedMemory(1),
    ipc.MemoryShed(1, ("embedding context freed (512 tokens)",), 405.3, 383.0),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_each_message_pickles_and_is_frozen(msg):
    back = pickle.loads(pickle.dumps(msg))
    assert type(back) is type(msg)
    assert isinstance(msg, ipc.ToWorker | ipc.FromWorker)
    field = dataclasses.fields(msg)[0].name if dataclasses.fields(msg) else None
    if field is not None:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(msg, field, None)


def test_ready_and_pong_keep_the_wire_dicts():
    assert ipc.Ready(_info()).info.as_dict()["offload"]["device"] == "cpu"
    stats = ipc.Pong(EngineStats(EngineLoad(2, 1, 0, 2, 0))).stats.as_dict()
    assert (stats["slots_total"], stats["slots_busy"], stats["steps"]) == (2, 1, 0)


def test_the_messages_import_no_llama_cpp():
    code = "import sys, edgellm.runtime.supervision.ipc; print(any(m.startswith('llama_cpp') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

from __future__ import annotations

import logging

import pytest

from edgellm.api.output_processor import OutputProcessor, RequestOutput
from edgellm.engine.core import EngineCore
from edgellm.engine.model import ModelConfig
from edgellm.engine.scheduler import Scheduler
from edgellm.engine.types import EngineOutput, EngineRequest, SamplingParams


class EngineHarness:
    """The real engine core on the bundled model, driven by its loop in this process.

    Its outputs go through the API's output processor, as in the node, so tests read whole texts.
    Tests of the scheduler itself reach it as `engine.scheduler`.
    """

    def __init__(self, core: EngineCore):
        self.core = core

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    def run(self, requests: list[EngineRequest], max_steps: int = 100_000) -> dict[str, RequestOutput]:
        processor = OutputProcessor()
        outs: dict[str, RequestOutput] = {}

        def deliver(o: EngineOutput) -> None:
            done = processor.process(o)
            if o.finished:
                outs[o.request_id] = done

        # All queued at once (not fed as the queue has room): a test may mean to overfill the queue.
        for r in requests:
            processor.add_request(r.request_id, r.sampling.stop, r.reply)
            rejected = self.core.add(r)
            if rejected is not None:
                deliver(rejected)
        self.core.run_until_idle(on_output=deliver, poll_s=1.0, max_rounds=max_steps)
        return outs

    def one(self, request: EngineRequest) -> RequestOutput:
        return self.run([request])[request.request_id]


def step_when_prepared(scheduler: Scheduler) -> list[EngineOutput]:
    """One step of the scheduler itself (its own tests), once the queued requests are prepared
    (preparation runs off the step loop)."""
    while scheduler.has_work() and not scheduler.can_step():
        scheduler.wait_prepared(1.0)
    return scheduler.step()


@pytest.fixture(scope="session")
def engine(model_path):
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    core = EngineCore(ModelConfig(path=model_path, n_ctx=8192, n_slots=8), max_waiting=16)
    yield EngineHarness(core)
    core.close()


# llama.cpp's CPU flash attention computes a ubatch of 64 rows or more with a tiled f32 kernel whose result
# for a sequence depends on where its cells sit in the KV pool, and a smaller one row by row (f16), each row
# alone. So in one unified pool a request's logits can differ slightly with what it was batched beside, as
# in llama-server and vLLM. Tests that compare a request's text alone and under load use batches under 64
# tokens (n_batch 32): every row takes the row kernel, the comparison isolates the scheduler.
EXACT_BATCH = 32


@pytest.fixture(scope="session")
def exact_engine(model_path):
    """The engine with n_batch 32: outputs independent of what shares a step (see EXACT_BATCH)."""
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    core = EngineCore(ModelConfig(path=model_path, n_ctx=8192, n_slots=8, n_batch=EXACT_BATCH), max_waiting=16)
    yield EngineHarness(core)
    core.close()


def req(rid: str, content: str = "Write a short story about a robot.", guide=None, **sampling) -> EngineRequest:
    sampling.setdefault("max_tokens", 48)
    return EngineRequest(rid, [{"role": "user", "content": content}], SamplingParams(**sampling), guide)

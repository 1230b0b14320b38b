from __future__ import annotations

import logging

import pytest

from edgellm.api.output_processor import OutputProcessor
from edgellm.api.text_state import RequestOutput
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


@pytest.fixture(scope="session")
def slots_engine(model_path):
    """The engine with each slot owning n_ctx / n_slots cells (kv_unified off), the other layout: a request
    up to its slot's share, preemption by priority only."""
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    core = EngineCore(ModelConfig(path=model_path, n_ctx=8192, n_slots=8, kv_unified=False), max_waiting=16)
    yield EngineHarness(core)
    core.close()


def req(rid: str, content: str = "Write a short story about a robot.", guide=None, **sampling) -> EngineRequest:
    sampling.setdefault("max_tokens", 48)
    return EngineRequest(rid, [{"role": "user", "content": content}], SamplingParams(**sampling), guide)

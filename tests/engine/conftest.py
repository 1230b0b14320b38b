from __future__ import annotations

import logging

import pytest

from edgellm.api.output_processor import OutputProcessor, RequestOutput
from edgellm.engine.model import LlamaModel, ModelConfig
from edgellm.engine.scheduler import Scheduler
from edgellm.engine.types import EngineOutput, EngineRequest, SamplingParams


class EngineHarness:
    """The real scheduler on the bundled model, driven step by step in this process.

    Its outputs go through the API's output processor, as in the node, so tests read whole texts.
    """

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def run(self, requests: list[EngineRequest], max_steps: int = 100_000) -> dict[str, RequestOutput]:
        processor = OutputProcessor()
        outs: dict[str, RequestOutput] = {}
        for r in requests:
            processor.add_request(r.request_id, r.sampling.stop)
            rejected = self.scheduler.add_request(r)
            if rejected is not None:
                outs[r.request_id] = processor.process(rejected)
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                break
            for o in step_when_prepared(self.scheduler):
                done = processor.process(o)
                if o.finished:
                    outs[o.request_id] = done
        return outs

    def one(self, request: EngineRequest) -> RequestOutput:
        return self.run([request])[request.request_id]


def step_when_prepared(scheduler: Scheduler) -> list[EngineOutput]:
    """One step, once the queued requests are prepared (preparation runs off the step loop)."""
    while scheduler.has_work() and not scheduler.can_step():
        scheduler.wait_prepared(1.0)
    return scheduler.step()


@pytest.fixture(scope="session")
def engine(model_path):
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    model = LlamaModel(ModelConfig(path=model_path, n_ctx=8192, n_slots=8))
    scheduler = Scheduler(model, max_waiting=16)
    yield EngineHarness(scheduler)
    scheduler.close()
    model.close()


def req(rid: str, content: str = "Write a short story about a robot.", guide=None, **sampling) -> EngineRequest:
    sampling.setdefault("max_tokens", 48)
    return EngineRequest(rid, [{"role": "user", "content": content}], SamplingParams(**sampling), guide)

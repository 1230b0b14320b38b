"""The thread governor: llama.cpp's thread count follows the cores other processes leave free."""

from __future__ import annotations

import sys
import time

import pytest

from edgellm.engine import cpu_share
from edgellm.engine.cpu_share import ThreadGovernor, threads_for
from tests.engine.conftest import req
from tests.process_hygiene import spawn


@pytest.mark.parametrize(
    ("max_threads", "cores", "others", "expected"),
    [
        (2, 2, 0.0, 2),
        (2, 2, 0.3, 2),  # the API process, a logger: still ours
        (2, 2, 1.0, 1),  # one busy loop takes a core
        (2, 2, 2.0, 1),  # never below one
        (4, 6, 1.0, 4),  # capped by n_threads
        (6, 6, 2.6, 3),
    ],
)
def test_threads_for(max_threads, cores, others, expected):
    assert threads_for(max_threads, cores, others) == expected


def test_a_change_needs_two_agreeing_readings(monkeypatch):
    """/proc/stat and os.times are replaced by a scripted machine (the test says what the others use)."""
    clock = {"t": 0.0, "machine": 0.0, "own": 0.0}
    monkeypatch.setattr(cpu_share.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(cpu_share, "_machine_busy_s", lambda: clock["machine"])
    monkeypatch.setattr(cpu_share, "_own_busy_s", lambda: clock["own"])
    applied = []
    gov = ThreadGovernor(2, applied.append, cores=2)

    def second(others: float, own: float = 1.0) -> None:
        clock["t"] += 1.0
        clock["own"] += own
        clock["machine"] += own + others
        gov.tick()

    second(1.0)  # a busy neighbour appears: one reading is not enough
    assert applied == [] and gov.current == 2
    second(1.0)
    assert applied == [1] and gov.current == 1
    second(0.0)
    second(1.0)  # a dip that does not last
    assert applied == [1]
    second(0.0)
    second(0.0)
    assert applied == [1, 2] and gov.switches == 2


def test_the_engine_drops_to_one_thread_beside_a_busy_process_and_comes_back(engine):
    scheduler = engine.scheduler
    if scheduler.threads.max_threads < 2 or not scheduler.threads.enabled:
        pytest.skip("needs 2+ cores and /proc/stat")

    def generate_until(threads: int, limit_s: float = 30.0) -> int:
        """Decode until the governor has settled on `threads` (it reads the machine once a second and
        needs two readings that agree: ~2 s on a quiet machine); the count it has at `limit_s` otherwise
        (a machine busy with more than this test's process can delay it, not fake it)."""
        end = time.monotonic() + limit_s
        while scheduler.threads.current != threads and time.monotonic() < end:
            engine.one(req(f"cpu-{time.monotonic_ns()}", max_tokens=16))
        return scheduler.threads.current

    busy = spawn([sys.executable, "-c", "while True: pass"])
    try:
        assert generate_until(1) == 1
    finally:
        busy.kill()
        busy.wait(10)
    assert generate_until(scheduler.threads.max_threads) == scheduler.threads.max_threads

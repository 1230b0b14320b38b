"""The prepare pool tells the engine worker when a preparation ends (engine/prepared.PrepareExecutor),
so that the worker, asleep on its pipe, starts the request then instead of at a poll."""

from __future__ import annotations

import threading

import pytest

from edgellm.engine.prepared import PrepareExecutor


def test_wake_runs_once_per_job_after_it_ends_even_when_it_fails():
    woken = threading.Semaphore(0)
    done_before_wake: list[bool] = []
    pool = PrepareExecutor(max_workers=2, thread_name_prefix="test-prepare")
    futures = []

    def wake() -> None:
        done_before_wake.append(all(f.done() for f in futures[: len(done_before_wake) + 1]))
        woken.release()

    pool.wake = wake
    try:
        futures.append(pool.submit(lambda: 1))
        assert woken.acquire(timeout=10)

        def boom() -> None:
            raise ValueError("bad prompt")

        futures.append(pool.submit(boom))
        assert woken.acquire(timeout=10)
        with pytest.raises(ValueError):
            futures[1].result()
        assert not woken.acquire(timeout=0.2)  # no extra wake-ups
        assert done_before_wake == [True, True]
    finally:
        pool.shutdown(wait=True)


def test_no_wake_set_is_no_call():
    pool = PrepareExecutor(max_workers=1, thread_name_prefix="test-prepare")
    try:
        assert pool.submit(lambda: 2).result(timeout=10) == 2
    finally:
        pool.shutdown(wait=True)

"""Real nodes that tests/ratio1 shares, and how they stop.

- `background_stops` (package): a Ratio1 node takes 10-30 s to stop (naeural-core closes its plugins one
  after the other, about a second each). A module's node is stopped on a thread of its own, so the next
  module's node boots meanwhile; every stop is joined, and what it must leave checked (each node process
  exited), when the package ends.
- `ratio1_fleet`: the two nodes of tests/ratio1/fleet.py's SharedFleet (balancing API + ChainStore probe on
  each), started for the first test that asks and stopped after the last one (of the collected tests).
  A test that kills one of its nodes is marked `kills_a_fleet_node` and is moved after the fleet's other
  users; one that finds a node of it dead anyway (another order) gets a fresh fleet.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from tests.ratio1.fleet import SharedFleet

FLEET = "ratio1_fleet"
KILLS = "kills_a_fleet_node"


def pytest_configure(config):
    config.addinivalue_line("markers", f"{KILLS}: kills a node of the shared {FLEET} (runs after its other users)")


def pytest_collection_modifyitems(items):
    """The tests marked kills_a_fleet_node run right after the last other test that uses the fleet."""
    users = [item for item in items if FLEET in getattr(item, "fixturenames", ())]
    killers = [item for item in users if item.get_closest_marker(KILLS)]
    others = [item for item in users if not item.get_closest_marker(KILLS)]
    if not killers or not others:
        return
    for item in killers:
        items.remove(item)
    at = items.index(others[-1]) + 1
    items[at:at] = killers


class BackgroundStops:
    """Stops running on threads; join() waits for all of them, then re-raises a stop's error and runs
    each stop's check (its assertions about what stopped)."""

    def __init__(self):
        self._stops: list[tuple[str, threading.Thread, list[BaseException], Callable[[], None] | None]] = []

    def add(self, name: str, stop: Callable[[], None], check: Callable[[], None] | None = None) -> None:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                stop()
            except BaseException as exc:  # re-raised by join(), in the test run's thread
                errors.append(exc)

        thread = threading.Thread(target=run, name=f"stop {name}")
        thread.start()
        self._stops.append((name, thread, errors, check))

    def join(self) -> None:
        stops, self._stops = self._stops, []
        for _, thread, _, _ in stops:
            thread.join()
        for name, _, errors, check in stops:
            if errors:
                raise AssertionError(f"stopping {name} failed: {errors[0]!r}") from errors[0]
            if check is not None:
                check()


@pytest.fixture(scope="package")
def background_stops():
    stops = BackgroundStops()
    try:
        yield stops
    finally:
        stops.join()


@pytest.fixture(scope="package")
def shared_fleet(tmp_path_factory, background_stops):
    fleet = SharedFleet(lambda: tmp_path_factory.mktemp("fleet"), background_stops)
    yield fleet
    fleet.stop()  # still up when the last user did not run (-x, an error in its setup)


@pytest.fixture
def ratio1_fleet(shared_fleet, request):
    """(A, B): the shared fleet's two live nodes; stopped (in the background) after its last user."""
    yield shared_fleet.nodes()
    users = [item for item in request.session.items if FLEET in getattr(item, "fixturenames", ())]
    if users and users[-1] is request.node:
        shared_fleet.stop()

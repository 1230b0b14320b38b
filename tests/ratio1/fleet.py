"""A fleet of real offline Ratio1 nodes for the tests: edgellm.ratio1.node_fleet.fleet (one broker, keys made
first, each node whitelisting the others, ChainStore running) with the tests' own kind of node:
WatchedRatio1Node (a killed test run leaves none behind) and the test-only plugins linked in
(node_plugins), both from tests/ratio1/test_node_integration.py.

start() of a node returns as soon as its process runs when its pipelines hold no API instance; the test
then waits for its own sign of life (e.g. the chainstore probe's output file).

SharedFleet is the two-node fleet the balancing and fleet tests share (the `ratio1_fleet` fixture,
tests/ratio1/conftest.py): each node runs EDGELLM_INFERENCE_API in one balancing group (api_pipeline) and
the ChainStore probe (PROBE_PIPELINE).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from edgellm.ratio1 import node_fleet
from edgellm.ratio1.launcher import NodeOptions, Ratio1Node
from edgellm.ratio1.ports import free_port
from tests.ratio1.test_node_integration import WatchedRatio1Node, node_plugins, node_python

# Request balancing (test_node_balancing.py): each engine has 1 slot and 1 thread, so two fit on 2 cores, and
# the pending limit is 1. The refresh and stale times are short (2 s / 8 s) so that a dead peer is noticed
# within the test.
GROUP = "edgellm-ci-fleet"
BALANCING = {
    "REQUEST_BALANCING_ENABLED": True,
    "REQUEST_BALANCING_GROUP": GROUP,
    "REQUEST_BALANCING_PENDING_LIMIT": 1,
    "REQUEST_BALANCING_ANNOUNCE_PERIOD": 2,
    "REQUEST_BALANCING_CAPACITY_DEBOUNCE_SECONDS": 0,
    "REQUEST_BALANCING_CAPACITY_REFRESH_PERIOD": 2,
    "REQUEST_BALANCING_CAPACITY_REFRESH_JITTER_SECONDS": 0,
    "REQUEST_BALANCING_PEER_STALE_SECONDS": 8,
    "REQUEST_BALANCING_MAILBOX_POLL_PERIOD": 0.3,
}

# The ChainStore probe (test_node_fleet.py): the test-only EDGELLM_TEST_CHAINSTORE_PROBE writes its node's
# record into "edgellm_test:probe" every 2 s and reports what its node's ChainStore holds (no model).
PROBE_PIPELINE = {
    "NAME": "edgellm_test_chainstore",
    "TYPE": "Void",
    "PLUGINS": [{"SIGNATURE": "EDGELLM_TEST_CHAINSTORE_PROBE", "INSTANCES": [{"INSTANCE_ID": "probe"}]}],
}


def api_pipeline(port: int) -> dict:
    instance = {"INSTANCE_ID": "api", "PORT": port, "N_SLOTS": 1, "N_THREADS": 1, "N_CTX": 1024, **BALANCING}
    return {
        "NAME": "fleet_api",
        "TYPE": "Loopback",
        "PLUGINS": [{"SIGNATURE": "EDGELLM_INFERENCE_API", "INSTANCES": [instance]}],
    }


@contextlib.contextmanager
def fleet(
    python: str,
    root: Path,
    pipelines: list[list[dict[str, Any]]],
    *,
    name: str = "edgellm-fleet",
    ready_timeout_s: float = 240,
) -> Iterator[list[Ratio1Node]]:
    """len(pipelines) nodes (node i runs pipelines[i] in root/node<i>, its EE_ID is f"{name}-{i}")."""
    options = []
    for i, pipes in enumerate(pipelines):
        workdir = Path(root) / f"node{i}"
        workdir.mkdir(parents=True)
        node_plugins(workdir)
        options.append(
            NodeOptions(
                python=python,
                workdir=workdir,
                node_id=f"{name}-{i}",
                pipelines=pipes,
                require_api=False,
                ready_timeout_s=ready_timeout_s,
            )
        )
    with node_fleet.fleet(options, node_class=WatchedRatio1Node) as nodes:
        yield nodes


class SharedFleet:
    """Two nodes (A = node 0, which runs the broker, and B), each with api_pipeline and PROBE_PIPELINE,
    started on the first nodes() and stopped by stop() (on a thread: `stops.add`, see conftest.py)."""

    def __init__(self, make_root: Callable[[], Path], stops):
        self._make_root = make_root
        self._stops = stops
        self._stack: contextlib.ExitStack | None = None
        self._nodes: list[Ratio1Node] | None = None

    def nodes(self) -> tuple[Ratio1Node, Ratio1Node]:
        """Both nodes, serving. A fleet one of whose nodes is dead (a test killed it) is replaced by a
        fresh one: each test gets two live nodes, whatever ran before it. The old one is stopped first
        (not in the background): a node's EE_ID is taken until its process ends."""
        if self._nodes is not None and any(n.node is None or n.node.poll() is not None for n in self._nodes):
            self.stop(background=False)
        if self._nodes is None:
            python = node_python()
            pipelines = [[api_pipeline(port), PROBE_PIPELINE] for port in (free_port(), free_port())]
            stack = contextlib.ExitStack()
            nodes = stack.enter_context(fleet(python, self._make_root(), pipelines))
            self._stack, self._nodes = stack, nodes
            for node in nodes:
                node.wait_http(node.instances[0], timeout_s=240)
        a, b = self._nodes
        return a, b

    def stop(self, *, background: bool = True) -> None:
        """Both nodes stop (together, the broker last: node_fleet.fleet), on a thread unless `background` is
        False; once it is done, each node has exited and node 0's broker with them."""
        if self._stack is None:
            return
        stack, nodes = self._stack, self._nodes
        self._stack = self._nodes = None

        def check() -> None:
            for node in nodes:
                assert node.node.returncode is not None, f"{node.options.node_id} did not exit"
            assert nodes[0].broker.poll() is not None  # the broker stopped with node 0, after node 1

        if background:
            self._stops.add("the two-node fleet", stack.close, check)
        else:
            stack.close()
            check()

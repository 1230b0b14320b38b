"""Two real offline Ratio1 nodes on one broker share ChainStore records: the shared `ratio1_fleet`
(tests/ratio1/conftest.py, tests/ratio1/fleet.py), the two nodes the balancing tests run on.

Each node runs the test-only EDGELLM_TEST_CHAINSTORE_PROBE (fleet.PROBE_PIPELINE): it writes its own
record into "edgellm_test:probe" every 2 s and reports what its node's ChainStore holds. Each node must
see the other's record: the replication that request balancing between nodes is built on. That the
nodes and the broker they share stop is checked where the fleet stops (conftest.py: SharedFleet.stop).

It needs the node venv (EDGELLM_RATIO1_PYTHON, as tests/ratio1/test_node_integration.py): without it the
test fails, never skips. Marked slow by tests/conftest.py (tests/ratio1/).
"""

from __future__ import annotations

import json
import time

import pytest

from edgellm.ratio1.launcher import Ratio1Node

START_TIMEOUT_S = 240  # the node's own start (imports, admin pipeline) until the probe reports
SYNC_TIMEOUT_S = 30  # from both probes reporting until each sees the other's record


def probe_state(node: Ratio1Node) -> dict | None:
    path = node.output_dir / "edgellm_test_chainstore_probe" / "probe.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet
        return None


def wait_for(nodes: list[Ratio1Node], done, timeout_s: float, what: str) -> list[dict]:
    """Poll every node's probe state until done(node, state) holds for all of them; a node dying ends it."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [probe_state(n) for n in nodes]
        if all(s is not None and done(n, s) for n, s in zip(nodes, states, strict=True)):
            return states
        for n in nodes:
            assert n.node.poll() is None, f"{n.options.node_id} exited with {n.node.returncode}:\n{n.log_path}"
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not within {timeout_s:g} s; probe states: {json.dumps(states, indent=1)}")
        time.sleep(0.2)


def test_fleet_two_nodes_share_chainstore_records(ratio1_fleet):
    t0 = time.monotonic()
    a, b = nodes = list(ratio1_fleet)
    assert a.address.startswith("0xai_") and b.address.startswith("0xai_") and a.address != b.address
    assert b.mqtt_port == a.mqtt_port and b.broker is None  # one broker: node 0's

    # Up: each probe reports with the address its node runs under, the pre-made one.
    wait_for(nodes, lambda n, s: s["address"] == n.address, START_TIMEOUT_S, "both probes reporting")
    ready_s = time.monotonic() - t0

    # Replicated: each node holds the other's record, written by the other node.
    def sees_peer(node: Ratio1Node, state: dict) -> bool:
        peer = b if node is a else a
        record = state["seen"].get(peer.address)
        return isinstance(record, dict) and record.get("alias") == peer.options.node_id

    t1 = time.monotonic()
    states = wait_for(nodes, sees_peer, SYNC_TIMEOUT_S, "each node seeing the other's record")
    sync_s = time.monotonic() - t1
    for node, state in zip(nodes, states, strict=True):
        assert state["seen"][node.address]["alias"] == node.options.node_id  # its own record, too
    first = {n.address: s["seen"][(b if n is a else a).address]["n"] for n, s in zip(nodes, states, strict=True)}

    # Kept up to date: a newer write of each node reaches the other (a record seen once is not enough
    # for capacity records that must stay fresh).
    def sees_newer(node: Ratio1Node, state: dict) -> bool:
        peer = b if node is a else a
        record = state["seen"].get(peer.address) or {}
        return record.get("n", 0) > first[node.address]

    wait_for(nodes, sees_newer, SYNC_TIMEOUT_S, "each node seeing a newer record of the other")
    print(f"\nfleet of 2: probes reporting {ready_s:.1f} s into the test, records replicated {sync_s:.1f} s later")

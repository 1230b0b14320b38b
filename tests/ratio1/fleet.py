"""A fleet of real offline Ratio1 nodes on one broker, ChainStore replicating between them.

`fleet(python, root, pipelines)` starts one node per entry of `pipelines` (each a node's pipeline list),
each in root/node<i>, the way notes/ratio1_balancing.md (2.3) found ChainStore to work offline:
- every node's key is made before any node starts, so that each node's whitelist
  (_local_cache/authorized_addrs) can name all the others: their default ChainStore peers;
- node 0 starts the mosquitto broker, the others connect to its port (NodeOptions.broker_port);
- CHAIN_STORE_BASE is unpaused on every node (NodeOptions.chainstore), the other admin plugins stay paused.
Nodes are WatchedRatio1Node (a killed test run leaves none behind) with the test-only plugins linked in
(node_plugins), both from tests/ratio1/test_node_integration.py.

start() of a node returns as soon as its process runs when its pipelines hold no API instance; the test
then waits for its own sign of life (e.g. the chainstore probe's output file).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from edgellm.ratio1.launcher import NodeOptions, Ratio1Node, free_port
from tests.ratio1.test_node_integration import WatchedRatio1Node, node_plugins


@contextlib.contextmanager
def fleet(
    python: str,
    root: Path,
    pipelines: list[list[dict[str, Any]]],
    *,
    name: str = "edgellm-fleet",
    ready_timeout_s: float = 240,
) -> Iterator[list[Ratio1Node]]:
    """Start len(pipelines) nodes (node i runs pipelines[i], its EE_ID is f"{name}-{i}"), yield them, and
    stop them all on exit, also when a start fails: the others first, node 0 (and with it the broker) last."""
    mqtt_port = free_port()
    nodes: list[Ratio1Node] = []
    for i, pipes in enumerate(pipelines):
        workdir = Path(root) / f"node{i}"
        workdir.mkdir(parents=True)
        node_plugins(workdir)
        options = NodeOptions(
            python=python,
            workdir=workdir,
            node_id=f"{name}-{i}",
            pipelines=pipes,
            # node 0 owns the broker; the others share it
            mqtt_port=mqtt_port if i == 0 else None,
            broker_port=None if i == 0 else mqtt_port,
            chainstore=True,
            require_api=False,
            ready_timeout_s=ready_timeout_s,
        )
        nodes.append(WatchedRatio1Node(options))
    for node in nodes:
        node.make_key()
    for node in nodes:
        node.options.peers = [f"{peer.address} {peer.options.node_id}" for peer in nodes if peer is not node]
    failed = False
    try:
        for node in nodes:
            node.start()
        yield nodes
    except BaseException:
        failed = True
        raise
    finally:
        errors = []
        for node in reversed(nodes):  # node 0 last: its broker outlives every node that uses it
            try:
                node.stop()
            except Exception as exc:  # stop the others anyway
                errors.append(exc)
        if errors and not failed:  # never hide the error that ended the fleet
            raise errors[0]

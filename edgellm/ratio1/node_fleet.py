"""Several offline Ratio1 nodes on one broker, ChainStore replicating between them: request balancing's
ground, as the Ratio1 tests and tools/bench/fleet.py run it.

Separate from launcher.py, which runs one node: a fleet is the order in which several are keyed,
whitelisted, launched, waited for and stopped (the broker they share last).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from edgellm.ratio1.launcher import NodeOptions, Ratio1Node
from edgellm.ratio1.ports import free_port


@contextlib.contextmanager
def fleet(options: list[NodeOptions], *, node_class: type[Ratio1Node] = Ratio1Node) -> Iterator[list[Ratio1Node]]:
    """Several offline nodes on one broker, ChainStore replicating between them (request balancing's
    ground), as notes/ratio1_balancing.md 2.3 found it works offline: every node's key is made before
    any node starts, so each one's whitelist (authorized_addrs: its default ChainStore peers) names all
    the others; node 0 starts the broker and the others use its port; CHAIN_STORE_BASE runs on each.
    Yields the started nodes; on exit (a failed start included) they stop together, the broker last."""
    options = [copy.copy(o) for o in options]
    mqtt_port = options[0].mqtt_port or free_port()
    for i, o in enumerate(options):
        o.chainstore = True
        o.mqtt_port, o.broker_port = (mqtt_port, None) if i == 0 else (None, mqtt_port)
    nodes = [node_class(o) for o in options]
    with ThreadPoolExecutor(len(nodes)) as pool:  # each key is a Python start of its own (~1-2 s): together
        list(pool.map(lambda node: node.make_key(), nodes))
    for node in nodes:
        node.options.peers = [f"{peer.address} {peer.options.node_id}" for peer in nodes if peer is not node]
    try:
        # Every node boots at once (node 0's broker listens before launch() returns, so the others find
        # it); then each is waited for. One after the other, each would wait out the boots before it.
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_ready()
        yield nodes
    finally:
        # Each node takes ~20 s to shut down: all at once, and the broker they share only after them.
        stoppers = [threading.Thread(target=node.stop, kwargs={"broker": False}) for node in nodes]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        nodes[0].stop_broker()

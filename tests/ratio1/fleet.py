"""A fleet of real offline Ratio1 nodes for the tests: edgellm.ratio1.launcher.fleet (one broker, keys made
first, each node whitelisting the others, ChainStore running) with the tests' own kind of node:
WatchedRatio1Node (a killed test run leaves none behind) and the test-only plugins linked in
(node_plugins), both from tests/ratio1/test_node_integration.py.

start() of a node returns as soon as its process runs when its pipelines hold no API instance; the test
then waits for its own sign of life (e.g. the chainstore probe's output file).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from edgellm.ratio1 import launcher
from edgellm.ratio1.launcher import NodeOptions, Ratio1Node
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
    with launcher.fleet(options, node_class=WatchedRatio1Node) as nodes:
        yield nodes

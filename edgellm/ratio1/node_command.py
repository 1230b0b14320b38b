"""`edgellm ratio1-node`, the command: the node's interpreter (--venv, $EDGELLM_RATIO1_PYTHON, or this one),
its work dir (default ~/.local/state/edgellm/ratio1-node), one node started in the foreground and stopped
cleanly on Ctrl-C or SIGTERM.

Separate from launcher.py (the `Ratio1Node` the tests and tools drive too): this is what only the command
decides, where the node's venv and folder come from and how a terminal session ends it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from edgellm.errors import Ratio1NodeError
from edgellm.ratio1.launcher import NodeOptions, Ratio1Node


def node_python(venv: str | None = None) -> str:
    """The interpreter that runs the node: --venv, else $EDGELLM_RATIO1_PYTHON, else this one if it has
    naeural-core (pip install 'edgellm[ratio1]')."""
    if venv:
        python = Path(venv) / "bin" / "python"
        if not python.exists():
            raise Ratio1NodeError(f"{venv} is not a venv (no bin/python); create one with tools/ratio1_venv.sh")
        candidates = [str(python)]
    elif os.environ.get("EDGELLM_RATIO1_PYTHON"):
        candidates = [os.environ["EDGELLM_RATIO1_PYTHON"]]
    else:
        candidates = [sys.executable]
    python = candidates[0]
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('naeural_core') is None)"
    try:
        ok = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        raise Ratio1NodeError(
            f"{python} has no naeural-core: pip install 'edgellm[ratio1]' there, or build the node venv with "
            "tools/ratio1_venv.sh (make ratio1-setup) and pass --venv PATH or set EDGELLM_RATIO1_PYTHON"
        )
    return python


def run(venv: str | None, port: int | None, workdir: str | None, mqtt_port: int | None, pipelines: str | None) -> int:
    """The command: start, print where it listens, serve until Ctrl-C / SIGTERM, stop cleanly."""
    options = NodeOptions(
        python=node_python(venv),
        workdir=Path(workdir or default_workdir()),
        port=port,
        mqtt_port=mqtt_port,
        pipelines_dir=Path(pipelines) if pipelines else None,
    )
    node = Ratio1Node(options)
    stopping = {"signal": None}

    def on_signal(signum, frame):
        stopping["signal"] = signum
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"edgellm ratio1-node: starting in {node.workdir} (log: {node.log_path})", file=sys.stderr)
        node.start()
        for inst in node.instances:
            print(f"{inst.pipeline}/{inst.instance_id}: {inst.base_url}", file=sys.stderr)
        print(f"edgellm ratio1-node: ready in {node.ready_s:.1f} s; Ctrl-C stops it", file=sys.stderr)
        print(node.port, flush=True)  # stdout: the HTTP port alone, for scripts
        while node.node.poll() is None:
            time.sleep(0.5)
        print(f"edgellm ratio1-node: the node exited with {node.node.returncode}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("edgellm ratio1-node: stopping...", file=sys.stderr)
        return 0
    finally:
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        node.stop()
        for s, h in previous.items():
            signal.signal(s, h)


def default_workdir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "edgellm", "ratio1-node")

"""One real, offline Ratio1 (naeural-core) edge node serving this repo's plugins: `Ratio1Node`, behind
`edgellm ratio1-node` (ratio1/node_command.py), the Ratio1 tests and the fleet (ratio1/node_fleet.py).

It starts a local MQTT broker (mosquitto, the Debian package) on loopback, has the work dir written
(ratio1/workdir.py: configs/ratio1/ rendered, this checkout's `extensions/` and `plugins/` linked, the
LLM_INFERENCE_API alias where a pipeline names it), starts the node from its own venv in a new session,
waits until the first EDGELLM_INFERENCE_API instance answers GET /health with 200, and stops everything
on request: the processes, their start, their wait and their end are this module's.

The node runs in a separate interpreter (its venv holds naeural-core and torch, ~7 GB; see
tools/ratio1_venv.sh); this module never imports naeural_core. The node's PYTHONPATH starts with this
checkout, so it runs this code even when its venv was built from another clone.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgellm.errors import Ratio1NodeError
from edgellm.ratio1.ports import free_port, port_free
from edgellm.ratio1.workdir import (
    API_SIGNATURE,
    REPO_ROOT,
    ApiInstance,
    api_instances,
    link_sources,
    make_node_key,
    names_alias,
    pipelines_for,
    render,
    write_peers,
)

DEFAULT_MQTT_PORT = 1883
NODE_ENV = {
    # Offline: no VPN, no blockchain RPC, no dAuth, no tunnels, no supervisor role.
    "EE_VPN_IMPL": "true",
    "EE_ETH_ENABLED": "false",
    "EE_DAUTH_URL": "N/A",
    "EE_DEVICE": "cpu",
    "EE_TUNNEL_ENGINE": "none",
    "EE_SUPERVISOR": "false",
    "PYTHONUNBUFFERED": "1",
}


@dataclass
class NodeOptions:
    python: str  # the interpreter of the node's venv (naeural-core installed)
    workdir: Path
    port: int | None = None  # PORT of the first EDGELLM_INFERENCE_API instance (default: the pipeline file's)
    mqtt_port: int | None = None  # None: 1883 when free, else any free loopback port
    node_id: str = "edgellm-node"
    pipelines: list[dict[str, Any]] | None = None  # None: the files in configs/ratio1/pipelines/
    pipelines_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the node (e.g. a token variable)
    # The LLM_INFERENCE_API alias: None = when a pipeline names that signature (this offline node has no
    # upstream plugin of that name to shadow), True/False = always/never.
    alias: bool | None = None
    ready_timeout_s: float = 300.0
    stop_timeout_s: float = 60.0
    # A fleet of nodes on one broker (tests/ratio1/fleet.py). The defaults are the single node above.
    broker_port: int | None = None  # an MQTT broker already listening here: this node neither starts nor stops one
    chainstore: bool = False  # CHAIN_STORE_BASE unpaused (CHAINSTORE_ADMIN): chainstore_* writes reach the peers
    # Lines of _local_cache/authorized_addrs ("0xai_<address> [alias]"), written before start: the node's default
    # ChainStore peers. Empty: the file is left as it is (the node creates it empty).
    peers: list[str] = field(default_factory=list)
    # False: pipelines without an API instance are allowed (e.g. only a test plugin); start() then returns once
    # the node process runs, and the caller waits for its own sign of life (no HTTP port to poll).
    require_api: bool = True


def find_mosquitto() -> str:
    found = shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)), None
    )
    if found is None:
        raise Ratio1NodeError(
            "mosquitto (the MQTT broker the offline node talks to) is not installed: "
            "sudo apt-get install mosquitto (or `make ratio1-setup`)"
        )
    return found


class Ratio1Node:
    """One offline node and its broker: start() -> ready; stop() -> both gone (also as a context manager)."""

    def __init__(self, options: NodeOptions):
        self.options = options
        self.workdir = Path(options.workdir).resolve()
        self.log_path = self.workdir / "node.log"
        self.mqtt_log_path = self.workdir / "mosquitto.log"
        self.node: subprocess.Popen | None = None
        self.broker: subprocess.Popen | None = None
        self.mqtt_port: int | None = None
        self.instances: list[ApiInstance] = []
        self.started_at: float | None = None
        self.ready_s: float | None = None
        self.address: str | None = None  # the node's 0xai_ address, once make_key() made (or loaded) its key

    def make_key(self) -> str:
        """Make (or load) the node's key before start; sets and returns `address`."""
        self.address = make_node_key(self.options.python, self.workdir)
        return self.address

    # -- paths the tests and the command print -------------------------------------------------
    @property
    def base_url(self) -> str:
        return self.instances[0].base_url

    @property
    def port(self) -> int:
        return self.instances[0].port

    @property
    def output_dir(self) -> Path:
        """The node's output folder (plugins write files there: get_output_folder())."""
        return self.workdir / "_local_cache" / "_output"

    # -- start -----------------------------------------------------------------------------------
    def start(self) -> Ratio1Node:
        """launch(), then wait_ready(): the node serves when this returns."""
        return self.launch().wait_ready()

    def launch(self) -> Ratio1Node:
        """Render the work dir and start the broker (if this node owns it) and the node process, without
        waiting for the node to serve (wait_ready() does): a fleet's nodes boot side by side."""
        own_broker = self.options.broker_port is None
        mosquitto = find_mosquitto() if own_broker else None
        if not (REPO_ROOT / "extensions").is_dir():
            raise Ratio1NodeError(
                f"{REPO_ROOT / 'extensions'} is missing: the node loads the plugins from a source checkout of edgellm"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        o = self.options
        pipelines = pipelines_for(o.pipelines, o.pipelines_dir, o.port)
        self.instances = api_instances(pipelines)
        if not self.instances and self.options.require_api:
            raise Ratio1NodeError(f"no {API_SIGNATURE} instance with a PORT in the pipelines")
        for inst in self.instances:
            if not port_free(inst.port):
                raise Ratio1NodeError(
                    f"port {inst.port} ({inst.pipeline}/{inst.instance_id}) is in use; pass --port or edit the pipeline"
                )
        self.mqtt_port = self._choose_mqtt_port() if own_broker else self._shared_broker_port()
        link_sources(self.workdir, alias=names_alias(pipelines) if o.alias is None else o.alias)
        startup = render(self.workdir, pipelines, mqtt_port=self.mqtt_port, node_id=o.node_id, chainstore=o.chainstore)
        write_peers(self.workdir, o.peers)
        self.started_at = time.monotonic()
        try:
            if own_broker:
                self._start_broker(mosquitto)
            self._start_node(startup)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> Ratio1Node:
        """Until the first API instance answers GET /health with 200 (no wait without one); sets ready_s.
        The node is stopped when it does not get there."""
        try:
            if self.instances:
                self.wait_http(self.instances[0], timeout_s=self.options.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - self.started_at
        return self

    def _choose_mqtt_port(self) -> int:
        wanted = self.options.mqtt_port
        if wanted is not None:
            if not port_free(wanted):
                raise Ratio1NodeError(f"MQTT port {wanted} is in use; pass another --mqtt-port")
            return wanted
        return DEFAULT_MQTT_PORT if port_free(DEFAULT_MQTT_PORT) else free_port()

    def _shared_broker_port(self) -> int:
        """broker_port: another node's broker, which must already listen (a clear error here beats a node
        that retries its MQTT connection forever)."""
        port = self.options.broker_port
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except OSError:
            raise Ratio1NodeError(f"no MQTT broker listens on 127.0.0.1:{port} (broker_port)") from None
        return port

    def _start_broker(self, mosquitto: str) -> None:
        conf = self.workdir / "mosquitto.conf"
        lines = [
            "# offline broker for the node: loopback only, no auth, no persistence",
            f"listener {self.mqtt_port} 127.0.0.1",
            "allow_anonymous true",
            "persistence false",
            "log_dest stdout",
        ]
        if os.geteuid() == 0:  # as root, mosquitto would switch to the `mosquitto` user
            lines.append("user root")
        conf.write_text("\n".join(lines) + "\n")
        log = open(self.mqtt_log_path, "ab")
        self.broker = subprocess.Popen(
            [mosquitto, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.broker.poll() is not None:
                raise Ratio1NodeError(f"mosquitto exited with {self.broker.returncode}:\n{_tail(self.mqtt_log_path)}")
            try:
                socket.create_connection(("127.0.0.1", self.mqtt_port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise Ratio1NodeError(f"mosquitto did not listen on 127.0.0.1:{self.mqtt_port}:\n{_tail(self.mqtt_log_path)}")

    def _start_node(self, startup: Path) -> None:
        python = self.options.python
        env = {**os.environ, **NODE_ENV, **self.options.env}
        env.update({"EE_ID": self.options.node_id, "EE_CONFIG": str(startup)})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env["PATH"] = os.pathsep.join((str(Path(python).parent), env.get("PATH", "")))
        log = open(self.log_path, "ab")
        self.node = subprocess.Popen(
            [python, "run_node.py"],
            cwd=self.workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stop() signals the node and all it started
        )

    def wait_http(self, instance: ApiInstance, *, timeout_s: float, path: str = "/health", ok=(200,)) -> int:
        """Poll an instance until `path` answers with a status in `ok`; the node dying ends the wait."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.node is None or self.node.poll() is not None:
                code = self.node.returncode if self.node else None
                raise Ratio1NodeError(f"the node exited with {code} before it was ready:\n{_tail(self.log_path)}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", instance.port, timeout=5)
                conn.request("GET", path)
                status = conn.getresponse().status
                conn.close()
                if status in ok:
                    return status
                last = f"HTTP {status}"
            except OSError as exc:
                last = type(exc).__name__
            time.sleep(0.1)
        raise Ratio1NodeError(
            f"{instance.base_url}{path} not ready after {timeout_s:g} s ({last}):\n{_tail(self.log_path)}"
        )

    # -- stop ------------------------------------------------------------------------------------
    def stop(self, *, broker: bool = True) -> None:
        """SIGINT to the node's process group (its clean shutdown: plugins close, engines stop), SIGKILL
        for what is left after stop_timeout_s; then the broker, if this node started it (`broker`: False
        leaves it running for the other nodes of a fleet still stopping; stop_broker() ends it)."""
        if self.node is not None and self.node.poll() is None:
            _signal_group(self.node.pid, signal.SIGINT)
            try:
                self.node.wait(self.options.stop_timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.node.pid, signal.SIGKILL)
                self.node.wait(10)
        if self.node is not None:
            _reap_group(self.node.pid)
        if broker:
            self.stop_broker()

    def stop_broker(self) -> None:
        if self.broker is not None and self.broker.poll() is None:
            self.broker.terminate()
            try:
                self.broker.wait(10)
            except subprocess.TimeoutExpired:
                self.broker.kill()
                self.broker.wait(5)

    def __enter__(self) -> Ratio1Node:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _reap_group(pgid: int, grace_s: float = 10.0) -> None:
    """Children of the node (uvicorn, engine workers) left in its group: give them a moment, then kill."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    _signal_group(pgid, signal.SIGKILL)


def _tail(path: Path, n: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""

"""Start the real node (`python -m edgellm serve`) as a subprocess on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeProcess:
    def __init__(self, state_dir: Path, *args: str, env: dict[str, str] | None = None, port: int | None = None):
        self.state_dir = Path(state_dir)
        self.port = port or free_port()
        self.args = list(args)
        # Only what the test passes: a token or config in the developer's shell must not leak in.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("EDGELLM_") and k != "INFERENCE_API_TOKEN"}
        self.env = {**inherited, **(env or {})}
        self.log_path = self.state_dir / f"node-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.base = f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True, timeout: float = 120.0) -> NodeProcess:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        cmd = [
            sys.executable,
            "-m",
            "edgellm",
            "serve",
            "--port",
            str(self.port),
            "--state-dir",
            str(self.state_dir),
            *self.args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.base + "/health", timeout=2)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"node not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:] if self.log_path.exists() else ""

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=kw.pop("timeout", 120), **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def worker_pid(self) -> int:
        return httpx.get(self.base + "/health", timeout=5).json()["result"]["engine"]["worker_pid"]


def default_sigint() -> None:
    """Popen preexec_fn: a test run started in the background (nohup, `cmd &`) inherits SIGINT ignored,
    and Python then installs no KeyboardInterrupt handler; the Ctrl-C tests need the real default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

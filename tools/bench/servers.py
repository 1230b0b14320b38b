"""The servers a benchmark measures: an edgellm node (`edgellm serve`) or llama.cpp's llama-server, each a
subprocess on a free loopback port, started, waited for, paused between turns and stopped.

A `Server` leads its own process group (an edgellm node's engine worker is in it), dies with the benchmark
(PDEATHSIG), and is stopped at exit or on Ctrl-C/SIGTERM/SIGHUP (`run_main`). Pausing (SIGSTOP on the
group) is how two servers take turns on the same cores without sharing them: only one runs at a time.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from edgellm.ratio1.ports import free_port
from edgellm.runtime.model_sizing import bundled_model_path
from edgellm.runtime.supervision.child_process import die_with_parent

__all__ = [
    "ABORT",
    "EdgellmNode",
    "LlamaServer",
    "Server",
    "clean_env",
    "llama_binaries",
    "model_and_env",
    "pss_mb",
    "rss_mb",
    "run_main",
    "stop_all",
    "tree_pids",
]

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "tools" / "llama_server_build.sh"
READY_TIMEOUT_S = 300.0  # a model load and the engine's self-test on a slow 2-core machine, with margin

ABORT = threading.Event()  # set on Ctrl-C/SIGTERM: a load's clients send nothing more
_LIVE: list[Server] = []  # started and not yet stopped: what stop_all() stops


# -- process readings -----------------------------------------------------------------------------
def tree_pids(root: int) -> list[int]:
    """`root` and its live descendants (psutil when installed, else /proc's parent pids); [] once it is gone."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return [root, *(c.pid for c in psutil.Process(root).children(recursive=True))]
        except psutil.Error:
            return []
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X"):  # a zombie holds no memory
            children.setdefault(int(fields[1]), []).append(int(name))
    if not os.path.exists(f"/proc/{root}"):
        return []
    found, todo = [root], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _proc_kb(pids: list[int], file: str, key: str) -> float:
    """The sum over `pids` of one "Key:  N kB" line of /proc/<pid>/<file>, in MB (a process gone is 0)."""
    total_kb = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
                if line.startswith(key):
                    total_kb += int(line.split()[1])
                    break
        except (OSError, ValueError):
            pass
    return total_kb / 1024


def rss_mb(pids: list[int]) -> float:
    """Resident memory of these processes, in MB (shared pages counted in each: see pss_mb)."""
    return _proc_kb(pids, "status", "VmRSS:")


def pss_mb(pids: list[int]) -> float:
    """Proportional set size of these processes, in MB: each shared page split among its sharers."""
    return _proc_kb(pids, "smaps_rollup", "Pss:")


# -- one server -----------------------------------------------------------------------------------
def clean_env() -> dict[str, str]:
    """This process's environment without either server's settings (a benchmark sets its own; a token or
    config in the developer's shell must not leak in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EDGELLM_", "LLAMA_ARG_"))}
    env.pop("INFERENCE_API_TOKEN", None)
    return env


class Server:
    """One server process, leading its own process group (its children are in it)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log_path: Path):
        self.name, self.cmd, self.env, self.port, self.log_path = name, cmd, env, port, log_path
        self.base = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None  # process start to the first /health 200, of the last start
        self.model_id: str | None = None  # the first id of /v1/models
        self.paused = False
        self.health: list[dict] = []  # what a benchmark chose to keep of /health along the way

    def start(self, timeout: float = READY_TIMEOUT_S) -> Server:
        """Start the process and wait until /health answers 200 (`ready_s`); raises RuntimeError with the
        log's tail when it exits first or is not healthy within `timeout` s."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            t0 = time.monotonic()
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        _LIVE.append(self)
        self.ready_s = self.wait_healthy(timeout, since=t0)
        models = httpx.get(self.base + "/v1/models", timeout=30).json()
        self.model_id = models["data"][0]["id"]
        return self

    def wait_healthy(self, timeout: float, since: float | None = None) -> float:
        """Seconds from `since` (default: now) to the first /health 200."""
        start = time.monotonic() if since is None else since
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); log:\n{self.log_tail()}")
            try:
                r = httpx.get(self.base + "/health", timeout=2.0)
                if r.status_code == 200:
                    return time.monotonic() - start
                last = f"HTTP {r.status_code}: {r.text[:300]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not healthy after {timeout:g} s ({last}); log:\n{self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def pids(self) -> list[int]:
        return tree_pids(self.proc.pid) if self.proc else []

    def client(self, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=timeout)

    def chat(self, body: dict, timeout: float = 600) -> httpx.Response:
        """POST /v1/chat/completions with this server's model."""
        return httpx.post(self.base + "/v1/chat/completions", json={"model": self.model_id, **body}, timeout=timeout)

    def _signal(self, sig: int) -> None:
        if self.proc is None:
            return
        targets = set(self.pids())
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        for pid in targets - {self.proc.pid}:  # a child that left the group still belongs to this server
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.paused = False
        self.wait_healthy(60)

    @contextlib.contextmanager
    def turn(self, pause_after: bool = True) -> Iterator[Server]:
        """Resumed (if paused) for the block, paused again after it: the other server's turn is its own."""
        if self.paused:
            self.resume()
        try:
            yield self
        finally:
            if pause_after and self.proc is not None and self.proc.poll() is None:
                self.pause()

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM, `grace_s` to exit, then SIGKILL for whatever is left of the group."""
        if self.proc is None:
            return
        self._signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        self.paused = False
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if self in _LIVE:
            _LIVE.remove(self)


class EdgellmNode(Server):
    """`edgellm serve` on a free port, its state (and log) in `folder`; `args` go to `serve`, `env` over
    clean_env()."""

    def __init__(self, folder: Path, *args: str, env: dict[str, str] | None = None, name: str = "edgellm"):
        port = free_port()
        binary = REPO / ".venv" / "bin" / "edgellm"
        cmd = [str(binary)] if binary.exists() else [sys.executable, "-m", "edgellm"]
        cmd += ["serve", "--host", "127.0.0.1", "--port", str(port), "--state-dir", str(Path(folder) / "state")]
        super().__init__(name, [*cmd, *args], {**clean_env(), **(env or {})}, port, Path(folder) / f"{name}.log")

    @classmethod
    def sized(
        cls, folder: Path, model: str, threads: int, slots: int, n_ctx: int, extra_env: dict[str, str]
    ) -> EdgellmNode:
        """A node set as LlamaServer is: this model, threads, slots and KV cells (the settings through
        the environment, so --edgellm-env can override any of them)."""
        env = {
            "EDGELLM_MODEL_PATH": model,
            "EDGELLM_N_THREADS": str(threads),
            "EDGELLM_N_SLOTS": str(slots),
            "EDGELLM_N_CTX": str(n_ctx),
            **extra_env,
        }
        return cls(folder, "--log-level", "warning", env=env)

    def engine(self) -> dict:
        """/health's engine part (worker pid, restarts, resident models ...)."""
        return httpx.get(self.base + "/health", timeout=10).json()["result"]["engine"]

    def worker_pid(self) -> int:
        return int(self.engine()["worker_pid"])


class LlamaServer(Server):
    """llama-server on a free port, set as EdgellmNode.sized's node is (its KV layout included)."""

    def __init__(
        self, binary: Path, model: str, threads: int, slots: int, n_ctx: int, unified: bool, extra: list, folder: Path
    ):
        port = free_port()
        cmd = [str(binary), "-m", model, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(n_ctx)]
        cmd += ["--kv-unified" if unified else "--no-kv-unified", "-fa", "on", "--no-webui", *extra]
        super().__init__("llama-server", cmd, clean_env(), port, Path(folder) / "llama-server.log")


# -- what a benchmark needs to start them ---------------------------------------------------------
def model_and_env(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, dict[str, str]]:
    """The model file (--model, else the bundled one) and edgellm's extra environment (--edgellm-env)."""
    model = str(Path(args.model or bundled_model_path() or "").resolve())
    if not Path(model).is_file():
        ap.error(f"no model at {model!r}")
    extra_env = {}
    for kv in args.edgellm_env:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            ap.error(f"--edgellm-env wants KEY=VAL, got {kv!r}")
        extra_env[key] = value
    return model, extra_env


def llama_binaries(server: str | None, batched_bench: str | None = None) -> tuple[Path, Path | None, dict]:
    """(llama-server, llama-batched-bench or None, what to record of them): the binaries given, else the
    ones tools/llama_server_build.sh builds once from the pinned llama-cpp-python's sdist (then cached)."""
    if server:
        binary = Path(server).resolve()
        bench = Path(batched_bench).resolve() if batched_bench else binary.with_name("llama-batched-bench")
        return binary, bench if bench.exists() else None, {"llama_server": str(binary)}
    t0 = time.monotonic()
    print(f"llama-server: {BUILD_SCRIPT.name} (builds once: 10-30 min on 2 cores, niced)", flush=True)
    out = subprocess.run([str(BUILD_SCRIPT)], check=True, stdout=subprocess.PIPE, text=True).stdout
    folder = Path(out.strip().splitlines()[-1])
    info = {"llama_server": str(folder / "bin" / "llama-server"), "took_s": time.monotonic() - t0}
    try:
        info["build"] = json.loads((folder / "build.json").read_text())
    except (OSError, ValueError):
        pass
    bench = folder / "bin" / "llama-batched-bench"
    return folder / "bin" / "llama-server", bench if bench.exists() else None, info


# -- stopping them whatever happens ---------------------------------------------------------------
def stop_all() -> None:
    """Stop every server still running: after an interrupt one may be busy with requests nobody waits
    for, so a short grace there, then SIGKILL."""
    grace_s = 5.0 if ABORT.is_set() else 30.0
    for server in list(_LIVE):
        t0 = time.monotonic()
        try:
            server.stop(grace_s)
            if ABORT.is_set():
                print(f"{server.name} stopped in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - keep stopping the others
            print(f"stopping {server.name}: {exc}", file=sys.stderr)


def _on_signal(signum: int, _frame: object) -> None:
    ABORT.set()
    raise KeyboardInterrupt(f"signal {signum}")


def run_main(main: Callable[[], int]) -> None:
    """Exit with main()'s status; on Ctrl-C, SIGTERM or SIGHUP stop every server first.

    SIGINT is installed too: a run started in the background (nohup, `cmd &`) inherits it ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    atexit.register(stop_all)
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        stop_all()
        print(f"\ninterrupted ({exc or 'Ctrl-C'}); servers stopped", file=sys.stderr)
        sys.exit(130)

"""What an engine start checked and measured, kept for the next start with the same build, CPU and model.

Two things make up most of an engine's start besides loading the model (on a 2-core CPU, of ~5 s to
ready): the self-test (engine/self_test.py, the crash guard: ~1.1-1.6 s) and the decode-cost probe
(engine/decode_cost.py, the start of speculation's cost table: ~0.5 s). Neither says anything new when
nothing it depends on changed. So a start whose self-test passed writes, under a key of all of that
(`start_key`), the self-test's result and the probe's table to `<state_dir>/engine-start.json`; a start
that finds its key there skips both (the table goes on being updated by the steps, as after a probe).

The key holds what we know to make a kernel crash or change its speed: a rebuilt or reinstalled
llama.cpp (the native libraries the process has mapped: llama, ggml, mtmd, CUDA, OpenMP, each by path,
size and mtime, wherever LLAMA_CPP_LIB_PATH put them), the CPU (its flags, and the features ggml found
at run time: a VM moved to an AMX host), the kernel, the board, the GPUs and the NVIDIA driver, the model
file, context, offload, the threads actually used and the CPUs the process may run on, batch, slots and
the self-test's real size, and edgellm's version.
Only a pass is written: a build that crashes in the self-test is tested at every start. An unreadable
or foreign file counts as no record (and is replaced at the next pass).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import time

import llama_cpp as L

from edgellm import __version__
from edgellm.engine.kv_fingerprint import fingerprint_parts
from edgellm.engine.self_test import self_test_size

RECORD_FORMAT = 1
MAX_RECORDED = 16  # starts kept: a node sees few builds, CPUs and models
LOCK_WAIT_S = 2.0  # a writer holds the lock for one read+write of a ~kB file; longer means it is stuck

log = logging.getLogger(__name__)


class StartRecord:
    """One start's view of the record file: `earlier(model)` once the model is loaded, `save` after a
    self-test pass."""

    def __init__(self, path: str):
        self.path = path
        self._keys: dict[int, str] = {}  # by id(model): the key reads the model file's header once per start

    def earlier(self, model, max_waiting: int) -> dict | None:
        """The entry an earlier start with this key wrote ({"self_test": ..., "decode_ms": ...}), or None
        (none, the key cannot be made, or the file is not a record): never an error, the start goes on."""
        try:
            entry = self._read().get(self._key(model, max_waiting))
        except Exception as exc:  # a record must never stop a start: this one tests and measures instead
            log.warning("no start record used (%s: %s)", type(exc).__name__, exc)
            return None
        return entry if isinstance(entry, dict) and isinstance(entry.get("self_test"), dict) else None

    def save(self, model, max_waiting: int, self_test: dict, decode_ms: dict[str, float] | None) -> None:
        """Record a start whose self-test passed (the MAX_RECORDED most recently used kept); a failure is logged, never
        fatal: the next start runs the self-test again."""
        self._write(model, max_waiting, {"self_test": self_test, "decode_ms": decode_ms})

    def refresh(self, model, max_waiting: int, entry: dict) -> None:
        """A start that used `entry` (from `earlier`) marks it as used now, so that the MAX_RECORDED cap
        drops the starts least recently used, not the ones first recorded."""
        self._write(model, max_waiting, {"self_test": entry.get("self_test"), "decode_ms": entry.get("decode_ms")})

    def _write(self, model, max_waiting: int, entry: dict) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            key = self._key(model, max_waiting)
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            # Read, change, replace under an exclusive lock on a side file: two workers (a model switch)
            # writing at once would otherwise each replace the file with its own view, losing the other's
            # entry. The lock goes with the descriptor, so a crashed writer never leaves it held.
            with open(f"{self.path}.lock", "a") as lock:
                _lock_within(lock, LOCK_WAIT_S)
                entries = {k: v for k, v in self._read().items() if isinstance(v, dict) and _is_time(v.get("at"))}
                entries[key] = {"at": time.time(), **entry}
                by_use = sorted(entries.items(), key=lambda kv: kv[1]["at"])
                body = {"format": RECORD_FORMAT, "starts": dict(by_use[-MAX_RECORDED:])}
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(body, f)
                os.replace(tmp, self.path)  # whole or not at all: a crash mid-write leaves the old record
        except Exception as exc:
            log.warning("start not recorded (%s: %s): the next start runs the self-test again", type(exc).__name__, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def _key(self, model, max_waiting: int) -> str:
        if id(model) not in self._keys:
            self._keys[id(model)] = start_key(model, max_waiting)
        return self._keys[id(model)]

    def _read(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                body = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("start record %s unreadable (%s): counted as none", self.path, exc)
            return {}
        starts = body.get("starts") if isinstance(body, dict) and body.get("format") == RECORD_FORMAT else None
        return starts if isinstance(starts, dict) else {}


def _lock_within(lock_file, wait_s: float) -> None:
    """Take the exclusive lock, waiting at most `wait_s`: a writer frozen while holding it (SIGSTOP, or
    stuck in its write) must not hold this start, which then goes on unrecorded."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"record lock held by another writer for over {wait_s:g} s") from None
            time.sleep(0.02)


def _is_time(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def start_key(model, max_waiting: int) -> str:
    """A hash of what decides whether an earlier start's self-test and probe still hold: the self-test's
    real size and edgellm's version, the model file and context (kv_fingerprint.fingerprint_parts: its
    identity, slot size, KV type, flash attention, offload), the threads, CPUs, batch and slots, the
    engine's native libraries and the hardware the kernels run on."""
    config = model.config
    parts = {
        "format": RECORD_FORMAT,
        "edgellm": __version__,
        "self_test": self_test_size(model, max_waiting),
        "model": fingerprint_parts(model),
        "n_threads": model.n_threads,  # the count in use (config.n_threads 0 means all the CPUs below)
        "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "adaptive_threads": config.adaptive_threads,
        "speculative": config.speculative,
        "n_batch": model.n_batch,
        "n_slots": model.n_slots,
        "engine_libraries": engine_libraries(),
        "hardware": hardware_identity(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


_ENGINE_LIBRARY_NAMES = ("llama", "ggml", "mtmd", "cuda", "cublas", "nvrtc", "gomp", "omp")


def engine_libraries() -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of each native library of the engine this process has mapped (Linux:
    /proc/self/maps, so a LLAMA_CPP_LIB_PATH build or the CUDA libraries count as well), else of the
    files in llama-cpp-python's lib/ folder."""
    paths: set[str] = set()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(None, 5)  # address perms offset dev inode [path]
                path = fields[5].strip() if len(fields) == 6 else ""
                name = os.path.basename(path).lower()
                if path.startswith("/") and ".so" in name and any(k in name for k in _ENGINE_LIBRARY_NAMES):
                    paths.add(path)
    except OSError:
        pass
    if not paths:
        folder = os.path.join(os.path.dirname(L.__file__), "lib")
        with os.scandir(folder) as entries:
            paths = {
                e.path for e in entries if e.is_file() and (".so" in e.name or e.name.endswith((".dylib", ".dll")))
            }
    found = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:  # mapped, then replaced on disk: the change itself is news
            found.append((path, -1, -1))
            continue
        found.append((path, st.st_size, st.st_mtime_ns))
    return sorted(found)


_CPU_FIELDS = ("vendor_id", "model name", "flags", "CPU implementer", "CPU part", "Features")


def hardware_identity() -> dict[str, str]:
    """The CPU (its model and feature flags, from /proc/cpuinfo: the AMX flags are among them), the board
    (a Jetson's device-tree model) and the NVIDIA GPUs the driver lists; what a platform lacks is left out."""
    found = {"machine": platform.machine(), "kernel": platform.release(), "cpus": str(os.cpu_count())}
    try:
        found["ggml"] = L.llama_print_system_info().decode("utf-8", "replace")  # the features it uses here
    except Exception:  # an older binding without it: the flags below still say what the CPU has
        pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                name = name.strip()
                if sep and name in _CPU_FIELDS and name not in found:
                    found[name] = value.strip()
    except OSError:
        found["processor"] = platform.processor()
    try:
        with open("/proc/device-tree/model", "rb") as f:
            found["board"] = f.read(256).decode("utf-8", "replace").strip("\x00 \n")
    except OSError:
        pass
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as f:
            found["nvidia driver"] = f.readline().strip()
    except OSError:
        pass
    gpus = "/proc/driver/nvidia/gpus"
    try:
        for bus in sorted(os.listdir(gpus)):
            with open(os.path.join(gpus, bus, "information"), encoding="utf-8", errors="replace") as f:
                found[f"gpu {bus}"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("Model:")), "")
    except OSError:
        pass
    return found

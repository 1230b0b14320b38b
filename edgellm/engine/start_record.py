"""What an engine start checked and measured, kept for the next start with the same build, CPU and model.

Two things make up most of an engine's start besides loading the model (on a 2-core CPU, of ~5 s to
ready): the self-test (engine/self_test.py, the crash guard: ~1.1-1.6 s) and the decode-cost probe
(engine/decode_cost.py, the start of speculation's cost table: ~0.5 s). Neither says anything new when
nothing it depends on changed. So a start whose self-test passed writes, under a key of all of that
(`start_key`), the self-test's result and the probe's table to `<state_dir>/engine-start.json`; a start
that finds its key there skips both (the table goes on being updated by the steps, as after a probe).

What can make a kernel crash or change its speed is all in the key: a rebuilt or reinstalled llama.cpp
(its native libraries' sizes and mtimes), another CPU (a VM moved to an AMX host: the CPU flags),
another board or GPU, another model file, context, offload, threads, batch or slots, another edgellm.
Only a pass is written: a build that crashes in the self-test is tested at every start. An unreadable
or foreign file counts as no record (and is replaced at the next pass).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time

import llama_cpp as L

from edgellm import __version__
from edgellm.engine.prefix_store import fingerprint_parts
from edgellm.engine.self_test import SELF_TEST_MAX_SEQUENCES, SELF_TEST_NEW_TOKENS, SELF_TEST_PROMPT_TOKENS

RECORD_FORMAT = 1
MAX_RECORDED = 16  # starts kept: a node sees few builds, CPUs and models

log = logging.getLogger(__name__)


class StartRecord:
    """One start's view of the record file: `earlier(model)` once the model is loaded, `save` after a
    self-test pass."""

    def __init__(self, path: str):
        self.path = path
        self._keys: dict[int, str] = {}  # by id(model): the key reads the model file's header once per start

    def earlier(self, model) -> dict | None:
        """The entry an earlier start with this model's key wrote ({"self_test": ..., "decode_ms": ...}),
        or None (none, or the key cannot be made)."""
        try:
            key = self._key(model)
        except OSError as exc:
            log.warning("no start record used: its key could not be made (%s)", exc)
            return None
        entry = self._read().get(key)
        return entry if isinstance(entry, dict) and isinstance(entry.get("self_test"), dict) else None

    def save(self, model, self_test: dict, decode_ms: dict[str, float] | None) -> None:
        """Record a start whose self-test passed (the newest MAX_RECORDED kept); a failed write is logged,
        never fatal: the next start runs the self-test again."""
        try:
            key = self._key(model)
            entries = self._read()
            entries[key] = {"at": time.time(), "self_test": self_test, "decode_ms": decode_ms}
            newest = sorted(entries.items(), key=lambda kv: kv[1].get("at", 0) if isinstance(kv[1], dict) else 0)
            body = {"format": RECORD_FORMAT, "starts": dict(newest[-MAX_RECORDED:])}
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(body, f)
            os.replace(tmp, self.path)  # whole or not at all: a crash mid-write leaves the old record
        except OSError as exc:
            log.warning("start not recorded (%s): the next start runs the self-test again", exc)

    def _key(self, model) -> str:
        if id(model) not in self._keys:
            self._keys[id(model)] = start_key(model)
        return self._keys[id(model)]

    def _read(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                body = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("start record %s unreadable (%s): counted as none", self.path, exc)
            return {}
        starts = body.get("starts") if isinstance(body, dict) and body.get("format") == RECORD_FORMAT else None
        return starts if isinstance(starts, dict) else {}


def start_key(model) -> str:
    """A hash of what decides whether an earlier start's self-test and probe still hold: the self-test's
    shape and edgellm's version, the model file and context (prefix_store.fingerprint_parts: its identity,
    slot size, KV type, flash attention, offload), the threads, batch and slots, the engine's native
    libraries and the hardware the kernels run on."""
    config = model.config
    parts = {
        "format": RECORD_FORMAT,
        "edgellm": __version__,
        "self_test": [SELF_TEST_PROMPT_TOKENS, SELF_TEST_MAX_SEQUENCES, SELF_TEST_NEW_TOKENS],
        "model": fingerprint_parts(model),
        "n_threads": config.n_threads,
        "adaptive_threads": config.adaptive_threads,
        "speculative": config.speculative,
        "n_batch": model.n_batch,
        "n_slots": model.n_slots,
        "engine_libraries": engine_libraries(),
        "hardware": hardware_identity(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def engine_libraries() -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of each native library llama-cpp-python loads (its lib/ folder)."""
    folder = os.path.join(os.path.dirname(L.__file__), "lib")
    found = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_file() and (".so" in entry.name or entry.name.endswith((".dylib", ".dll"))):
                st = entry.stat()
                found.append((entry.name, st.st_size, st.st_mtime_ns))
    return sorted(found)


_CPU_FIELDS = ("vendor_id", "model name", "flags", "CPU implementer", "CPU part", "Features")


def hardware_identity() -> dict[str, str]:
    """The CPU (its model and feature flags, from /proc/cpuinfo: the AMX flags are among them), the board
    (a Jetson's device-tree model) and the NVIDIA GPUs the driver lists; what a platform lacks is left out."""
    found = {"machine": platform.machine(), "cpus": str(os.cpu_count())}
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
    gpus = "/proc/driver/nvidia/gpus"
    try:
        for bus in sorted(os.listdir(gpus)):
            with open(os.path.join(gpus, bus, "information"), encoding="utf-8", errors="replace") as f:
                found[f"gpu {bus}"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("Model:")), "")
    except OSError:
        pass
    return found

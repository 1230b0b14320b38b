"""The engine's start-up self-test: a decode that reaches the kernels real traffic uses.

A two-token "Hi" exercises little more than the vector kernels. A broken build of llama.cpp (its AMX
matmul, upstream issue 20824, is the case that made this exist) runs that fine and dies on the
first real prompt. So the self-test prefills several sequences of SELF_TEST_PROMPT_TOKENS tokens
each in one step (the batched matrix kernels), then samples a few tokens from each. It runs before
the worker reports READY and in `edgellm doctor`; a crash here is a crash at "warm-up", with no
client request lost to it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass

import llama_cpp as L

from edgellm import __version__
from edgellm.engine.prefix_store import fingerprint_parts
from edgellm.engine.slot import Slot, SlotState
from edgellm.engine.types import CacheCommit, EngineOutput, EngineRequest, SamplingParams

# Outside the request-id space (ids are [A-Za-z0-9._:-]), so no client request can be mistaken for one.
SELF_TEST_ID = "#self-test"
SELF_TEST_PROMPT_TOKENS = 64  # >= 64: llama.cpp's batched matmul paths, not the per-token ones
SELF_TEST_MAX_SEQUENCES = 3
SELF_TEST_NEW_TOKENS = 4
RECORD_FORMAT = 1
MAX_RECORDED = 16  # passes kept in the record: a node sees few builds, CPUs and models

log = logging.getLogger(__name__)

_WORDS = (
    "sensor camera motor battery voltage status route map signal wheel arm joint gripper frame "
    "packet relay switch valve pump fan light door field"
).split()


class SelfTestFailed(RuntimeError):
    """The engine decoded, but not correctly (an error, or no tokens)."""


@dataclass(frozen=True)
class SelfTestResult:
    sequences: int
    prefilled_together: int  # of them, prompts decoded in the first step's batch (n_batch permitting)
    prompt_tokens: int  # per sequence
    new_tokens: int  # generated, all sequences together
    ms: float

    def as_dict(self) -> dict[str, float | int]:
        return {
            "sequences": self.sequences,
            "prefilled_together": self.prefilled_together,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "ms": round(self.ms, 1),
        }


def _prompt(model, seq: int, n_tokens: int) -> str:
    """Plain words, different per sequence (no two share a prefix to reuse), at least n_tokens long
    in the model's own tokens (a few more at most: words are added 8 at a time)."""
    words: list[str] = []
    text = f"Log {seq}:"
    while len(model.tokenize(text)) < n_tokens:
        words.extend(_WORDS[(seq * 7 + (len(words) + i) * 3) % len(_WORDS)] for i in range(8))
        text = f"Log {seq}: " + " ".join(words)
    return text


class SelfTest:
    """One run of the self-test: min(n_slots, 3) prompts of ~64 tokens prefilled together, 4 tokens
    sampled from each. The engine core queues `requests`, steps them (its one loop) and feeds back
    what happens; `result()` checks it (raises SelfTestFailed when a sequence ends with an error or
    without a token)."""

    def __init__(self, model, max_waiting: int):
        # Within the slots and the queue the node was given (max_queued can be 1 or 2 on a small board).
        n_seq = max(1, min(SELF_TEST_MAX_SEQUENCES, model.n_slots, max_waiting))
        # A small context (a test config, a board preset) still gets a prompt that fits with its answer.
        # (8 words of overshoot are at most ~24 tokens.)
        self.prompt_tokens = max(8, min(SELF_TEST_PROMPT_TOKENS, model.slot_ctx - SELF_TEST_NEW_TOKENS - 32))
        self.t0 = time.perf_counter()
        self.requests = [
            EngineRequest(
                f"{SELF_TEST_ID}-{seq}",
                [{"role": "user", "content": _prompt(model, seq, self.prompt_tokens)}],
                # Sampled, not greedy: the sampler's path (top-k/top-p, the RNG) runs too. Fixed seeds.
                SamplingParams(temperature=0.8, top_p=0.95, max_tokens=SELF_TEST_NEW_TOKENS, seed=seq),
                apply_chat_template=False,
                cache_lookup=False,
                cache_commit=CacheCommit.NONE,  # nothing of it is left for a client's prompt to reuse
                speculative=False,
            )
            for seq in range(n_seq)
        ]
        self.finals: dict[str, EngineOutput] = {}
        self.together: int | None = None

    @staticmethod
    def refused(out: EngineOutput | None) -> None:
        if out is not None:
            raise SelfTestFailed(f"the engine refused its self-test request: {out.error}")

    def on_output(self, out: EngineOutput) -> None:
        if out.finished:
            self.finals[out.request_id] = out

    def after_step(self, slots: list[Slot]) -> None:
        if self.together is None:  # prompts past their prefill after the first step (or already done)
            self.together = len(self.finals) + sum(1 for slot in slots if slot.state is SlotState.DECODE)

    def result(self) -> SelfTestResult:
        new_tokens = 0
        for request in self.requests:
            rid = request.request_id
            out = self.finals.get(rid)
            if out is None or out.error:
                raise SelfTestFailed(f"self-test sequence {rid} failed: {out.error if out else 'no final output'}")
            if out.completion_tokens < 1:
                raise SelfTestFailed(f"self-test sequence {rid} generated no token")
            new_tokens += out.completion_tokens
        ms = 1000 * (time.perf_counter() - self.t0)
        return SelfTestResult(len(self.requests), self.together or 0, self.prompt_tokens, new_tokens, ms)


class SelfTestRecord:
    """The self-test passes of this node (a JSON file in the state dir), so that a restart with the same
    engine build, CPU, model and settings does not pay the self-test again (~1.1-1.6 s of the ~5 s to
    ready on a 2-core CPU). What can make a kernel crash is all in the key (`self_test_key`): a rebuilt
    or reinstalled llama.cpp, another CPU (a VM moved to an AMX host), another model file, other offload
    or batch settings each run the self-test again. Only a pass is written: a build that crashes in the
    self-test is tested at every start. An unreadable or foreign file counts as no pass (and is replaced
    at the next one)."""

    def __init__(self, path: str):
        self.path = path

    def earlier_pass(self, model) -> dict | None:
        """The result of a pass with this model's key, or None (never one, or the key cannot be made)."""
        try:
            key = self_test_key(model)
        except OSError as exc:
            log.warning("self-test runs: its record key could not be made (%s)", exc)
            return None
        entry = self._read().get(key)
        return entry.get("result") if isinstance(entry, dict) and isinstance(entry.get("result"), dict) else None

    def save(self, model, result: dict) -> None:
        """Record a pass (newest MAX_RECORDED kept); a failed write is logged, never fatal."""
        try:
            key = self_test_key(model)
            passes = self._read()
            passes[key] = {"at": time.time(), "result": result}
            newest = sorted(passes.items(), key=lambda kv: kv[1].get("at", 0) if isinstance(kv[1], dict) else 0)
            body = {"format": RECORD_FORMAT, "passes": dict(newest[-MAX_RECORDED:])}
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(body, f)
            os.replace(tmp, self.path)  # whole or not at all: a crash mid-write leaves the old record
        except OSError as exc:
            log.warning("self-test pass not recorded (%s): the next start runs it again", exc)

    def _read(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                body = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("self-test record %s unreadable (%s): counted as no pass", self.path, exc)
            return {}
        passes = body.get("passes") if isinstance(body, dict) and body.get("format") == RECORD_FORMAT else None
        return passes if isinstance(passes, dict) else {}


def self_test_key(model) -> str:
    """A hash of what decides whether a pass still holds: the self-test's shape and edgellm's version, the
    model file and context (prefix_store.fingerprint_parts: its identity, slot size, KV type, flash
    attention, offload), the threads, batch and slots, the engine's native libraries (each file's size and
    mtime: a rebuild or reinstall changes them), and the CPU and GPU the kernels run on."""
    config = model.config
    parts = {
        "format": RECORD_FORMAT,
        "edgellm": __version__,
        "shape": [SELF_TEST_PROMPT_TOKENS, SELF_TEST_MAX_SEQUENCES, SELF_TEST_NEW_TOKENS],
        "model": fingerprint_parts(model),
        "n_threads": config.n_threads,
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
    found = {"machine": platform.machine()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                name = name.strip()
                if sep and name in _CPU_FIELDS and name not in found:
                    found[name] = value.strip()
    except OSError:
        found["processor"] = platform.processor()
    for path in ("/proc/device-tree/model",):
        try:
            with open(path, "rb") as f:
                found[path] = f.read(256).decode("utf-8", "replace").strip("\x00 \n")
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

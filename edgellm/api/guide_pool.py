"""Guide checks with a budget: every schema, regex, grammar and tool schema a request brings is compiled
and checked in a child process (edgellm/engine/guide_sandbox.py) that is killed when the job spends its
CPU time or memory, or when the caller gives up (a disconnected client).

Why a process and not a thread: llguidance's compile is native code that no thread can interrupt, and a
hostile schema costs it minutes (320 patternProperties took 11 s, 640 took 122 s) or gigabytes (an anyOf of
80 counted strings: 1.6 GB). In the event loop's default thread pool such compiles held every other
route; here they hold a child of their own, a bounded number at once, and the API process's memory does
not move.

Answers are cached by the guides' content, refusals and budget overruns too: a repeated schema, hostile
or not, costs nothing the second time. One pool per process (`shared_pool()`), shared by every Service.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from edgellm.api.chat_request import ChatRequest
from edgellm.engine.guide_limits import cost_summary
from edgellm.engine.types import GuideKind, GuideSpec
from edgellm.errors import GuideError, InvalidRequest, QueueFull

log = logging.getLogger(__name__)

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_POLL_S = 0.02  # how often a running job's CPU and memory are read
_CACHE_ENTRIES = 1024


@dataclass(frozen=True)
class GuideBudget:
    """What one request's guide checks may spend. `cpu_s` is CPU time of the child (not wall time: a
    job waiting for a core on a busy board is not charged for it); `wall_s` bounds the wait anyway."""

    cpu_s: float = 2.0
    memory_bytes: int = 512 * 1024 * 1024  # growth of the child's resident memory during the job
    wall_s: float = 15.0
    workers: int = 2  # children at once: jobs beyond wait for one (a hostile burst queues here)
    max_waiting: int = 64  # jobs waiting for a child beyond this: 429


@dataclass(frozen=True)
class Check:
    """One guide to check: `label` names it in a refusal (e.g. "tools[3].function.parameters")."""

    label: str
    spec: GuideSpec
    strict: bool = False  # OpenAI's `strict`: refuse what is not enforced while generating


class _Child:
    """One guide_sandbox process and the bytes it has written that are not a whole line yet."""

    def __init__(self, memory_bytes: int):
        env = {**os.environ, "EDGELLM_GUIDE_MEMORY_BYTES": str(memory_bytes), "EDGELLM_GUIDE_PARENT": str(os.getpid())}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edgellm.engine.guide_sandbox"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
        self._buffer = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu_s(self) -> float:
        """utime + stime of the child, from /proc (0 where it cannot be read)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _CLK_TCK
        except (OSError, IndexError, ValueError):
            return 0.0

    def rss_bytes(self) -> int:
        try:
            with open(f"/proc/{self.proc.pid}/statm", "rb") as f:
                return int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            return 0

    def send(self, job: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()

    def read_line(self, timeout_s: float) -> dict | None:
        """The next line, parsed, if one is whole within `timeout_s`; None if not yet. Raises EOFError when
        the child closed its output (it died)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass


class GuidePool:
    """Children that check guides, at most `budget.workers` at once (see the module doc)."""

    def __init__(self, budget: GuideBudget | None = None):
        self.budget = budget or GuideBudget()
        self._lock = threading.Lock()
        self._idle: list[_Child] = []
        self._free = threading.Semaphore(self.budget.workers)
        self._waiting = 0
        self._cache: OrderedDict[str, dict] = OrderedDict()
        self._closed = False
        self.counts = {"jobs": 0, "cached": 0, "over_cpu": 0, "over_memory": 0, "over_wall": 0, "cancelled": 0}

    # -- the checks ----------------------------------------------------------------------------------

    def check_now(self, checks: Sequence[Check], cancelled: threading.Event | None = None) -> None:
        """Raises GuideError for the first guide refused (its label first), or for a job past its budget."""
        if not checks:
            return
        job = {"check": [[c.label, c.spec.kind.value, c.spec.spec, c.strict] for c in checks]}
        reply = self._run(job, cancelled)
        if "error" in reply:
            label = reply.get("label")
            if isinstance(label, str) and label.startswith("tools"):
                raise InvalidRequest(f"{label} is not a usable schema: {reply['error']}", param="tools")
            raise GuideError(str(reply["error"]))
        if "over" in reply:
            raise GuideError(_over_message(reply["over"], checks, self.budget), param=_param(checks[0].label))

    async def check(self, checks: Sequence[Check], disconnected: Callable[[], Awaitable[bool]] | None = None) -> None:
        """check_now off the event loop; the job is killed when the caller is cancelled or `disconnected()`
        says the client is gone (checked every 0.25 s)."""
        if not checks:
            return
        cancelled = threading.Event()
        task = asyncio.ensure_future(asyncio.to_thread(self.check_now, checks, cancelled))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if disconnected is not None and await disconnected():
                    raise GuideError("the client disconnected while its guide was being checked")
        except (asyncio.CancelledError, GuideError):
            if not task.done():
                cancelled.set()  # the job's thread kills its child and ends; its outcome is nobody's
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise

    def satisfies_now(self, spec: GuideSpec, text: str) -> bool:
        """Whether `text` is an output the guide admits (the console's check), under the same budget."""
        reply = self._run({"satisfies": [spec.kind.value, spec.spec, text]}, None)
        if "error" in reply:
            raise GuideError(str(reply["error"]))
        if "over" in reply:
            raise GuideError(_over_message(reply["over"], [Check(spec.kind.value, spec)], self.budget))
        return bool(reply["satisfies"])

    # -- running a job -------------------------------------------------------------------------------

    def _run(self, job: dict, cancelled: threading.Event | None) -> dict:
        key = hashlib.sha256(json.dumps(job, sort_keys=True).encode("utf-8", "surrogatepass")).hexdigest()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.counts["cached"] += 1
                return self._cache[key]
            if self._waiting >= self.budget.max_waiting:
                raise QueueFull("too many guides are being checked; retry shortly", retry_after_s=2)
            self._waiting += 1
        try:
            self._free.acquire()
        finally:
            with self._lock:
                self._waiting -= 1
        try:
            reply = self._run_in_child(job, cancelled)
        finally:
            self._free.release()
        if reply.get("over") != "cancelled":  # a cancelled job says nothing about the guide
            with self._lock:
                self._cache[key] = reply
                while len(self._cache) > _CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        return reply

    def _take_child(self) -> _Child:
        with self._lock:
            if self._closed:
                raise GuideError("the node is shutting down")
            while self._idle:
                child = self._idle.pop()
                if child.alive():
                    return child
                child.kill()
        child = _Child(self.budget.memory_bytes)
        try:
            hello = child.read_line(30.0)
        except (EOFError, ValueError):
            hello = None
        if not hello or not hello.get("ready"):
            child.kill()
            raise GuideError("the guide checker could not be started")
        return child

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            if not self._closed and child.alive():
                self._idle.append(child)
                return
        child.kill()

    def _run_in_child(self, job: dict, cancelled: threading.Event | None) -> dict:
        self.counts["jobs"] += 1
        child = self._take_child()
        started, cpu0, rss0 = time.monotonic(), child.cpu_s(), child.rss_bytes()
        try:
            child.send(job)
        except OSError:  # it exited between jobs (recycled): once more on a fresh one
            child.kill()
            child = self._take_child()
            started, cpu0, rss0 = time.monotonic(), child.cpu_s(), child.rss_bytes()
            child.send(job)
        over = None
        while True:
            try:
                reply = child.read_line(_POLL_S)
            except (EOFError, ValueError):
                over = "memory"  # it died mid-job: RLIMIT_AS made llguidance abort (or it was killed)
                break
            if reply is not None:
                self._give_back(child)
                return reply
            if cancelled is not None and cancelled.is_set():
                over = "cancelled"
            elif child.cpu_s() - cpu0 > self.budget.cpu_s:
                over = "cpu"
            elif child.rss_bytes() - rss0 > self.budget.memory_bytes:
                over = "memory"
            elif time.monotonic() - started > self.budget.wall_s:
                over = "wall"
            if over:
                break
        child.kill()
        self.counts[f"over_{over}" if over != "cancelled" else "cancelled"] += 1
        log.warning("guide check stopped: %s budget (%.2f s)", over, time.monotonic() - started)
        return {"over": over}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()


def _param(label: object) -> str | None:
    """The request field a check's label names: `tools` for a tool's schema; None for the request's own
    guide (response_format or guided_decoding: the error says which kind)."""
    return "tools" if isinstance(label, str) and label.startswith("tools") else None


def _over_message(over: str, checks: Sequence[Check], budget: GuideBudget) -> str:
    what = ", ".join(sorted({c.label for c in checks}))[:200]
    spent = {
        "cpu": f"took over {budget.cpu_s:g} s of CPU to compile and check",
        "memory": f"needed over {budget.memory_bytes // (1024 * 1024)} MB to compile and check",
        "wall": f"was not compiled and checked within {budget.wall_s:g} s",
        "cancelled": "was not checked: the request was cancelled",
    }[over]
    costly = "; ".join(filter(None, (cost_summary(c.spec) for c in checks)))[:400]
    hint = f"; what costs: {costly}" if costly else ""
    return f"{what} {spent} (the node's limit per request){hint}"


_shared: GuidePool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> GuidePool:
    """The process's pool, made on first use; its children are killed at exit."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = GuidePool()
            atexit.register(_shared.close)
        return _shared


def request_checks(request: ChatRequest) -> list[Check]:
    """The guides a request brings: its own constraint, then each tool's parameters schema (in order: a
    refusal names the first bad one, as `tools[i].function.parameters`), each strict where it says so."""
    guide = request.guide
    strict = bool((request.response_format or {}).get("strict"))
    checks = [Check(f"the {guide.kind.value} guide", guide, strict)] if guide is not None else []
    for i, tool in enumerate(request.tools):
        fn = tool["function"]
        spec = GuideSpec(GuideKind.JSON_SCHEMA, fn["parameters"])
        checks.append(Check(f"tools[{i}].function.parameters", spec, bool(fn.get("strict"))))
    return checks

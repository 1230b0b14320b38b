"""`edgellm batch-run`: requests.json -> results.jsonl against any OpenAI-compatible chat endpoint,
or (`--local`, batch/local.py) on the in-process engine, answered as the node's OpenAI route would.

Everything but the sending is shared: a `Transport` (HTTP: `HttpTransport`; local: `LocalTransport`)
turns pending requests into result lines, and run_batch journals, orders, resumes and exits alike.

Each finished request is appended to the journal `<out>.partial` at once (a crash loses nothing
already done); at the end, and on Ctrl-C, `<out>` is written in input order with what finished.
The journal is removed only after a run that finished every request has written `<out>` in full;
after Ctrl-C, a crash or an error it stays, and `--resume` sends only what it does not hold as
finished. A plain rerun refuses to touch a non-empty journal (`--overwrite` discards it).

Exit codes: 0 all ok, 1 some failed (the file is still complete) or the run stopped on an error
(the journal is kept), 2 unusable input, 3 the engine crashed (--local: a native fault such as
SIGSEGV; `<out>` is written from the journal by the surviving parent, write_after_crash, and the
journal is kept for --resume), 130 interrupted.
"""

from __future__ import annotations

import email.utils
import fcntl
import json
import math
import os
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Protocol

import requests
from tqdm import tqdm
from urllib3.exceptions import ConnectTimeoutError, MaxRetryError

from edgellm.errors import EdgeLLMError

# 429/503 say "come back later", 502/504 are a proxy's view of a server that is down or restarting:
# in every case the server did not produce an answer, so sending the request again is safe.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
RETRY_AFTER_STATUSES = frozenset({429, 503})  # where RFC 9110 / 6585 give Retry-After a meaning
MAX_RETRY_AFTER_S = 60.0  # a server asking for more is treated as "not now": the line fails, --resume later
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 8.0
# Codes that say the request itself is wrong: sending it again gives the same answer, so --resume keeps
# them. 408 and 429 are about timing, not the request, and are sent again like 5xx and http_code 0.
_FINAL_CLIENT_ERRORS = range(400, 500)
_TIMING_CLIENT_ERRORS = frozenset({408, 429})


class BatchInputError(EdgeLLMError):
    error_type = "batch_input"


@dataclass(frozen=True)
class BatchOptions:
    endpoint: str = ""  # the HTTP transport's; unused with --local
    concurrency: int = 4
    timeout_s: float = 600.0  # per HTTP attempt; a request's whole budget is timeout_s * (retries + 1)
    retries: int = 2
    api_key: str | None = None
    model: str | None = None  # overrides every request's model
    progress: bool = True  # a tqdm bar on stderr, when stderr is a terminal
    resume: bool = False  # keep the journal (or a finished <out>) and send only what is not finished
    overwrite: bool = False  # discard a non-empty journal instead of refusing to run


# -- input --------------------------------------------------------------------------------------


class _NonFinite:
    """What NaN/Infinity parse to, so the walk below can name where they are (json accepts them)."""

    def __init__(self, name: str):
        self.name = name


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):  # {"id": "a", "id": "b"} is read as "b" by Python, "a" by others: refuse
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise BatchInputError(f"duplicate key {_show(dup)} in an object")
    return obj


def _show(value: str) -> str:
    # repr() of a lone surrogate is printable ASCII ('\ud800'), so the message itself can be written.
    return ascii(value) if len(value) <= 60 else ascii(value[:60]) + "..."


def _bad_value(data: Any) -> tuple[str, str] | None:
    """(JSON path, problem) of the first value no HTTP server could be sent as valid JSON, or None.

    Iterative: json.loads accepts nesting close to the recursion limit, a recursive walk would not.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _NonFinite):
            return path, f"{value.name} is not valid JSON (use null or a number)"
        if isinstance(value, float) and not math.isfinite(value):
            return path, "a number too large for a double (it would be sent as Infinity)"
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path, f"{_show(value)} has a lone surrogate (\\ud800-\\udfff escape), not valid Unicode"
        elif isinstance(value, dict):
            for k, v in reversed(value.items()):
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return path, f"the key {_show(k)} has a lone surrogate, not valid Unicode"
                stack.append((f"{path}.{k}", v))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return None


def load_requests(path: Path) -> list[dict[str, Any]]:
    """The requests of `path`, or BatchInputError naming the first problem (never another exception)."""
    try:
        # utf-8-sig: a BOM (some Windows editors add one) is not an error worth stopping for.
        text = Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise BatchInputError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise BatchInputError(f"{path}: not valid JSON (not UTF-8: {exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise BatchInputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        data = json.loads(text, parse_constant=_NonFinite, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise BatchInputError(f"{path}: not valid JSON ({exc})") from None
    except BatchInputError as exc:
        raise BatchInputError(f"{path}: {exc.message}") from None
    except RecursionError:
        raise BatchInputError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # an integer literal over Python's 4300-digit limit
        if "integer string conversion" in str(exc):  # worded differently by each Python version
            limit = sys.get_int_max_str_digits()
            raise BatchInputError(f"{path}: not valid JSON (an integer has more than {limit} digits)") from None
        raise BatchInputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise BatchInputError(f'{path}: expected a JSON object with a "requests" array')
    seen: dict[str, int] = {}
    for i, req in enumerate(data["requests"]):
        if not isinstance(req, dict):
            raise BatchInputError(f"{path}: requests[{i}] is not an object")
        rid = req.get("id")
        if isinstance(rid, bool) or not isinstance(rid, str | int) or (isinstance(rid, str) and not rid.strip()):
            raise BatchInputError(f'{path}: requests[{i}] has no "id" (a non-empty string or an integer)')
        bad = _bad_value(req)
        if bad is not None:
            raise BatchInputError(f"{path}: requests[{i}]{bad[0]}: {bad[1]}")
        key = str(rid)
        if key in seen:
            raise BatchInputError(f"{path}: duplicate id {rid!r} (requests[{seen[key]}] and requests[{i}])")
        seen[key] = i
    if not data["requests"]:
        raise BatchInputError(f"{path}: the requests array is empty")
    return data["requests"]


def chat_url(endpoint: str) -> str:
    """Accepts the full chat URL, an API base ending in /v1, or a server root."""
    url = endpoint.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


# -- sending ------------------------------------------------------------------------------------


def _strict_json(raw: bytes) -> Any:
    """A response body as JSON; ValueError for anything results.jsonl could not hold as valid JSON."""

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(raw, parse_constant=no_constant)
    except RecursionError:  # a hostile or broken server must cost one line, not the run
        raise ValueError("nested too deeply") from None


def wire_body(req: dict[str, Any], model: str | None) -> bytes:
    """The body POSTed for a request: its fields but `id`, `model` replaced when given, encoded as
    `requests` encodes json= (the local transport measures and parses these same bytes)."""
    body = {k: v for k, v in req.items() if k != "id"}
    if model:
        body["model"] = model
    return json.dumps(body, allow_nan=False).encode("utf-8")


def error_message(body: Any) -> str:
    """The error text of a (parsed) error answer: OpenAI's error.message, else what there is."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err)[:500]
    return str(err or body)[:500]


def answer_outcome(code: int, raw: bytes) -> dict[str, Any]:
    """status / http_code / response | error of a JSON answer; a 2xx that is not JSON is an error line."""
    if 200 <= code < 300:
        try:
            return {"status": "ok", "http_code": code, "response": _strict_json(raw)}
        except ValueError as exc:
            return {"status": "error", "http_code": code, "error": f"response is not JSON ({exc})"}
    try:
        body = _strict_json(raw)
    except ValueError:
        body = raw.decode("utf-8", "replace")
    return {"status": "error", "http_code": code, "error": error_message(body)}


def _error_text(resp: requests.Response) -> str:
    try:
        body = _strict_json(resp.content)
    except ValueError:
        return resp.text[:500] or resp.reason
    return error_message(body)


def retry_after_s(value: str | None) -> float | None:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP-date), None when absent/unreadable."""
    if not value:
        return None
    value = value.strip()
    if re.fullmatch(r"[0-9]{1,9}(\.[0-9]{1,6})?", value):  # bounded: a 5000-digit value is not a number to us
        return float(value)
    if re.fullmatch(r"[0-9]+", value):
        return float("inf")
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def never_sent(exc: requests.RequestException) -> bool:
    """True only when the request provably did not reach the server: the connection was never made.

    A read timeout, or a connection dropped after the request went out, may mean the server is still
    generating (and will finish, costing the same tokens again if we re-send): those are not retried.
    requests raises ConnectionError for both a refused connect and a dropped one; only the first
    carries urllib3's MaxRetryError(reason=NewConnectionError / ConnectTimeoutError).
    """
    if isinstance(exc, requests.ConnectTimeout):
        return True
    if not isinstance(exc, requests.ConnectionError) or isinstance(exc, requests.exceptions.SSLError):
        return False
    reason = exc.args[0] if exc.args else None
    return isinstance(reason, MaxRetryError) and isinstance(reason.reason, ConnectTimeoutError)


class _Sender:
    def __init__(self, opts: BatchOptions):
        self.opts = opts
        self.url = chat_url(opts.endpoint)
        self._local = threading.local()

    def session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:  # one keep-alive session per worker thread: connections are reused
            s = self._local.session = requests.Session()
            if self.opts.api_key:
                s.headers["Authorization"] = f"Bearer {self.opts.api_key}"
        return s

    def _attempt(self, body: bytes, timeout: float, attempt: int) -> tuple[dict[str, Any], float | None]:
        """One POST: (outcome, seconds to wait before retrying it, or None when it must not be retried)."""
        try:
            resp = self.session().post(
                self.url, data=body, headers={"Content-Type": "application/json"}, timeout=timeout
            )
        except requests.ReadTimeout:
            msg = (
                f"ReadTimeout: no response within {timeout:g} s after the request was sent; "
                "not retried, the server may still be working on it"
            )
            return {"status": "error", "http_code": 0, "error": msg}, None
        except requests.RequestException as exc:
            outcome: dict[str, Any] = {"status": "error", "http_code": 0, "error": f"{type(exc).__name__}: {exc}"}
            return outcome, (_backoff_s(attempt) if never_sent(exc) else None)
        code = resp.status_code
        if 200 <= code < 300:
            return answer_outcome(code, resp.content), None
        outcome = {"status": "error", "http_code": code, "error": _error_text(resp)}
        if code not in RETRY_STATUSES:
            return outcome, None
        asked = retry_after_s(resp.headers.get("Retry-After")) if code in RETRY_AFTER_STATUSES else None
        if asked is None:
            return outcome, _backoff_s(attempt)
        if asked > MAX_RETRY_AFTER_S:
            outcome["error"] += f" (Retry-After {asked:g} s is over the {MAX_RETRY_AFTER_S:g} s cap; not retried)"
            return outcome, None
        return outcome, asked

    def send(self, req: dict[str, Any]) -> dict[str, Any]:
        body = wire_body(req, self.opts.model)
        start = time.perf_counter()
        # The whole request, waits included, never takes longer than every attempt timing out would.
        deadline = start + self.opts.timeout_s * (self.opts.retries + 1)
        attempt = 0
        while True:
            timeout = min(self.opts.timeout_s, deadline - time.perf_counter())
            outcome, wait_s = self._attempt(body, timeout, attempt)
            if wait_s is None or attempt >= self.opts.retries:
                break
            if time.perf_counter() + wait_s >= deadline:
                outcome["error"] += f" (a retry in {wait_s:.3g} s would pass this request's time budget; not retried)"
                break
            time.sleep(wait_s)
            attempt += 1
        return {"id": req["id"], "latency_ms": round(1000 * (time.perf_counter() - start), 1), **outcome}


def _backoff_s(attempt: int) -> float:
    # Exponential with jitter: requests that failed together do not all come back at the same instant.
    ceiling = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt)
    return random.uniform(ceiling / 2, ceiling)


Deliver = Callable[[int, dict[str, Any]], None]  # (index in the batch, its result line)


class Transport(Protocol):
    """Turns the pending requests of a batch into result lines; run_batch does everything else."""

    def run(self, todo: list[tuple[int, dict[str, Any]]], deliver: Deliver) -> None:
        """Calls deliver(index, line) once per request, as each finishes (any order), in this thread.

        An exception out of here (a bug, deliver failing on a full disk, Ctrl-C) stops the run."""
        ...

    def close(self, *, abandon: bool) -> None:
        """Release what run() used; `abandon`: the run stopped, do not wait for work in flight."""
        ...


class HttpTransport:
    """POSTs to the endpoint from a pool of `concurrency` threads, with _Sender's retries."""

    def __init__(self, opts: BatchOptions):
        self.sender = _Sender(opts)
        self.pool = ThreadPoolExecutor(max_workers=max(1, opts.concurrency), thread_name_prefix="batch")

    def run(self, todo: list[tuple[int, dict[str, Any]]], deliver: Deliver) -> None:
        futures: dict[Future, int] = {self.pool.submit(self.sender.send, req): i for i, req in todo}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            bug = next((f.exception() for f in done if f.exception() is not None), None)
            for fut in done:
                if fut.exception() is None:  # every good result of this round is delivered before a bug stops the run
                    deliver(futures[fut], fut.result())
            if bug is not None:
                raise bug

    def close(self, *, abandon: bool) -> None:
        if abandon:
            self.pool.shutdown(wait=False, cancel_futures=True)
        else:
            self.pool.shutdown(wait=True)


# -- output and journal -------------------------------------------------------------------------


def _dumps(line: dict[str, Any]) -> str:
    # Compact separators: the documented recipes grep for '"status":"error"'. ensure_ascii=False keeps
    # CJK/emoji readable; a line holding a lone surrogate (a server may echo one) falls back to \u
    # escapes, which are valid JSON where the raw code point is not valid UTF-8.
    text = json.dumps(line, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(line, separators=(",", ":"), allow_nan=False)
    return text


def _encoded(line: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The line and its text; a response that cannot be written back as JSON becomes an error line."""
    try:
        return line, _dumps(line)
    except (ValueError, RecursionError) as exc:
        bad = {k: v for k, v in line.items() if k != "response"}
        bad.update(status="error", error=f"response cannot be written as JSON ({type(exc).__name__})")
        return bad, _dumps(bad)


def _write_lines(path: Path, texts: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_finished(line: dict[str, Any]) -> bool:
    """What --resume keeps: ok lines, and errors the server gave for the request itself (4xx other than
    408/429). Connection failures and read timeouts (http_code 0), 408, 429 and 5xx are sent again."""
    if line.get("status") == "ok":
        return True
    code = line.get("http_code")
    return isinstance(code, int) and code in _FINAL_CLIENT_ERRORS and code not in _TIMING_CLIENT_ERRORS


def _id_key(rid: Any) -> str:
    return json.dumps(rid)  # 4 and "4" are different ids in a result line


def _parse_results(name: str, raw: bytes) -> Iterator[dict[str, Any]]:
    """The result lines of a journal or results file; BatchInputError if it is not one of ours."""
    for n, text in enumerate(raw.split(b"\n"), 1):
        if not text.strip():
            continue
        try:
            line = _strict_json(text)
        except ValueError:  # includes UnicodeDecodeError
            line = None
        rid = line.get("id") if isinstance(line, dict) else None
        if (
            not isinstance(line, dict)
            or isinstance(rid, bool)
            or not isinstance(rid, str | int)
            or line.get("status") not in ("ok", "error")
        ):
            raise BatchInputError(
                f"{name}: line {n} is not a batch-run result line; move the file away or pass --overwrite"
            )
        yield line


def journal_path(out: str | Path) -> Path:
    """The journal of the results file `out`: `<out>.partial` (see the module doc)."""
    out = Path(out)
    return out.with_name(out.name + ".partial")


class _Journal:
    """`<out>.partial`, locked for the run; opened without ever truncating what an earlier run wrote."""

    def __init__(self, out: Path, opts: BatchOptions):
        self.path = journal_path(out)
        created = not self.path.exists()
        try:
            self.f: IO[bytes] = open(self.path, "a+b")  # "a": never truncates on open
        except OSError as exc:
            raise BatchInputError(f"cannot write the journal {self.path} ({exc.strerror or exc})") from None
        try:
            try:  # two runs appending to one journal would interleave lines: the second one refuses
                fcntl.flock(self.f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise BatchInputError(f"another batch-run is writing {self.path}") from None
            self.f.seek(0)
            raw = self.f.read()
            self.earlier: dict[str, dict[str, Any]] = {}
            if raw.strip() and not (opts.resume or opts.overwrite):
                n = sum(1 for x in raw.split(b"\n") if x.strip())
                raise BatchInputError(
                    f"{self.path} holds {n} result(s) of an earlier run that did not finish. Pass --resume to keep "
                    "them and send only the rest, or --overwrite to discard them and start over"
                )
            if opts.overwrite:
                self.f.truncate(0)
            elif raw:
                self._load(raw)
            if not self.earlier and opts.resume and out.is_file():
                # The earlier run finished (no journal left): resume from its results file.
                try:
                    earlier = out.read_bytes()
                except OSError as exc:
                    raise BatchInputError(f"cannot read {out} ({exc.strerror or exc})") from None
                for line in _parse_results(str(out), earlier):
                    self.earlier[_id_key(line["id"])] = line
                    self.append(_dumps(line))
        except BaseException:
            if created and self.f.tell() == 0:  # refused before anything was written: leave no trace
                self.path.unlink(missing_ok=True)
            self.f.close()
            raise

    def _load(self, raw: bytes) -> None:
        if not raw.endswith(b"\n"):
            # A crash mid-write leaves a torn last line. Keep it if it is whole, else cut it: it was
            # never a result. This is the only thing ever removed from a journal.
            head, _, tail = raw.rpartition(b"\n")
            try:
                list(_parse_results(str(self.path), tail))
                self.f.write(b"\n")
            except BatchInputError:
                self.f.truncate(len(head) + 1 if head else 0)
                raw = head
        for line in _parse_results(str(self.path), raw):
            self.earlier[_id_key(line["id"])] = line  # a later line for an id (a retry) wins

    def append(self, text: str) -> None:
        self.f.write(text.encode("utf-8") + b"\n")
        self.f.flush()

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        self.f.close()

    def close(self, *, discard_if_empty: bool = False) -> None:
        if discard_if_empty and self.f.seek(0, os.SEEK_END) == 0:
            self.path.unlink(missing_ok=True)
        self.f.close()


def write_after_crash(batch: list[dict[str, Any]], out: Path) -> int | None:
    """What Ctrl-C leaves, for a run whose process died (the crash guard's parent calls this): `out`
    gets, in input order, each request's latest line in the journal, byte for byte, and the journal
    stays for --resume. Returns how many lines were written; None when the journal holds no result
    (an empty one is removed, as a run stopped before anything was sent removes it; `out` is untouched).

    One difference from Ctrl-C, which knows what its own run sent: after a crashed --resume, a request
    whose earlier line is not finished (a 503, say) and that was not sent again yet keeps that line
    in `out` (Ctrl-C leaves it out); either way --resume sends it again.
    """
    out = Path(out)
    path = journal_path(out)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    latest: dict[str, str] = {}
    for text in raw.split(b"\n"):
        try:
            parsed = list(_parse_results(str(path), text))
        except BatchInputError:
            continue  # a torn last line: the process died writing it (the next --resume cuts it)
        for line in parsed:
            latest[_id_key(line["id"])] = text.decode("utf-8")
    if not latest:
        if not raw.strip():
            path.unlink(missing_ok=True)
        return None
    texts = [latest[key] for key in (_id_key(req["id"]) for req in batch) if key in latest]
    _write_lines(out, texts)
    return len(texts)


def run_batch(
    batch: list[dict[str, Any]],
    out: Path,
    opts: BatchOptions,
    transport: Callable[[], Transport] | None = None,
) -> int:
    """Run `batch` into `out` (see the module doc); `transport` makes the sender (default: HTTP to
    opts.endpoint). It is made only after the journal is checked, and only when something is left
    to send: a refused rerun or a resume with nothing to do never loads a model."""
    out = Path(out)
    journal = _Journal(out, opts)  # BatchInputError before anything is sent
    texts: dict[int, str] = {}
    failed: set[int] = set()
    for i, req in enumerate(batch):
        line = journal.earlier.get(_id_key(req["id"]))
        if opts.resume and line is not None and is_finished(line):
            texts[i] = _dumps(line)
            if line["status"] != "ok":
                failed.add(i)
    kept = len(texts)
    todo = [(i, req) for i, req in enumerate(batch) if i not in texts]
    try:
        sender = (transport or (lambda: HttpTransport(opts)))() if todo else None
    except KeyboardInterrupt:  # e.g. while the local engine loads: nothing was sent, nothing changed
        journal.close(discard_if_empty=True)
        print("edgellm batch-run: interrupted before anything was sent", file=sys.stderr)
        return 130
    except BaseException:
        journal.close(discard_if_empty=True)  # nothing was sent: leave no empty journal behind
        raise
    bar = tqdm(
        total=len(batch),
        initial=kept,
        file=sys.stderr,
        unit="req",
        disable=not opts.progress or not sys.stderr.isatty(),
        dynamic_ncols=True,
    )

    def deliver(i: int, result: dict[str, Any]) -> None:
        line, text = _encoded(result)
        journal.append(text)  # first: a crash right after still has this result
        texts[i] = text
        bar.update(1)
        if line["status"] != "ok":
            failed.add(i)
            bar.set_postfix(failed=len(failed))

    interrupted = False
    try:
        if sender is not None:
            sender.run(todo, deliver)
    except KeyboardInterrupt:
        interrupted = True
    except BaseException:
        # Anything else is a bug or the disk failing: keep the journal (it is the record of what was
        # paid for), write what finished, say how to continue, and let the error through.
        if sender is not None:
            sender.close(abandon=True)
        bar.close()
        journal.close()
        try:
            _write_lines(out, [texts[i] for i in sorted(texts)])
        except OSError:
            pass
        print(
            f"edgellm batch-run: stopped by an error; {len(texts)} of {len(batch)} written to {out}; "
            f"the journal {journal.path} is kept: rerun with --resume to send the rest",
            file=sys.stderr,
        )
        raise
    bar.close()
    if interrupted:
        if sender is not None:
            sender.close(abandon=True)
        journal.close()
        _write_lines(out, [texts[i] for i in sorted(texts)])
        print(
            f"edgellm batch-run: interrupted; {len(texts)} of {len(batch)} written to {out}; "
            "rerun with --resume to send the rest",
            file=sys.stderr,
        )
        return 130
    if sender is not None:
        sender.close(abandon=False)
    try:
        _write_lines(out, [texts[i] for i in range(len(batch))])
    except BaseException:
        journal.close()
        raise
    journal.remove()  # only now: every result is safely in <out>
    note = f" ({kept} kept from the earlier run)" if kept else ""
    print(f"edgellm batch-run: {len(batch) - len(failed)} ok, {len(failed)} failed -> {out}{note}", file=sys.stderr)
    return 1 if failed else 0

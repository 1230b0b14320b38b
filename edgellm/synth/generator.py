"""Schema-driven synthetic data: ask a node (seed 003 API) for records, keep the valid, unique ones.

Each attempt `i` sends POST /create_chat_completion with the schema as `response_format`
(json_schema) and a seed derived from (seed, i), so a rerun gives the same records. Attempts run
`concurrency` at a time but are judged and written strictly in index order, so the output does not
depend on which request finished first. A run stops after `count` valid records in OUT or after
`max_attempts` attempts (3 x count by default); a refused request (the node says the schema or the
request is wrong, or the token is) stops it at once, as do many failures in a row (node down).
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests

from edgellm.batch.http_client import MAX_RETRY_AFTER_S, never_sent, retry_after_s
from edgellm.synth.journal import open_output
from edgellm.synth.schema import (
    SYSTEM_PROMPT,
    RecordChecker,
    SynthInputError,
    canonical,
    check_schema,
    render_prompt,
    schema_hash,
    strict_loads,
)

RETRY_STATUSES = frozenset({429, 502, 503, 504})
# 4xx that say the request itself (schema, body, token, route) is wrong: every other attempt would be
# refused the same way. 408/429 are about timing; 422 is one record the model could not finish.
TIMING_OR_RECORD_STATUSES = frozenset({408, 422, 429})
MAX_CONCURRENCY = 64


@dataclass(frozen=True)
class SynthOptions:
    count: int
    endpoint: str = "http://127.0.0.1:8765"
    prompt_template: str | None = None
    temperature: float = 0.9
    seed: int = 0
    max_tokens: int = 512
    concurrency: int = 4
    token: str | None = None
    timeout_s: float = 600.0  # per HTTP attempt
    retries: int = 3  # per record, for 429/502/503/504 and connections never made
    max_attempts: int | None = None  # attempts this run may make; default 3 x count

    def check(self) -> None:
        def bad(msg: str) -> SynthInputError:
            return SynthInputError(msg)

        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise bad(f"count must be an integer >= 1, got {self.count!r}")
        if not isinstance(self.concurrency, int) or not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise bad(f"concurrency must be in [1, {MAX_CONCURRENCY}], got {self.concurrency!r}")
        if not isinstance(self.temperature, int | float) or not 0.0 <= self.temperature <= 1.5:
            raise bad(f"temperature must be in [0, 1.5], got {self.temperature!r}")
        if not isinstance(self.max_tokens, int) or not 16 <= self.max_tokens <= 4096:
            raise bad(f"max_tokens must be in [16, 4096], got {self.max_tokens!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise bad(f"seed must be an integer >= 0, got {self.seed!r}")
        if not isinstance(self.endpoint, str) or not self.endpoint.startswith(("http://", "https://")):
            raise bad(f"endpoint must be an http(s) URL (the node's base URL), got {self.endpoint!r}")
        if self.max_attempts is not None and (not isinstance(self.max_attempts, int) or self.max_attempts < 1):
            raise bad(f"max_attempts must be >= 1, got {self.max_attempts!r}")
        if not self.timeout_s > 0 or not isinstance(self.retries, int) or self.retries < 0:
            raise bad("timeout_s > 0 and retries >= 0 are required")


@dataclass
class SynthProgress:
    count: int  # asked for
    valid: int  # records in the output (earlier runs included)
    new_valid: int  # written by this run
    invalid: int
    duplicates: int
    failed: int  # requests that got no answer (after retries) or an error answer
    attempts: int  # attempts judged in this run
    elapsed_s: float
    retried: int = 0  # HTTP requests sent again (429 with Retry-After, 502/503/504, connection never made)

    @property
    def records_per_min(self) -> float:
        return 60.0 * self.new_valid / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class SynthSummary(SynthProgress):
    output: str = ""
    complete: bool = False  # `count` valid records are in the output
    error: str | None = None  # why the run stopped early
    refused: bool = False  # the node refused the request itself (bad schema/body/token): bad input
    interrupted: bool = False
    last_failure: str | None = None  # the last failed request's error (or the last invalid answer's reason)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "records_per_min": round(self.records_per_min, 2)}


@dataclass(frozen=True)
class _Outcome:
    kind: str  # "answer", "invalid" (a record the model could not finish), "failed", "refused"
    text: str | None = None
    error: str | None = None


def record_seed(seed: int, index: int) -> int:
    """A well-spread 63-bit seed per attempt: (seed, i) and (seed, i+1) share no sampler stream."""
    digest = hashlib.sha256(f"edgellm-synth/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def answer_text(body: Any) -> tuple[str | None, str | None]:
    """(text, None) from a WRAPPED ({"result": {...}}) or RAW seed answer (or an OpenAI one); (None, error)."""
    if isinstance(body, dict) and isinstance(body.get("result"), dict):
        body = body["result"]
    if not isinstance(body, dict):
        return None, f"unexpected answer ({type(body).__name__})"
    if body.get("error"):
        return None, str(body["error"])[:300]
    text = body.get("TEXT_RESPONSE", body.get("text"))
    if isinstance(text, list):
        text = text[0] if text else None
    if isinstance(text, str):
        return text, None
    outputs = body.get("FULL_OUTPUT")
    completion = outputs[0] if isinstance(outputs, list) and outputs else body
    try:
        content = completion["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        content = None
    if isinstance(content, str):
        return content, None
    return None, "the answer holds no text (TEXT_RESPONSE / choices[0].message.content)"


def closed_early(raw: bytes) -> bool:
    """Whether the answer says its JSON was steered to an early end (edgellm's truncated_structure)."""
    try:
        body = strict_loads(raw)  # the one strict reader: a hostile answer (deep, NaN) is "no", not a crash
    except ValueError:
        return False
    if isinstance(body, dict) and isinstance(body.get("result"), dict):
        body = body["result"]
    outputs = body.get("FULL_OUTPUT") if isinstance(body, dict) else None
    completion = outputs[0] if isinstance(outputs, list) and outputs else body
    return isinstance(completion, dict) and completion.get("truncated_structure") is True


def _error_of(resp: requests.Response) -> str:
    try:
        body = strict_loads(resp.content)
    except (ValueError, UnicodeDecodeError):
        return (resp.text[:300] or resp.reason or "").strip()
    if isinstance(body, dict) and isinstance(body.get("result"), dict):
        body = body["result"]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        err = err.get("message") or err
    return str(err or body)[:300]


class _Client:
    def __init__(self, schema: dict[str, Any], opts: SynthOptions):
        self.schema = schema
        self.opts = opts
        self.url = opts.endpoint.rstrip("/") + "/create_chat_completion"
        self._local = threading.local()
        self._lock = threading.Lock()
        self.retried = 0

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:  # one keep-alive session per worker thread
            s = self._local.session = requests.Session()
            if self.opts.token:
                s.headers["Authorization"] = f"Bearer {self.opts.token}"
        return s

    def body(self, index: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": render_prompt(self.opts.prompt_template, self.schema, index)},
            ],
            "temperature": self.opts.temperature,
            "max_tokens": self.opts.max_tokens,
            "seed": record_seed(self.opts.seed, index),
            "response_format": {"type": "json_schema", "json_schema": {"schema": self.schema}},
            "priority": "batch",  # a dataset job: the node's other clients go first
        }
        if self.opts.token:  # the seed API also reads a body field (a Ratio1 node's endpoints take only that)
            body["authorization"] = self.opts.token
        return body

    def generate(self, index: int, stop: threading.Event) -> _Outcome:
        body = self.body(index)
        for attempt in range(self.opts.retries + 1):
            outcome, wait_s = self._attempt(body, attempt)
            if wait_s is None or attempt >= self.opts.retries or stop.wait(wait_s):
                return outcome
            with self._lock:
                self.retried += 1
        return outcome  # pragma: no cover - the loop always returns

    def _attempt(self, body: dict[str, Any], attempt: int) -> tuple[_Outcome, float | None]:
        backoff = min(8.0, 0.5 * 2**attempt) * random.uniform(0.5, 1.0)
        try:
            resp = self._session().post(self.url, json=body, timeout=self.opts.timeout_s)
        except requests.RequestException as exc:
            outcome = _Outcome("failed", error=f"{type(exc).__name__}: {str(exc)[:200]}")
            return outcome, (backoff if never_sent(exc) else None)
        code = resp.status_code
        if 200 <= code < 300:
            try:
                text, error = answer_text(strict_loads(resp.content))
            except (ValueError, UnicodeDecodeError) as exc:
                return _Outcome("failed", error=f"HTTP {code}: the answer is not JSON ({exc})"), None
            if error is not None:  # an error inside a 200 (upstream's WRAPPED habit)
                return _Outcome("failed", error=f"HTTP {code}: {error}"), None
            if closed_early(resp.content):
                # The node closed the JSON the shortest valid way to fit max_tokens: it validates, but its
                # values are stubs ("", 0, []), not a record worth keeping.
                return _Outcome("invalid", error="closed early to fit max_tokens (truncated_structure)"), None
            return _Outcome("answer", text=text), None
        error = f"HTTP {code}: {_error_of(resp)}"
        if code == 422:
            return _Outcome("invalid", error=error), None
        if 400 <= code < 500 and code not in TIMING_OR_RECORD_STATUSES:
            return _Outcome("refused", error=error), None
        if code not in RETRY_STATUSES:
            return _Outcome("failed", error=error), None
        asked = retry_after_s(resp.headers.get("Retry-After")) if code in (429, 503) else None
        if asked is not None and asked > MAX_RETRY_AFTER_S:
            return _Outcome("failed", error=f"{error} (Retry-After {asked:g} s is over the cap)"), None
        return _Outcome("failed", error=error), (asked if asked is not None else backoff)


ProgressFn = Callable[[SynthProgress], None]


def generate(
    schema: dict[str, Any],
    out: str | Path,
    opts: SynthOptions,
    on_progress: ProgressFn | None = None,
    stop: threading.Event | None = None,
) -> SynthSummary:
    """Run until OUT holds `opts.count` valid records (or the attempts run out); the summary says how it went.

    SynthInputError (nothing sent) for a bad schema, bad options or an output it must not touch.
    """
    check_schema(schema)
    opts.check()
    stop = stop or threading.Event()
    state = open_output(Path(out), schema_hash(schema))
    checker = RecordChecker(schema)
    client = _Client(schema, opts)
    started = time.monotonic()
    summary = SynthSummary(
        count=opts.count, valid=state.valid, new_valid=0, invalid=0, duplicates=0, failed=0, attempts=0,
        elapsed_s=0.0, output=str(out),
    )  # fmt: skip
    max_failed_in_row = max(5, 2 * opts.concurrency)
    failed_in_row = 0

    def report() -> None:
        summary.elapsed_s = time.monotonic() - started
        summary.valid = state.valid
        summary.retried = client.retried
        if on_progress is not None:
            on_progress(SynthProgress(**{k: getattr(summary, k) for k in SynthProgress.__dataclass_fields__}))

    first = state.next_index
    end = first + (opts.max_attempts or 3 * opts.count)
    next_submit = next_commit = first
    pending: dict[Future, int] = {}
    results: dict[int, _Outcome] = {}
    pool = ThreadPoolExecutor(max_workers=opts.concurrency, thread_name_prefix="synth")
    report()
    try:
        while state.valid < opts.count and summary.error is None and not stop.is_set():
            while (
                len(pending) < opts.concurrency
                and next_submit < end
                and state.valid + len(pending) + len(results) < opts.count
            ):
                pending[pool.submit(client.generate, next_submit, stop)] = next_submit
                next_submit += 1
            if not pending and not results:
                break  # the attempts are spent
            done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for fut in done:
                results[pending.pop(fut)] = fut.result()
            refused = next((o for o in results.values() if o.kind == "refused"), None)
            if refused is not None:
                summary.error, summary.refused = f"the node refused the request: {refused.error}", True
                break
            while next_commit in results and state.valid < opts.count:
                outcome = results.pop(next_commit)
                if outcome.kind == "failed":
                    summary.failed += 1
                    summary.last_failure = outcome.error
                    failed_in_row += 1
                    state.append(next_commit, "failed")
                    if failed_in_row >= max_failed_in_row:
                        summary.error = f"{failed_in_row} requests in a row failed; the last: {outcome.error}"
                else:
                    failed_in_row = 0
                    record, _reason = checker.check(outcome.text) if outcome.kind == "answer" else (None, None)
                    if record is None:
                        summary.invalid += 1
                        summary.last_failure = f"invalid record: {_reason or outcome.error}"
                        state.append(next_commit, "invalid")
                    elif canonical(record) in state.seen:
                        summary.duplicates += 1
                        state.append(next_commit, "duplicate")
                    else:
                        summary.new_valid += 1
                        state.append(next_commit, "valid", record)
                summary.attempts += 1
                next_commit += 1
                report()
                if summary.error is not None:
                    break
    except KeyboardInterrupt:  # what is written stays written and counted; a rerun continues
        stop.set()
    finally:
        stopped_by_caller = stop.is_set()
        stop.set()  # waiting retries give up at once
        pool.shutdown(wait=False, cancel_futures=True)
        state.close()
        summary.complete = state.valid >= opts.count
        summary.interrupted = stopped_by_caller and not summary.complete
        report()
    if not summary.complete and summary.error is None and not summary.interrupted:
        summary.error = f"{summary.attempts} attempts gave {summary.new_valid} new valid records"
    return summary

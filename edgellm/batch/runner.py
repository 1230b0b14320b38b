"""`edgellm batch-run`: requests.json -> results.jsonl against any OpenAI-compatible chat endpoint.

Each finished request is appended to `<out>.partial` at once (a crash loses nothing already done);
at the end, and on Ctrl-C, `<out>` is written in input order with what finished. Exit codes:
0 all ok, 1 some failed (the file is still complete), 2 unusable input, 130 interrupted.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from tqdm import tqdm

from edgellm.errors import EdgeLLMError

RETRY_STATUSES = {429, 502, 503, 504}


class BatchInputError(EdgeLLMError):
    error_type = "batch_input"


@dataclass(frozen=True)
class BatchOptions:
    endpoint: str
    concurrency: int = 4
    timeout_s: float = 600.0
    retries: int = 2
    api_key: str | None = None
    model: str | None = None  # overrides every request's model
    progress: bool = True


def load_requests(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BatchInputError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
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


def _error_text(resp: requests.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err or body)[:500]


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

    def send(self, req: dict[str, Any]) -> dict[str, Any]:
        body = {k: v for k, v in req.items() if k != "id"}
        if self.opts.model:
            body["model"] = self.opts.model
        start = time.perf_counter()
        line: dict[str, Any] = {"id": req["id"]}
        for attempt in range(self.opts.retries + 1):
            try:
                resp = self.session().post(self.url, json=body, timeout=self.opts.timeout_s)
            except requests.RequestException as exc:
                outcome: dict[str, Any] = {"status": "error", "http_code": 0, "error": f"{type(exc).__name__}: {exc}"}
            else:
                if 200 <= resp.status_code < 300:
                    try:
                        outcome = {"status": "ok", "http_code": resp.status_code, "response": resp.json()}
                    except ValueError:
                        outcome = {
                            "status": "error",
                            "http_code": resp.status_code,
                            "error": "response is not JSON: " + resp.text[:200],
                        }
                else:
                    outcome = {"status": "error", "http_code": resp.status_code, "error": _error_text(resp)}
                    if resp.status_code not in RETRY_STATUSES:
                        break
            if outcome["status"] == "ok" or attempt == self.opts.retries:
                break
            time.sleep(min(8.0, 0.5 * 2**attempt))
        line["latency_ms"] = round(1000 * (time.perf_counter() - start), 1)
        return {**line, **outcome}


def _dumps(line: dict[str, Any]) -> str:
    # Compact separators: the documented recipes grep for '"status":"error"'.
    return json.dumps(line, ensure_ascii=False, separators=(",", ":"))


def _write_lines(path: Path, lines: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(_dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_batch(batch: list[dict[str, Any]], out: Path, opts: BatchOptions) -> int:
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    sender = _Sender(opts)
    results: dict[int, dict[str, Any]] = {}
    bar = tqdm(total=len(batch), file=sys.stderr, unit="req", disable=not opts.progress, dynamic_ncols=True)
    pool = ThreadPoolExecutor(max_workers=max(1, opts.concurrency), thread_name_prefix="batch")
    interrupted = False
    try:
        with open(partial, "w", encoding="utf-8") as log:
            futures: dict[Future, int] = {pool.submit(sender.send, req): i for i, req in enumerate(batch)}
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                for fut in done:
                    line = fut.result()
                    results[futures[fut]] = line
                    log.write(_dumps(line) + "\n")
                    log.flush()
                    bar.update(1)
                    if line["status"] != "ok":
                        bar.set_postfix(failed=sum(r["status"] != "ok" for r in results.values()))
    except KeyboardInterrupt:
        interrupted = True
        pool.shutdown(wait=False, cancel_futures=True)
    finally:
        bar.close()
        _write_lines(out, [results[i] for i in sorted(results)])
        if not interrupted:
            partial.unlink(missing_ok=True)
            pool.shutdown(wait=True)
    failed = sum(r["status"] != "ok" for r in results.values())
    if interrupted:
        print(f"edgellm batch-run: interrupted; {len(results)} of {len(batch)} written to {out}", file=sys.stderr)
        return 130
    print(f"edgellm batch-run: {len(batch) - failed} ok, {failed} failed -> {out}", file=sys.stderr)
    return 1 if failed else 0

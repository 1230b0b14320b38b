"""The HTTP side of `edgellm batch-run`: the route URLs (chat, completions, embeddings), the body sent,
one POST with its retries, and the answer turned into a result line's status / http_code / response | error.

Retries: a request is sent again only when the server provably did not produce an answer: a refused
connection, or 429/502/503/504. Retry-After is honoured on 429/503 up to MAX_RETRY_AFTER_S (a server
asking for more fails the line, for a later --resume); otherwise exponential backoff with jitter. A read
timeout is never retried: the server may still be generating. The loop stays hand-written rather than
urllib3's `Retry`: that one sleeps whatever Retry-After asks (no cap), retries read timeouts or not at
all, and cannot bound a request's whole time budget or say in the line why it stopped retrying.
"""

from __future__ import annotations

import email.utils
import json
import random
import re
import threading
import time
from datetime import datetime, timezone
from typing import Any

import requests
from urllib3.exceptions import ConnectTimeoutError, MaxRetryError

from edgellm import jsonsafe
from edgellm.batch.inputs import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, BatchOptions, url_of  # no import cycle

# 429/503 say "come back later", 502/504 are a proxy's view of a server that is down or restarting:
# in every case the server did not produce an answer, so sending the request again is safe.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
RETRY_AFTER_STATUSES = frozenset({429, 503})  # where RFC 9110 / 6585 give Retry-After a meaning
MAX_RETRY_AFTER_S = 60.0  # a server asking for more is treated as "not now": the line fails, --resume later
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 8.0


def chat_url(endpoint: str) -> str:
    """Accepts the full chat URL, an API base ending in /v1, or a server root."""
    url = endpoint.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


def completions_url(endpoint: str) -> str:
    """/v1/completions for the same endpoint forms chat_url accepts (the chat URL itself included)."""
    return _route_url(endpoint, "/completions")


def embeddings_url(endpoint: str) -> str:
    """/v1/embeddings for the same endpoint forms (a route URL given as the endpoint included)."""
    return _route_url(endpoint, "/embeddings")


def _route_url(endpoint: str, route: str) -> str:
    url = endpoint.rstrip("/")
    for tail in ("/chat/completions", "/completions", "/embeddings"):
        if url.endswith(tail):
            return url.removesuffix(tail) + route
    if url.endswith("/v1"):
        return url + route
    return url + "/v1" + route


def strict_json(raw: bytes) -> Any:
    """A response body (or a result line) as the node's strict reader takes it; ValueError (JSONProblem)
    for anything results.jsonl could not hold as valid JSON. A lone surrogate is kept: a server may echo
    one, and its \\u escape is valid JSON; a hostile or broken server costs one line, never the run."""
    try:
        return jsonsafe.loads(raw, lone_surrogates="keep")
    except jsonsafe.JSONProblem as p:
        raise ValueError(p.describe("the body")) from None


def wire_body(req: dict[str, Any], model: str | None) -> bytes:
    """The body POSTed for a request: its fields but `id` and `url` (the route), `model` replaced when
    given, encoded as `requests` encodes json= (the local transport measures and parses these same bytes)."""
    body = {k: v for k, v in req.items() if k not in ("id", "url")}
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
            return {"status": "ok", "http_code": code, "response": strict_json(raw)}
        except ValueError as exc:
            return {"status": "error", "http_code": code, "error": f"response is not JSON ({exc})"}
    try:
        body = strict_json(raw)
    except ValueError:
        body = raw.decode("utf-8", "replace")
    return {"status": "error", "http_code": code, "error": error_message(body)}


def _error_text(resp: requests.Response) -> str:
    try:
        body = strict_json(resp.content)
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


class Sender:
    def __init__(self, opts: BatchOptions):
        self.opts = opts
        self.url = chat_url(opts.endpoint)
        self.urls = {  # by a request's `url`
            CHAT_URL: self.url,
            COMPLETIONS_URL: completions_url(opts.endpoint),
            EMBEDDINGS_URL: embeddings_url(opts.endpoint),
        }
        self._local = threading.local()

    def session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:  # one keep-alive session per worker thread: connections are reused
            s = self._local.session = requests.Session()
            if self.opts.api_key:
                s.headers["Authorization"] = f"Bearer {self.opts.api_key}"
        return s

    def _attempt(
        self, body: bytes, timeout: float, attempt: int, url: str | None = None
    ) -> tuple[dict[str, Any], float | None]:
        """One POST (to `url`, default the chat URL): (outcome, seconds to wait before retrying it, or None
        when it must not be retried)."""
        try:
            resp = self.session().post(
                url or self.url, data=body, headers={"Content-Type": "application/json"}, timeout=timeout
            )
        except requests.ReadTimeout:
            msg = (
                f"ReadTimeout: no response within {timeout:g} s after the request was sent; "
                "not retried, the server may still be working on it"
            )
            return {"status": "error", "http_code": 0, "error": msg}, None
        except requests.RequestException as exc:
            outcome: dict[str, Any] = {"status": "error", "http_code": 0, "error": f"{type(exc).__name__}: {exc}"}
            return outcome, (backoff_s(attempt) if never_sent(exc) else None)
        code = resp.status_code
        if 200 <= code < 300:
            return answer_outcome(code, resp.content), None
        outcome = {"status": "error", "http_code": code, "error": _error_text(resp)}
        if code not in RETRY_STATUSES:
            return outcome, None
        asked = retry_after_s(resp.headers.get("Retry-After")) if code in RETRY_AFTER_STATUSES else None
        if asked is None:
            return outcome, backoff_s(attempt)
        if asked > MAX_RETRY_AFTER_S:
            outcome["error"] += f" (Retry-After {asked:g} s is over the {MAX_RETRY_AFTER_S:g} s cap; not retried)"
            return outcome, None
        return outcome, asked

    def send(self, req: dict[str, Any]) -> dict[str, Any]:
        body = wire_body(req, self.opts.model)
        url = self.urls.get(url_of(req), self.url)  # load_requests checked it
        start = time.perf_counter()
        # The whole request, waits included, never takes longer than every attempt timing out would.
        deadline = start + self.opts.timeout_s * (self.opts.retries + 1)
        attempt = 0
        while True:
            timeout = min(self.opts.timeout_s, deadline - time.perf_counter())
            outcome, wait_s = self._attempt(body, timeout, attempt, url)
            if wait_s is None or attempt >= self.opts.retries:
                break
            if time.perf_counter() + wait_s >= deadline:
                outcome["error"] += f" (a retry in {wait_s:.3g} s would pass this request's time budget; not retried)"
                break
            time.sleep(wait_s)
            attempt += 1
        return {"id": req["id"], "latency_ms": round(1000 * (time.perf_counter() - start), 1), **outcome}


def backoff_s(attempt: int) -> float:
    # Exponential with jitter: requests that failed together do not all come back at the same instant.
    ceiling = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt)
    return random.uniform(ceiling / 2, ceiling)

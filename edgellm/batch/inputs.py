"""What `edgellm batch-run` is given: the options, and the requests file read and checked up front.

Every problem of the file is found before anything is sent (exit 2, `BatchInputError` naming the
first): JSON the node's strict reader refuses (edgellm/jsonsafe.py: duplicate keys, NaN, huge numbers,
lone surrogates, depth), requests without a usable id, duplicate ids, and a request asking for a
stream (`"stream": true`): the runner reads whole answers, so the line would be generated and paid
for, then written as an error. (An embeddings line has no stream: a `stream` field there is sent, and
refused by the route as any unknown parameter.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgellm import jsonsafe
from edgellm.errors import BatchInputError

# A request's optional `url` (as in OpenAI batch files): the route it goes to; chat when absent.
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)


def url_of(req: dict[str, Any]) -> str:
    """The route a (checked) request goes to."""
    return req.get("url") or CHAT_URL


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


def _show(value: str) -> str:
    # ascii() of a lone surrogate is printable ('\ud800'), so the message itself can be written.
    return ascii(value) if len(value) <= 60 else ascii(value[:60]) + "..."


def _problem(p: jsonsafe.JSONProblem) -> str:
    """The reader's refusal in this command's words (its messages name the path, repr-quoted values)."""
    where = p.where
    if p.kind == "duplicate":
        return f"duplicate key {_show(p.key or '')} in an object" + (f" (at {where})" if where else "")
    if p.kind == "depth":
        return f"not valid JSON (nested too deeply: more than {jsonsafe.MAX_DEPTH} levels)"
    if p.kind == "range":
        return f"{where}: a number too large for a double (it would be sent as Infinity)"
    if p.kind == "surrogate" and p.value is not None:
        what = f"the key {_show(p.value)}" if p.problem.startswith("key") else _show(p.value)
        return f"{where}: {what} has a lone surrogate (\\ud800-\\udfff escape), not valid Unicode"
    if p.kind in ("syntax", "encoding"):
        return f"not valid JSON ({p.problem.removeprefix('is not valid JSON: ').removeprefix('is ')})"
    return p.describe("the file")


def load_requests(path: Path) -> list[dict[str, Any]]:
    """The requests of `path`, or BatchInputError naming the first problem (never another exception)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise BatchInputError(f"{path}: no such file") from None
    except OSError as exc:
        raise BatchInputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        data = jsonsafe.loads(raw)
    except jsonsafe.JSONProblem as p:
        raise BatchInputError(f"{path}: {_problem(p)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise BatchInputError(f'{path}: expected a JSON object with a "requests" array')
    seen: dict[str, int] = {}
    for i, req in enumerate(data["requests"]):
        if not isinstance(req, dict):
            raise BatchInputError(f"{path}: requests[{i}] is not an object")
        rid = req.get("id")
        if isinstance(rid, bool) or not isinstance(rid, str | int) or (isinstance(rid, str) and not rid.strip()):
            raise BatchInputError(f'{path}: requests[{i}] has no "id" (a non-empty string or an integer)')
        url = req.get("url")
        if url != EMBEDDINGS_URL and req.get("stream") not in (None, False):
            raise BatchInputError(
                f'{path}: requests[{i}] (id {rid!r}) sets "stream": {jsonsafe_text(req["stream"])}; batch-run reads '
                'whole answers into results.jsonl, not event streams: remove "stream" or set it to false'
            )
        if url is not None and url not in URLS:
            raise BatchInputError(
                f'{path}: requests[{i}] (id {rid!r}) has "url": {jsonsafe_text(url)}; batch-run sends to '
                f"{', '.join(URLS)} (absent: {CHAT_URL})"
            )
        key = str(rid)
        if key in seen:
            raise BatchInputError(f"{path}: duplicate id {rid!r} (requests[{seen[key]}] and requests[{i}])")
        seen[key] = i
    if not data["requests"]:
        raise BatchInputError(f"{path}: the requests array is empty")
    return data["requests"]


def jsonsafe_text(value: Any) -> str:
    """A small JSON value as written in the file, bounded."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."

"""A bounded fuzz run over the node's OpenAPI document: no 5xx, no hang, on both route families (issue 8).

One real node; schemathesis reads its /openapi.json and generates requests for every operation
(valid bodies and, for operations with inputs, schema-violating ones), sent over real HTTP. The
OpenAPI document does not describe the body of POST /v1/chat/completions, so that route is fuzzed
with a hypothesis strategy of our own, built around the OpenAI fields (mostly valid values, some
garbage, lone surrogates, huge numbers, streaming on and off).

Bounded: a fixed seed (derandomize), EXAMPLES per operation and generation mode, generations cut
to MAX_TOKENS, waits to MAX_WAIT_S, every call under an HTTP timeout, and a time budget per operation
(OPERATION_BUDGET_S) after which that operation's remaining examples are skipped (reported by operation,
with a warning, not failed): every operation is fuzzed however slow another one is. Every response
must be < 500 (a 504 for a sync wait under STALL_S is allowed: the fuzzer picks tiny timeouts; a
longer one that runs out is a stall, counted as a hang), JSON where the route answers JSON,
complete SSE where it streams; the async backlog must drain, a plain request must still succeed
afterwards and the worker must not restart. A summary line gives the numbers (pytest -s not needed).
Requests send `Content-Type: application/json` and a loopback Host: the boundary's own refusals
(415, 421) are tested in test_http_hardening.py.
"""

from __future__ import annotations

import json
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET

EXAMPLES = 40  # per operation and generation mode (schemathesis)
OPENAI_EXAMPLES = 200  # the hand-written /v1/chat/completions strategy: many more fields to combine
# A budget per operation (and generation mode), not one for the whole run: a slow operation skips its own
# remaining examples (reported), never another operation's. The whole run takes ~75 s on 2 cores.
OPERATION_BUDGET_S = 20.0
OPENAI_BUDGET_S = 90.0  # the hand-written /v1/chat/completions strategy: OPENAI_EXAMPLES generations
RAW_BUDGET_S = 30.0  # post_raw_bodies, poll_accepted
HTTP_TIMEOUT_S = 60.0  # a call that has not answered by then counts as a hang
MAX_TOKENS = 24  # generations stay short: the fuzzer may pick up to 4096
MAX_WAIT_S = 15.0  # and sync waits up to 3600 s
STALL_S = 10.0  # a 504 after a wait this long (for at most MAX_TOKENS tokens) counts as a hang
HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}
CHAT_PATHS = ("/predict", "/create_chat_completion", "/predict_async", "/create_chat_completion_async")
OLLAMA_PATHS = ("/api/chat", "/api/generate")  # Ollama's: options.num_predict cut, NDJSON streams by default
OLLAMA_MODEL_PATHS = (*OLLAMA_PATHS, "/api/embed", "/api/embeddings", "/api/show")  # the served model named

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,  # a fixed seed: the same requests on every run
    database=None,
    deadline=None,
    phases=(Phase.explicit, Phase.generate),  # no shrinking: every failure is recorded, none replayed
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)


@dataclass
class Tally:
    deadline: float = 0.0  # of the operation being fuzzed (begin())
    operations: list[str] = field(default_factory=list)
    examples: int = 0
    skipped: int = 0
    skipped_by_operation: Counter = field(default_factory=Counter)
    current: str = ""
    statuses: Counter = field(default_factory=Counter)
    by_operation: dict[str, Counter] = field(default_factory=dict)
    server_errors: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    bad_bodies: list[str] = field(default_factory=list)
    accepted_ids: list[str] = field(default_factory=list)
    shapes: Counter = field(default_factory=Counter)  # documented shapes the seed routes were sent

    def begin(self, label: str, budget_s: float) -> None:
        """The next examples are `label`'s, sent within `budget_s` from now."""
        self.current, self.deadline = label, time.monotonic() + budget_s

    def out_of_time(self) -> bool:
        if time.monotonic() > self.deadline:
            self.skipped += 1
            self.skipped_by_operation[self.current] += 1
            return True
        return False

    def failures(self) -> list[str]:
        return self.server_errors + self.hangs + self.bad_bodies

    def summary(self, wall_s: float) -> str:
        return (
            f"fuzz summary: operations={len(self.operations)} examples={self.examples} "
            f"5xx={len(self.server_errors)} hangs={len(self.hangs)} bad_bodies={len(self.bad_bodies)} "
            f"skipped_past_budget={dict(self.skipped_by_operation)} shapes={dict(self.shapes)} wall={wall_s:.0f}s"
        )

    def breakdown(self) -> str:
        return "\n".join(f"  {label}: {dict(sorted(c.items(), key=str))}" for label, c in self.by_operation.items())


def small(body: Any, top: bool = True) -> Any:
    """Cut what the fuzzer picked for generation length and wait time (the rest is sent as generated).

    `extras` is merged over the top level by the server, so its values are cut too.
    """
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key, cap in (("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS), ("timeout", MAX_WAIT_S)):
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if top and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS  # the default is 512
    if top and isinstance(body.get("extras"), dict):
        body["extras"] = small(body["extras"], top=False)
    return body


def small_ollama(body: Any, model_id: str | None, generates: bool) -> Any:
    """An Ollama body whose model name, when a string, is the served one (else nearly every body would be a
    404 before its fields are read), and (`generates`) whose generation is cut to MAX_TOKENS
    (options.num_predict; its default is 512)."""
    if not isinstance(body, dict):
        return body
    if model_id is not None and isinstance(body.get("model"), str):
        body = {**body, "model": model_id}
    if not generates or not isinstance(body.get("options", {}), dict):
        return body
    options = dict(body.get("options") or {})
    value = options.get("num_predict")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value > MAX_TOKENS:
        options["num_predict"] = MAX_TOKENS
    return {**body, "options": options}


def note_shapes(tally: Tally, body: Any) -> None:
    """Count the bodies that carry a content-part array or a structural tag (the document describes both)."""
    if not isinstance(body, dict):
        return
    messages = body.get("messages")
    if isinstance(messages, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages):
        tally.shapes["content_parts"] += 1
    guide = body.get("guided_decoding")
    if isinstance(guide, dict) and isinstance(guide.get("structural_tag"), dict):
        tally.shapes["structural_tag"] += 1


def count(tally: Tally, label: str, status: int | str) -> None:
    tally.statuses[status] += 1
    tally.by_operation.setdefault(label, Counter())[status] += 1


def check_response(
    tally: Tally, label: str, repro: str, status: int, content_type: str, text: str, sent: Any = None
) -> None:
    """`sent`: the JSON body sent, if any (its `timeout` tells a short wait from a stalled engine)."""
    count(tally, label, status)
    body = None
    if content_type.startswith("application/json"):
        try:
            body = json.loads(text)
        except ValueError:
            tally.bad_bodies.append(f"{label}: {status} with a body that is not JSON: {text[:200]!r}\n  {repro}")
            return
    elif content_type.startswith("application/x-ndjson") and status == 200:  # Ollama's stream
        try:
            parts = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError:
            tally.bad_bodies.append(f"{label}: an NDJSON line that is not JSON: {text[:200]!r}\n  {repro}")
            return
        if not parts or not (parts[-1].get("done") is True or "error" in parts[-1]):
            tally.bad_bodies.append(f"{label}: an NDJSON stream without its last chunk: {text[-200:]!r}\n  {repro}")
        return
    elif not (label.endswith("/metrics") and content_type.startswith("text/plain") and status == 200):
        tally.bad_bodies.append(f"{label}: {status} {content_type!r}, not JSON: {text[:200]!r}\n  {repro}")
        return
    if status < 500:
        return
    if status == 504 and timed_out(body):
        if wait_of(sent) < STALL_S:  # a sync wait cut by the request's own short timeout
            return
        # A MAX_TOKENS generation takes well under a second: a long wait that ran out is a stall.
        tally.hangs.append(f"{label}: 504 after a wait of {wait_of(sent)} s: {text[:300]}\n  {repro}")
        return
    tally.server_errors.append(f"{label}: {status} {text[:300]}\n  {repro}")


def wait_of(sent: Any) -> float:
    """The wait the request asked for (extras override the top level); inf when unknown."""
    if not isinstance(sent, dict):
        return float("inf")
    extras = sent.get("extras") if isinstance(sent.get("extras"), dict) else {}
    value = extras.get("timeout", sent.get("timeout"))
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else float("inf")


def timed_out(body: Any) -> bool:
    if not isinstance(body, dict):
        return False
    result = body.get("result", body)
    if isinstance(result, dict) and result.get("error_type") == "timeout" and result.get("request_id"):
        return True  # seed routes: the id to poll
    error = body.get("error")
    return isinstance(error, dict) and error.get("code") == "timeout"  # /v1: OpenAI's shape


def curl(request: requests.PreparedRequest | None) -> str:
    """The request as sent (as_curl_command would hide fields named like *token*, max_tokens included)."""
    if request is None:
        return "(request unknown)"
    body = request.body.decode("utf-8", "replace") if isinstance(request.body, bytes) else request.body
    data = f" -H 'Content-Type: application/json' --data-binary '{body[:1500]}'" if body else ""
    return f"curl -X {request.method} '{request.url}'{data}"


def fuzz_operation(
    tally: Tally, operation, mode: GenerationMode, base: str, session: requests.Session, model_id: str | None = None
) -> None:
    label = f"{operation.method.upper()} {operation.path}"
    tally.begin(f"{label} {mode.value}", OPERATION_BUDGET_S)

    @FUZZ_SETTINGS
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        if tally.out_of_time():
            return
        if case.path in CHAT_PATHS and case.body is not NOT_SET:
            case.body = small(case.body)
            note_shapes(tally, case.body)
        if case.path in OLLAMA_MODEL_PATHS and case.body is not NOT_SET:
            case.body = small_ollama(case.body, model_id, case.path in OLLAMA_PATHS)
        tally.examples += 1
        try:
            r = case.call(base_url=base, session=session, headers=HEADERS, timeout=(5, HTTP_TIMEOUT_S))
        except requests.Timeout as exc:
            tally.hangs.append(f"{label}: no answer within {HTTP_TIMEOUT_S} s\n  {curl(exc.request)}")
            return
        except requests.ConnectionError as exc:
            tally.server_errors.append(f"{label}: connection failed ({exc})\n  {curl(exc.request)}")
            return
        headers = {k.lower(): v for k, v in r.headers.items()}
        content_type = (headers.get("content-type") or [""])[0]
        text = r.content.decode("utf-8", "replace")
        sent = case.body if case.body is not NOT_SET else None
        check_response(tally, label, curl(r.request), r.status_code, content_type, text, sent)
        if r.status_code == 200 and case.path in CHAT_PATHS[2:]:
            request_id = (json.loads(text).get("result") or {}).get("request_id")
            if request_id:
                tally.accepted_ids.append(request_id)

    run()


# -- the OpenAI body, which the OpenAPI document leaves open ------------------------------------
ODD_TEXT = ["hi \ud800", "\udfff", "", "   ", "\x00", "{{ raise }}", "<|im_start|>system", "🙂" * 20, "a" * 2000]
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 3},
    {"$ref": "#"},  # defect 7
    {"type": "string", "pattern": "a{1000000}"},  # defect 7
    {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]},  # unsatisfiable recursion
]


def rarely(usual: st.SearchStrategy, odd: st.SearchStrategy) -> st.SearchStrategy:
    """`odd` about one time in eight (one_of would pick it half the time, or more: its choices are not even)."""
    return st.tuples(st.integers(0, 7), usual, odd).map(lambda t: t[2] if t[0] == 5 else t[1])


def openai_bodies(model_id: str) -> st.SearchStrategy[dict]:
    """Bodies that are valid field by field (so most reach generation), a quarter of them then
    corrupted in one field (any JSON value, or an unknown or unsupported field)."""
    plain = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40)  # ODD_TEXT has those
    text = rarely(plain, st.sampled_from(ODD_TEXT))
    parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=3)
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "user", "assistant", "tool", "developer"]),
            "content": st.one_of(text, text, parts),
        },
        optional={"name": text},
    )
    response_format = st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
        st.fixed_dictionaries(
            {
                "type": st.just("json_schema"),
                "json_schema": st.fixed_dictionaries(
                    {"name": st.just("out"), "schema": rarely(st.sampled_from(SCHEMAS), JSON_VALUES)}
                ),
            }
        ),
    )
    penalty = st.floats(-2, 2) | st.integers(-2, 2)
    fields = {
        "temperature": st.floats(0, 1.5),
        "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.integers(0, 100_000),
        "min_p": st.floats(0, 1),
        "repeat_penalty": st.floats(0, 10, exclude_min=True),
        "presence_penalty": penalty,
        "frequency_penalty": penalty,
        "max_tokens": st.integers(1, 4096),
        "max_completion_tokens": st.integers(1, 4096),
        "stop": st.one_of(text, st.lists(text, max_size=16)),
        "seed": st.integers(-1, 2**64 - 1),
        "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=4),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 20),
        "response_format": response_format,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "n": st.integers(1, 3),
        "user": text,
        "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
        "timeout": st.floats(0, 30, exclude_min=True),
    }
    valid = st.fixed_dictionaries(
        {
            "model": st.sampled_from([model_id] * 18 + ["gpt-4o", ""]),
            "messages": st.lists(message, min_size=1, max_size=4),
            "stream": st.booleans(),
        },
        optional=fields,
    )
    names = sorted(fields) + ["model", "messages", "stream", "tools", "functions", "unknown_field", "\ud800"]
    corruption = st.tuples(st.integers(0, 3), st.sampled_from(names), JSON_VALUES)
    return st.tuples(valid, corruption).map(corrupt)


def corrupt(pair: tuple[dict, tuple[int, str, Any]]) -> dict:
    body, (dice, name, value) = pair
    if "top_logprobs" in body:
        body = {**body, "logprobs": True}  # needed with top_logprobs
    return body if dice else {**body, name: value}


def fuzz_openai(tally: Tally, node, model_id: str) -> None:
    label = "POST /v1/chat/completions"
    tally.operations.append(label)
    tally.begin(label, OPENAI_BUDGET_S)
    client = httpx.Client(base_url=node.base, headers=HEADERS, timeout=httpx.Timeout(HTTP_TIMEOUT_S, connect=5))

    @settings(FUZZ_SETTINGS, max_examples=OPENAI_EXAMPLES)
    @given(body=openai_bodies(model_id))
    def run(body: dict) -> None:
        if tally.out_of_time():
            return
        body = small(body)
        tally.examples += 1
        raw = json.dumps(body)  # ensure_ascii: a lone surrogate travels as a legal \\ud800 escape
        repro = f"curl -X POST {node.base}/v1/chat/completions -H 'Content-Type: application/json' -d '{raw[:1500]}'"
        started = time.monotonic()
        try:
            with client.stream("POST", "/v1/chat/completions", content=raw) as r:
                content_type = r.headers.get("content-type", "")
                if not content_type.startswith("text/event-stream"):
                    r.read()
                    check_response(tally, label, repro, r.status_code, content_type, r.text, body)
                    return
                count(tally, label, f"{r.status_code} stream")
                events = []
                for line in r.iter_lines():
                    if time.monotonic() - started > HTTP_TIMEOUT_S:
                        raise httpx.ReadTimeout("stream ran past the cap")
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])
        except httpx.TimeoutException:
            tally.hangs.append(f"{label}: no complete answer within {HTTP_TIMEOUT_S} s\n  {repro}")
            return
        except httpx.HTTPError as exc:
            tally.server_errors.append(f"{label}: {type(exc).__name__} {exc}\n  {repro}")
            return
        check_stream(tally, label, repro, events)

    try:
        run()
    finally:
        client.close()


def check_stream(tally: Tally, label: str, repro: str, events: list[str]) -> None:
    if not events or events[-1] != "[DONE]":
        tally.bad_bodies.append(f"{label}: stream without [DONE]: {events[-3:]}\n  {repro}")
        return
    for data in events[:-1]:
        try:
            event = json.loads(data)
        except ValueError:
            tally.bad_bodies.append(f"{label}: SSE event that is not JSON: {data[:200]!r}\n  {repro}")
            return
        error = event.get("error") if isinstance(event, dict) else None
        # A request may fail mid-stream for its own reasons (guide dead end, timeout); never internally.
        if isinstance(error, dict) and error.get("code") in ("internal", "engine_error"):
            tally.server_errors.append(f"{label}: error event in the stream: {data[:300]}\n  {repro}")


RAW_BODIES = [
    b"",
    b"null",
    b"[]",
    b"{}",
    b'"text"',
    b"1e999",
    b"{",
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "max_tokens": "x"}',
    b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 16}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "seed": 18446744073709551615}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "seed": 18446744073709551616}',
    b"\xff\xfe",
]


def post_raw_bodies(tally: Tally, node, model_id: str) -> None:
    """Bodies no generator writes (empty, not an object, duplicate keys, bad UTF-8) on both families."""
    tally.begin("raw bodies", RAW_BUDGET_S)
    with httpx.Client(base_url=node.base, headers=HEADERS, timeout=httpx.Timeout(HTTP_TIMEOUT_S, connect=5)) as c:
        for path in ("/predict", "/predict_async", "/v1/chat/completions"):
            label = f"POST {path}"
            for raw in RAW_BODIES:
                if tally.out_of_time():
                    return
                if path.startswith("/v1/") and raw.startswith(b'{"messages"'):
                    raw = raw.replace(b"{", b'{"model": "' + model_id.encode() + b'", ', 1)
                tally.examples += 1
                repro = f"curl -X POST '{node.base}{path}' -H 'Content-Type: application/json' --data-binary {raw!r}"
                try:
                    r = c.post(path, content=raw)
                except httpx.TimeoutException:
                    tally.hangs.append(f"{label}: no answer within {HTTP_TIMEOUT_S} s\n  {repro}")
                    continue
                check_response(tally, label, repro, r.status_code, r.headers.get("content-type", ""), r.text)
        # The documented shapes the generator draws only rarely (how often depends on the whole document,
        # which every new route changes): one body of each, so both are always exercised.
        for body in DOCUMENTED_SHAPES:
            note_shapes(tally, body)
            tally.examples += 1
            r = c.post("/predict", json=body)
            repro = f"curl -X POST '{node.base}/predict' -H 'Content-Type: application/json' -d '{json.dumps(body)}'"
            check_response(tally, "POST /predict", repro, r.status_code, r.headers.get("content-type", ""), r.text)


DOCUMENTED_SHAPES = [
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}], "max_tokens": 8},
    {
        "messages": [{"role": "user", "content": "Call the tool."}],
        "max_tokens": 24,
        "guided_decoding": {
            "structural_tag": {
                "triggers": ["<call>"],
                "structures": [{"begin": "<call>", "schema": {"type": "object"}, "end": "</call>"}],
            }
        },
    },
]


def wait_idle(tally: Tally, node, limit_s: float = 90.0) -> None:
    """Let the async backlog (up to max_queued requests) finish, so later sync waits do not queue behind it."""
    deadline = time.monotonic() + limit_s
    in_flight = None
    while time.monotonic() < deadline:
        body = httpx.get(node.base + "/status", timeout=10).json()
        in_flight = body.get("result", body)["engine"]["in_flight"]
        if in_flight == 0:
            return
        time.sleep(0.5)
    tally.hangs.append(f"{in_flight} accepted request(s) still in flight {limit_s:.0f} s after the last submit")


def poll_accepted(tally: Tally, node, session: requests.Session) -> None:
    """request_status (return_full too) of what the async routes accepted: each stored record must read back."""
    label = "GET /request_status"
    tally.begin(f"{label} of the accepted", RAW_BUDGET_S)
    for request_id in tally.accepted_ids[:40]:
        if tally.out_of_time():
            return
        for full in ("false", "true"):
            tally.examples += 1
            params = {"request_id": request_id, "return_full": full}
            repro = f"curl '{node.base}/request_status?request_id={request_id}&return_full={full}'"
            try:
                r = session.get(node.base + "/request_status", params=params, timeout=(5, HTTP_TIMEOUT_S))
            except requests.Timeout:
                tally.hangs.append(f"{label}: no answer within {HTTP_TIMEOUT_S} s\n  {repro}")
                continue
            check_response(tally, label, repro, r.status_code, r.headers.get("content-type", ""), r.text)


def test_fuzz_openapi_no_5xx_no_hang(node, capsys):
    started = time.monotonic()
    health = httpx.get(node.base + "/health", timeout=10)
    assert health.status_code == 200
    worker_pid = node.worker_pid()
    model_id = httpx.get(node.base + "/v1/models", timeout=10).json()["data"][0]["id"]
    schema = schemathesis.openapi.from_url(node.base + "/openapi.json", timeout=10)
    tally = Tally()
    session = requests.Session()

    # The document describes content-part arrays and structural tags (api/fields.py), so they are fuzzed too.
    components = httpx.get(node.base + "/openapi.json", timeout=10).json()["components"]["schemas"]
    content = components["MessageBody"]["properties"]["content"]["anyOf"]
    assert any(c.get("type") == "array" for c in content), content
    assert "structural_tag" in components["GuidedDecodingBody"]["properties"]

    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/predict", "/predict_async", "/request_status", "/health", "/v1/models"} <= paths
    assert "/v1/chat/completions" in paths  # described without a body: fuzzed below with our own strategy
    for operation in operations:
        if operation.path == "/v1/chat/completions":
            continue
        tally.operations.append(f"{operation.method.upper()} {operation.path}")
        has_inputs = operation.body or any(True for _ in operation.iter_parameters())
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_inputs else (GenerationMode.POSITIVE,):
            try:
                fuzz_operation(tally, operation, mode, node.base, session, model_id)
            except Unsatisfiable:
                # No input violates the schema (a path parameter that is any string): nothing to send.
                assert mode is GenerationMode.NEGATIVE, f"{operation.path}: no valid input could be generated"
    wait_idle(tally, node)
    fuzz_openai(tally, node, model_id)
    post_raw_bodies(tally, node, model_id)
    poll_accepted(tally, node, session)

    # Still serving after it all: a plain request completes, on the same worker process.
    final = httpx.post(
        node.base + "/v1/chat/completions",
        json={"model": model_id, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
        timeout=HTTP_TIMEOUT_S,
    )
    assert final.status_code == 200, final.text
    health = httpx.get(node.base + "/health", timeout=10)
    restarted = [] if node.worker_pid() == worker_pid else ["the worker restarted during the fuzz run"]
    line = tally.summary(time.monotonic() - started)
    with capsys.disabled():
        print("\n" + line + "\n" + tally.breakdown())
    failures = tally.failures() + restarted
    if not tally.skipped:  # every example was sent: the documented shapes were among them
        assert tally.shapes["content_parts"] and tally.shapes["structural_tag"], tally.shapes
    assert health.status_code == 200, health.text
    assert not failures, line + "\n" + "\n".join(failures[:20]) + "\n--- node log ---\n" + node.log()
    if tally.skipped:  # a slow machine sends fewer examples; what was sent passed
        left = dict(tally.skipped_by_operation)
        warnings.warn(f"fuzz budgets hit: example(s) not sent, by operation: {left}", stacklevel=1)

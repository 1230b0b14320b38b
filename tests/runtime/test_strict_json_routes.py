"""One strict JSON reader on every route (issue 20, item 4) and a client hanging up mid-body (issue 20's
probe): against a real node."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from tests.nodeproc import NodeProcess, wait_until

JSON = {"content-type": "application/json"}
POST_ROUTES = (
    "/predict",
    "/predict_async",
    "/create_chat_completion",
    "/create_chat_completion_async",
    "/v1/chat/completions",
    "/console/api/check",
    "/console/api/validate",
)
DISCONNECT_LINE = "client disconnected mid-body"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    proc = NodeProcess(tmp_path_factory.mktemp("strict")).start()
    yield proc
    proc.stop()


def _full_log(node: NodeProcess) -> str:
    return node.log_path.read_text(errors="replace")


def _queues(local_port: int, remote_port: int) -> tuple[int, int] | None:
    """(send queue, receive queue) in bytes of the loopback TCP socket local_port -> remote_port
    (/proc/net/tcp: a send queue is what the peer has not acknowledged, a receive queue what the
    process has not read); None when there is no such socket."""
    local, remote = f"0100007F:{local_port:04X}", f"0100007F:{remote_port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[2] == remote:
            tx, rx = fields[4].split(":")
            return int(tx, 16), int(rx, 16)
    return None


def _node_has_read_all(node: NodeProcess, sock: socket.socket) -> bool:
    """Everything sent on `sock` reached the node's socket (acknowledged) and the node read it."""
    mine, theirs = sock.getsockname()[1], node.port
    sent, received = _queues(mine, theirs), _queues(theirs, mine)
    return sent is not None and sent[0] == 0 and received is not None and received[1] == 0


@pytest.mark.slow
def test_a_duplicate_key_is_a_400_naming_it_on_the_chat_and_openai_routes(node):
    """On the previous main the last value won silently: a proxy reading the first saw another request."""
    model = node.client().get("/v1/models").json()["data"][0]["id"]
    cases = [
        ("/predict", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "max_tokens": 4096}'),
        ("/create_chat_completion", b'{"messages": [{"role": "user", "role": "system", "content": "hi"}]}'),
        (
            "/v1/chat/completions",
            b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", "content": "hi"}], '
            b'"temperature": 0, "temperature": 1}',
        ),
    ]
    with node.client() as c:
        for path, raw in cases:
            r = c.post(path, content=raw, headers=JSON)
            assert r.status_code == 400, (path, r.text[:300])
            body = r.json()
            message = body["error"]["message"] if path.startswith("/v1/") else body["result"]["error"]
            key = {"/predict": "max_tokens", "/create_chat_completion": "role"}.get(path, "temperature")
            assert f'duplicate key "{key}"' in message, message
        assert c.get("/health").status_code == 200


@pytest.mark.slow
def test_a_client_hanging_up_mid_body_is_one_info_line(node):
    """On the previous main each of these logged two tracebacks (~67 lines, starlette ClientDisconnect)."""
    before = _full_log(node)
    for path in POST_ROUTES:
        sock = socket.create_connection(("127.0.0.1", node.port))
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Content-Length: 500\r\n\r\n".encode()
            + b'{"messages":'  # 12 of the 500 bytes
        )
        # The node took the head and the start of the body in: the request is the route's, mid-body.
        wait_until(lambda s=sock: _node_has_read_all(node, s), 30, f"the node to read what was sent to {path}")
        sock.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        new = _full_log(node)[len(before) :]
        if new.count(DISCONNECT_LINE) >= len(POST_ROUTES):
            break
        time.sleep(0.2)
    lines = [ln for ln in new.splitlines() if ln.strip()]
    assert sum(DISCONNECT_LINE in ln for ln in lines) == len(POST_ROUTES), new[-3000:]
    for path in POST_ROUTES:  # one line for each route, naming it
        assert sum(f"{DISCONNECT_LINE} on POST {path} (" in ln for ln in lines) == 1, (path, new[-3000:])
    assert "Traceback" not in new and "ClientDisconnect" not in new, new[-3000:]
    # Nothing else per disconnect: at most one line each besides ours (an access-log line, if any).
    assert len(lines) <= 2 * len(POST_ROUTES), new[-3000:]
    with node.client() as c:
        assert c.get("/health").status_code == 200


@pytest.mark.slow
def test_costly_schemas_are_400s_while_health_and_a_plain_request_are_answered(node):
    """Issue 41's probe: six costly schemas at once used to hold every route (~27 s) while they compiled in
    the event loop's thread pool. Now each is a 400 from its own budgeted child, and the node answers
    /health and a plain chat while they are being refused."""
    import threading

    model = node.client().get("/v1/models").json()["data"][0]["id"]

    def costly(i: int) -> dict:  # distinct schemas: none is answered from the cache
        schema = {"anyOf": [{"type": "string", "minLength": 9000, "maxLength": 9000 + i + k} for k in range(80)]}
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        return {"model": model, "messages": [{"role": "user", "content": "x"}], "response_format": fmt}

    answers: dict[int, tuple[int, str]] = {}

    def send(i: int) -> None:
        with node.client(timeout=120) as c:
            r = c.post("/v1/chat/completions", json=costly(i))
            answers[i] = (r.status_code, r.text[:300])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    with node.client(timeout=120) as c:
        assert c.get("/health").status_code == 200
        health_before_refusals = len(answers) < 6
        plain = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
        r = c.post("/v1/chat/completions", json=plain)
        assert r.status_code == 200, r.text[:300]
    for t in threads:
        t.join(120)
    assert health_before_refusals
    assert sorted(answers) == list(range(6))
    for status, text in answers.values():
        assert status == 400 and ("of CPU" in text or "MB" in text), text

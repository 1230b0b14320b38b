"""A tiny OpenAI-shaped chat server whose every answer a test scripts, and which counts every POST.

Why a stub and not the node: the retry and journal tests must force exact server behaviour that the
node shows only under load or never (a 429 with a chosen Retry-After, an answer slower than the
client's timeout, a connection dropped after the request arrived, hostile response bodies), and must
count how many POSTs really reached the server. It is still a real HTTP server on a real socket, so
the client side (requests, urllib3, keep-alive, timeouts) runs exactly as in production.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


@dataclass
class Reply:
    status: int = 200
    body: bytes | dict[str, Any] | None = None  # None: a chat completion that echoes the prompt
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0  # sleep before answering (past the client's timeout: a read timeout)
    drop: bool = False  # close the connection without any answer, after the request arrived
    hold: threading.Event | None = None  # answer only once the test sets it


def completion(prompt: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": f"echo {prompt}"}, "finish_reason": "stop"}
        ],
    }


Respond = Callable[[str, int], Reply]  # (prompt, how many POSTs of that prompt came before) -> Reply


class StubServer:
    def __init__(self, respond: Respond | None = None, port: int = 0):
        self.respond: Respond = respond or (lambda prompt, n: Reply())
        self.posts: list[tuple[float, str]] = []  # (time.monotonic(), prompt) of every POST received
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real servers do

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                messages = json.loads(raw).get("messages") or [{}]
                prompt = str(messages[-1].get("content"))
                with stub._lock:
                    n = sum(1 for _, p in stub.posts if p == prompt)
                    stub.posts.append((time.monotonic(), prompt))
                reply = stub.respond(prompt, n)
                if reply.hold is not None:
                    reply.hold.wait(60)
                time.sleep(reply.delay_s)
                if reply.drop:
                    self.close_connection = True
                    return
                body = reply.body if reply.body is not None else completion(prompt)
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                try:
                    self.send_response(reply.status)
                    for k, v in {"Content-Type": "application/json", **reply.headers}.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (read timeout, Ctrl-C): nothing to answer
                    self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def count(self, prompt: str) -> int:
        with self._lock:
            return sum(1 for _, p in self.posts if p == prompt)

    def times(self, prompt: str) -> list[float]:
        with self._lock:
            return [t for t, p in self.posts if p == prompt]


def batch_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edgellm", "batch-run", *args], capture_output=True, text=True, timeout=timeout
    )


def req(rid: str | int, prompt: str | None = None, **fields: Any) -> dict[str, Any]:
    """A request whose prompt is its id, so the stub can tell requests apart (the id is not sent)."""
    return {"id": rid, "model": "m", "messages": [{"role": "user", "content": prompt or str(rid)}], **fields}


def write_requests(path: Path, requests: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"requests": requests}))
    return path


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]

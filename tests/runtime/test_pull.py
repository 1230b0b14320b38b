"""`edgellm pull` against a real local HTTP server (no test touches the internet): a transfer dropped
midway resumes with a Range request, in the same run and in the next one; a wrong sha256 leaves no
file; no room is refused before a byte is written; a preset's split GGUF comes whole and is checked
against the hub's X-Linked-Etag; a file already in the Hugging Face cache is linked, not fetched.

The server speaks what the pull relies on: Range / If-Range with a strong ETag, and the hub's resolve
redirect carrying X-Linked-Etag (the LFS sha256) and X-Linked-Size. It can cut its first transfer of a
file halfway (headers say the full length, the connection closes after half the body), as a dropped
Wi-Fi link does."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from edgellm import gguf_split
from edgellm.errors import PullError
from edgellm.pull.fetch import DiskUsage, fetch
from edgellm.pull.sources import plan
from edgellm.runtime.board.presets import load_preset

MIB = 1 << 20


class FileServer:
    """Files by name at /files/NAME, and the hub's /ORG/NAME/resolve/REV/FILE redirecting to them."""

    def __init__(self, files: dict[str, bytes]):
        self.files = dict(files)
        self.drop_first: set[str] = set()  # names whose first full transfer is cut halfway
        self.ignore_range = False
        self.published_sha: dict[str, str] = {}  # what the hub says, when not the true hash
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):  # noqa: N802 (http.server's name)
                server.requests.append((self.path, self.headers.get("Range")))
                pieces = self.path.strip("/").split("/")
                if len(pieces) >= 5 and pieces[2] == "resolve":
                    name = pieces[-1]
                    if name not in server.files:
                        return self._plain(404)
                    sha = server.published_sha.get(name) or hashlib.sha256(server.files[name]).hexdigest()
                    self.send_response(302)
                    self.send_header("Location", f"/files/{name}")
                    self.send_header("X-Linked-Etag", f'"{sha}"')
                    self.send_header("X-Linked-Size", str(len(server.files[name])))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if len(pieces) != 2 or pieces[0] != "files" or pieces[1] not in server.files:
                    return self._plain(404)
                self._send_file(pieces[1])

            def _send_file(self, name: str) -> None:
                body = server.files[name]
                etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
                start = 0
                wanted = self.headers.get("Range")
                if wanted and not server.ignore_range and self.headers.get("If-Range", etag) == etag:
                    start = int(wanted.removeprefix("bytes=").split("-")[0])
                    if start >= len(body):
                        return self._plain(416)
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("ETag", etag)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                if name in server.drop_first and start == 0:
                    server.drop_first.discard(name)
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                self.wfile.write(body[start:])

            def _plain(self, status: int) -> None:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _blob(size: int, seed: int = 1) -> bytes:
    out, block = bytearray(), hashlib.sha256(str(seed).encode()).digest()
    while len(out) < size:
        block = hashlib.sha256(block).digest()
        out += block * 64
    return bytes(out[:size])


def _pull(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edgellm", "pull", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_a_dropped_transfer_resumes_with_a_range_request_and_is_checked(tmp_path):
    body = _blob(3 * MIB + 123)
    with FileServer({"m.gguf": body}) as srv:
        srv.drop_first.add("m.gguf")
        sha = hashlib.sha256(body).hexdigest()
        done = _pull(f"{srv.base}/files/m.gguf", "--dest", str(tmp_path), "--sha256", sha)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "m.gguf").read_bytes() == body
    assert [r for _, r in srv.requests] == [None, f"bytes={len(body) // 2}-"]  # resumed where it stopped
    assert f"sha256 {sha} checked against --sha256" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no .part left


def test_a_run_that_gives_up_leaves_a_part_the_next_run_resumes(tmp_path):
    body = _blob(2 * MIB)
    with FileServer({"m.gguf": body}) as srv:
        srv.drop_first.add("m.gguf")
        first = _pull(f"{srv.base}/files/m.gguf", "--dest", str(tmp_path), "--retries", "0")
        assert first.returncode == 1 and "run the same command again to resume" in first.stderr, first.stderr
        assert not (tmp_path / "m.gguf").exists()
        assert (tmp_path / "m.gguf.part").stat().st_size == len(body) // 2
        second = _pull(f"{srv.base}/files/m.gguf", "--dest", str(tmp_path))
    assert second.returncode == 0, second.stderr
    assert (tmp_path / "m.gguf").read_bytes() == body
    assert srv.requests[-1][1] == f"bytes={len(body) // 2}-"
    # no hash known for a plain URL: the computed one is printed, and said to be unchecked
    assert f"sha256 {hashlib.sha256(body).hexdigest()} (nothing to check it against" in second.stdout


def test_a_server_that_ignores_range_sends_it_whole_and_the_file_is_still_right(tmp_path):
    body = _blob(2 * MIB, seed=2)
    with FileServer({"m.gguf": body}) as srv:
        srv.drop_first.add("m.gguf")
        srv.ignore_range = True
        done = _pull(f"{srv.base}/files/m.gguf", "--dest", str(tmp_path), "--sha256", hashlib.sha256(body).hexdigest())
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "m.gguf").read_bytes() == body
    assert "starting over" in done.stderr


def test_a_wrong_sha256_leaves_no_model_file_and_no_part(tmp_path):
    body = _blob(MIB)
    with FileServer({"m.gguf": body}) as srv:
        done = _pull(f"{srv.base}/files/m.gguf", "--dest", str(tmp_path), "--sha256", "ab" * 32)
    assert done.returncode == 1
    assert "expected " + "ab" * 32 in done.stderr and "the download was removed" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_no_room_is_refused_before_a_byte_is_written(tmp_path):
    """The free space comes from a fake statvfs (disk_usage): filling a real disk in a test is not safe."""
    body = _blob(4 * MIB)
    with FileServer({"m.gguf": body}) as srv, httpx.Client(follow_redirects=True) as client:
        remote = plan(f"{srv.base}/files/m.gguf", dest=str(tmp_path)).files[0]
        with pytest.raises(PullError, match=r"not enough space in .* for m.gguf: 4.0 MiB more to fetch"):
            fetch(remote, tmp_path, client=client, disk_usage=lambda path: DiskUsage(1 << 30, 0, 2 * MIB))
        assert list(tmp_path.iterdir()) == []
        # with room, the same call fetches it
        done = fetch(remote, tmp_path, client=client, disk_usage=lambda path: DiskUsage(1 << 30, 0, 1 << 30))
    assert done.how == "downloaded" and done.path.read_bytes() == body


def _preset(tmp_path: Path, first: str, sha256: str | None = None) -> Path:
    presets = tmp_path / "presets"
    presets.mkdir()
    models = tmp_path / "models"
    extra = f"  sha256: {sha256}\n" if sha256 else ""
    (presets / "tiny-board.yaml").write_text(
        f"model:\n  name: Tiny\n  hf_repo: acme/Tiny-GGUF\n  file: {first}\n{extra}"
        f"settings:\n  model_path: {models / first}\n",
        encoding="utf-8",
    )
    return presets


def test_a_preset_pulls_every_part_of_a_split_gguf_checked_against_the_hub(tmp_path):
    parts = {f"tiny-q4-0000{i}-of-00002.gguf": _blob(MIB + i, seed=i) for i in (1, 2)}
    presets = _preset(tmp_path, "tiny-q4-00001-of-00002.gguf")
    with FileServer(parts) as srv:
        env = {"EDGELLM_PRESETS_DIR": str(presets), "HF_ENDPOINT": srv.base}
        done = _pull("tiny-board", env=env)
        assert done.returncode == 0, done.stderr
        for name, body in parts.items():
            assert (tmp_path / "models" / name).read_bytes() == body
            assert (
                f"sha256 {hashlib.sha256(body).hexdigest()} checked against the server (X-Linked-Etag)" in done.stdout
            )
        assert done.stdout.strip().endswith(f"model_path: {tmp_path / 'models' / 'tiny-q4-00001-of-00002.gguf'}")
        assert srv.requests[0][0] == "/acme/Tiny-GGUF/resolve/main/tiny-q4-00001-of-00002.gguf"
        # a hub that publishes another hash than what it serves: refused, nothing left
        other = tmp_path / "other"
        srv.published_sha["tiny-q4-00001-of-00002.gguf"] = "cd" * 32
        bad = _pull("tiny-board", "--dest", str(other), env=env)
    assert bad.returncode == 1 and "from the server (X-Linked-Etag)" in bad.stderr, bad.stderr
    assert list(other.iterdir()) == []


def test_a_preset_sha256_is_checked(tmp_path):
    body = _blob(MIB, seed=9)
    presets = _preset(tmp_path, "one.gguf", sha256="ef" * 32)
    with FileServer({"one.gguf": body}) as srv:
        done = _pull("tiny-board", env={"EDGELLM_PRESETS_DIR": str(presets), "HF_ENDPOINT": srv.base})
    assert done.returncode == 1 and "(from --sha256 or the preset)" in done.stderr, done.stderr
    assert not (tmp_path / "models" / "one.gguf").exists()


def test_a_file_in_the_hugging_face_cache_is_linked_not_fetched(tmp_path):
    body = _blob(MIB, seed=5)
    sha = hashlib.sha256(body).hexdigest()
    commit = "1234567890abcdef1234567890abcdef12345678"
    repo = tmp_path / "hub" / "models--acme--Tiny-GGUF"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / sha).write_bytes(body)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    os.symlink(f"../../blobs/{sha}", repo / "snapshots" / commit / "tiny.gguf")
    dest = tmp_path / "models"
    with FileServer({}) as srv:
        env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": srv.base}
        done = _pull("hf://acme/Tiny-GGUF/tiny.gguf", "--dest", str(dest), env=env)
        assert done.returncode == 0, done.stderr
        assert srv.requests == []  # nothing fetched
        assert (dest / "tiny.gguf").read_bytes() == body
        assert (
            f"linked from the Hugging Face cache, {len(body)} bytes; sha256 {sha} checked against the cache"
            in done.stdout
        )
        # a damaged blob (its content no longer hashes to its name) is not used: the hub is asked, and 404s
        (repo / "blobs" / sha).write_bytes(body[:-1] + b"x")
        again = _pull("hf://acme/Tiny-GGUF/tiny.gguf", "--dest", str(tmp_path / "again"), env=env)
    assert again.returncode == 1 and "does not match its sha256" in again.stderr and "not found (404)" in again.stderr


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ftp://host/m.gguf", "only http://, https:// and hf:// sources"),
        ("hf://acme", "expected hf://ORG/NAME/FILE"),
        ("hf://acme/Tiny/../x.gguf", "expected hf://ORG/NAME/FILE"),
        ("http://127.0.0.1:9/", "does not end in a file name"),
        ("no-such-board", "unknown preset 'no-such-board'"),
    ],
)
def test_a_spec_it_cannot_use_is_exit_2_with_the_reason(spec, message):
    done = _pull(spec)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_bad_sha256_argument_is_exit_2():
    done = _pull("http://127.0.0.1:9/m.gguf", "--sha256", "xyz")
    assert done.returncode == 2 and "is not a sha256" in done.stderr


def test_the_shipped_presets_name_hub_files_and_every_part():
    names = ("orin-nano", "orin-nx-16gb", "agx-orin-32gb", "agx-orin-64gb", "agx-thor")
    plans = {name: plan(name) for name in names}
    assert [len(p.files) for p in plans.values()] == [1, 1, 2, 3, 5]
    big = plans["agx-orin-64gb"]
    assert big.files[2].url == (
        "https://huggingface.co/Qwen/Qwen2.5-14B-Instruct-GGUF/resolve/main/qwen2.5-14b-instruct-q4_k_m-00003-of-00003.gguf"
    )
    # the node is given the first part, where the preset's model_path points
    assert str(big.model_path) == load_preset("agx-orin-64gb").settings["model_path"]


def test_a_split_gguf_is_sized_by_all_its_parts(tmp_path):
    names = gguf_split.split_parts("m-00001-of-00003.gguf")
    assert names == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]
    assert gguf_split.split_parts("m-00002-of-00003.gguf") == ["m-00002-of-00003.gguf"]  # not the first
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(b"x" * (10 + i))
    assert gguf_split.total_bytes(str(tmp_path / names[0])) == 33

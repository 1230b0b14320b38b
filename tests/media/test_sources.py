"""load_bytes / decode_base64: data: URLs, local files confined to media_dirs, http(s) against a local server."""

from __future__ import annotations

import base64
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from edgellm.media.errors import MediaError, MediaTooLarge
from edgellm.media.limits import MediaLimits, MediaSources
from edgellm.media.sources import decode_base64, load_bytes

LIMITS = MediaLimits()
NO_FILES = MediaSources()
PAYLOAD = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --- data: URLs and base64 ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        f"data:image/png;base64,{_b64(PAYLOAD)}",
        f"data:audio/wav;base64,{_b64(PAYLOAD)}",
        f"data:;base64,{_b64(PAYLOAD)}",
        f"DATA:image/png;BASE64,{_b64(PAYLOAD)}",
        f"  data:image/png;base64,{_b64(PAYLOAD)[:50]}\n {_b64(PAYLOAD)[50:]}\n",  # line-wrapped base64
    ],
)
def test_base64_data_urls(url):
    assert load_bytes(url, NO_FILES, LIMITS) == PAYLOAD


def test_percent_encoded_data_url():
    assert load_bytes("data:,hello%20world%00%FF", NO_FILES, LIMITS) == b"hello world\x00\xff"
    assert load_bytes("data:text/plain;charset=utf-8,abc", NO_FILES, LIMITS) == b"abc"
    assert load_bytes("data:\x00;base64,AAAA", NO_FILES, LIMITS) == b"\0\0\0"  # the mediatype is not trusted


@pytest.mark.parametrize(
    "url,message",
    [
        ("data:image/png;base64,iVBOR!!w0KGgo=", "invalid base64"),
        ("data:image/png;base64,iVBORw0KGgo", "invalid base64"),  # missing padding
        ("data:image/png;base64,aGVsbG8-_w==", "invalid base64"),  # url-safe alphabet
        ("data:image/png;base64,aGVsbG8é==", "invalid base64"),
        ("data:image/png;base64,", "empty"),
        ("data:image/png;base64", "no ','"),
    ],
)
def test_bad_data_urls(url, message):
    with pytest.raises(MediaError, match=message) as caught:
        load_bytes(url, NO_FILES, LIMITS, param="image_url")
    assert caught.value.param == "image_url" and caught.value.http_status == 400


def test_data_url_size_cap():
    small = MediaLimits(max_bytes=100)
    assert len(load_bytes(f"data:;base64,{_b64(bytes(100))}", NO_FILES, small)) == 100
    with pytest.raises(MediaTooLarge, match="the limit is 100 bytes") as caught:
        load_bytes(f"data:;base64,{_b64(bytes(101))}", NO_FILES, small, param="p")  # same length as 102 bytes
    assert caught.value.http_status == 413 and caught.value.param == "p"
    with pytest.raises(MediaTooLarge):
        load_bytes(f"data:;base64,{_b64(bytes(200))}", NO_FILES, small)
    with pytest.raises(MediaTooLarge):
        load_bytes("data:;base64," + "A" * 10_000_000, NO_FILES, small)  # refused by length, not decoded
    with pytest.raises(MediaTooLarge):
        load_bytes("data:," + "x" * 101, NO_FILES, small)
    with pytest.raises(MediaTooLarge):
        load_bytes("data:," + "%41" * 101, NO_FILES, small)


def test_decode_base64():
    assert decode_base64(_b64(PAYLOAD), LIMITS) == PAYLOAD
    assert decode_base64(" " + _b64(PAYLOAD) + "\n", LIMITS) == PAYLOAD
    for bad in ("abc", "a===", "!!!!", "\ud800AAA", "Zm9v\x00"):
        with pytest.raises(MediaError, match="invalid base64"):
            decode_base64(bad, LIMITS, param="input_audio.data")
    with pytest.raises(MediaError, match="must be a string"):
        decode_base64(b"Zm9v", LIMITS)  # type: ignore[arg-type]
    with pytest.raises(MediaTooLarge):
        decode_base64(_b64(bytes(30)), MediaLimits(max_bytes=20))


def test_raw_base64_is_not_a_reference(tmp_path):
    with pytest.raises(MediaError, match="looks like raw base64: send it as a data: URL"):
        load_bytes(_b64(PAYLOAD), MediaSources(media_dirs=(str(tmp_path),)), LIMITS, base_dir=str(tmp_path))


@pytest.mark.parametrize("ref", ["ftp://host/a.png", "javascript:alert(1)", "gopher://x", "s3://bucket/a.png"])
def test_other_schemes_are_refused(ref):
    with pytest.raises(MediaError, match="unsupported URL scheme"):
        load_bytes(ref, MediaSources(media_dirs=("/",), allow_remote=True), LIMITS)


# --- local files --------------------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path):
    """media/ (the allowed folder) holding a.png, and outside it secret.png."""
    media = tmp_path / "media"
    media.mkdir()
    (media / "a.png").write_bytes(PAYLOAD)
    (media / "with space.png").write_bytes(PAYLOAD)
    (media / "sub").mkdir()
    (tmp_path / "secret.png").write_bytes(b"secret")
    (tmp_path / "media2").mkdir()  # shares a prefix with media/
    (tmp_path / "media2" / "b.png").write_bytes(b"secret")
    return tmp_path, MediaSources(media_dirs=(str(media),))


def test_files_inside_media_dirs(tree):
    root, sources = tree
    media = root / "media"
    assert load_bytes(str(media / "a.png"), sources, LIMITS) == PAYLOAD
    assert load_bytes(f"file://{media}/a.png", sources, LIMITS) == PAYLOAD
    assert load_bytes(f"file://localhost{media}/a.png", sources, LIMITS) == PAYLOAD
    assert load_bytes(f"file://{media}/with%20space.png", sources, LIMITS) == PAYLOAD
    assert load_bytes(str(media / "sub" / ".." / "a.png"), sources, LIMITS) == PAYLOAD
    (media / "link.png").symlink_to(media / "a.png")
    assert load_bytes(str(media / "link.png"), sources, LIMITS) == PAYLOAD


def test_media_dir_named_through_a_symlink(tree):
    root, _ = tree
    (root / "alias").symlink_to(root / "media")
    sources = MediaSources(media_dirs=(str(root / "alias"),))
    assert load_bytes(str(root / "media" / "a.png"), sources, LIMITS) == PAYLOAD
    assert load_bytes(str(root / "alias" / "a.png"), sources, LIMITS) == PAYLOAD


@pytest.mark.parametrize(
    "ref",
    [
        "{root}/secret.png",
        "file://{root}/secret.png",
        "{root}/media/../secret.png",
        "{root}/media/sub/../../secret.png",
        "{root}/media2/b.png",
        "{root}/media/escape.png",  # a symlink inside media/ pointing outside
        "{root}/nope/missing.png",  # missing, and outside: the same answer as for an existing file
        "/etc/passwd",
    ],
)
def test_files_outside_media_dirs(tree, ref):
    root, sources = tree
    (root / "media" / "escape.png").symlink_to(root / "secret.png")
    outside = r"((secret|b|escape|missing)\.png|passwd)' is outside the configured media_dirs \('/.*/media'\)"
    with pytest.raises(MediaError, match=outside) as caught:
        load_bytes(ref.format(root=root), sources, LIMITS, param="image_url")
    assert caught.value.param == "image_url"


def test_relative_paths_use_base_dir(tree):
    root, sources = tree
    media = str(root / "media")
    assert load_bytes("a.png", sources, LIMITS, base_dir=media) == PAYLOAD
    assert load_bytes("sub/../a.png", sources, LIMITS, base_dir=media) == PAYLOAD
    with pytest.raises(MediaError, match="outside the configured media_dirs"):
        load_bytes("../secret.png", sources, LIMITS, base_dir=media)
    with pytest.raises(MediaError, match="relative path 'a.png'"):
        load_bytes("a.png", sources, LIMITS)


def test_local_files_disabled_without_media_dirs(tree):
    root, _ = tree
    for ref in (str(root / "media" / "a.png"), f"file://{root}/media/a.png", "a.png"):
        with pytest.raises(MediaError, match="local media files are disabled.*media_dirs"):
            load_bytes(ref, NO_FILES, LIMITS, base_dir=str(root / "media"))


def test_unreadable_local_files(tree):
    root, sources = tree
    media = root / "media"
    with pytest.raises(MediaError, match="no such file"):
        load_bytes(str(media / "missing.png"), sources, LIMITS)
    with pytest.raises(MediaError, match="is a directory"):
        load_bytes(str(media / "sub"), sources, LIMITS)
    os.mkfifo(media / "fifo")
    start = time.monotonic()
    with pytest.raises(MediaError, match="not a regular file"):
        load_bytes(str(media / "fifo"), sources, LIMITS)  # must not block waiting for a writer
    assert time.monotonic() - start < 1
    (media / "dangling.png").symlink_to(media / "gone.png")
    with pytest.raises(MediaError, match="no such file"):
        load_bytes(str(media / "dangling.png"), sources, LIMITS)
    with pytest.raises(MediaError, match="file:///"):
        load_bytes(f"file://otherhost{media}/a.png", sources, LIMITS)
    with pytest.raises(MediaError, match="query or fragment"):
        load_bytes(f"file://{media}/a.png?x=1", sources, LIMITS)


def test_local_file_size_cap(tree):
    root, sources = tree
    with pytest.raises(MediaTooLarge, match=f"the media file is {len(PAYLOAD)} bytes; the limit is 100 bytes"):
        load_bytes(str(root / "media" / "a.png"), sources, MediaLimits(max_bytes=100))
    assert load_bytes(str(root / "media" / "a.png"), sources, MediaLimits(max_bytes=len(PAYLOAD))) == PAYLOAD


HOSTILE = [
    "",
    " \n\t",
    "\x00",
    "/tmp/\x00x",
    "\ud800",
    "/\udc80\udcff",
    "file:///\udc80",
    "file:///%00",
    "file:///%ff%fe",
    "file://[::1/x",
    "file:",
    "data:,\ud800",
    "data:image/png;base64,\ud800",
    "http://\x00",
    "http://[::1",
    "http://a b/",
    "https://127.0.0.1:1/x",  # nothing listens on port 1: connection refused
    "http://127.0.0.1:99999/",
    "x" * 100_000,
    "/" + "a" * 100_000,
    "a/" * 50_000,
    "data:" + "A" * 100_000,
    "file://" + "%2e%2e/" * 1000 + "etc/passwd",
    "\\\\server\\share\\a.png",
]


@pytest.mark.parametrize("ref", HOSTILE, ids=range(len(HOSTILE)))
@pytest.mark.parametrize("allow_remote", [False, True])
def test_hostile_references_only_raise_media_errors(tmp_path, ref, allow_remote):
    sources = MediaSources(media_dirs=(str(tmp_path),), allow_remote=allow_remote, remote_timeout_s=2)
    with pytest.raises((MediaError, MediaTooLarge)) as caught:
        load_bytes(ref, sources, MediaLimits(max_bytes=1000), base_dir=str(tmp_path))
    assert len(caught.value.message) < 400


def test_non_string_reference():
    with pytest.raises(MediaError, match="must be a string"):
        load_bytes(None, NO_FILES, LIMITS)  # type: ignore[arg-type]


# --- http(s) ------------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep the test output clean
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        routes = {
            "/img": lambda: self._send(200, PAYLOAD),
            "/missing": lambda: self._send(404, b"not here"),
            "/big": self._big,
            "/declared-big": lambda: self._send(200, b"", length=10_000_000),
            "/slow": self._slow,
            "/redirect": lambda: self._redirect("/img"),
            "/loop": lambda: self._redirect("/loop"),
            "/to-file": lambda: self._redirect("file:///etc/passwd"),
            "/gzip": lambda: self._send(200, b"\x1f\x8b...", headers={"Content-Encoding": "gzip"}),
        }
        routes.get(self.path, lambda: self._send(404, b""))()

    def _send(self, status: int, body: bytes, *, length: int | None = None, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, where: str) -> None:
        self.send_response(302)
        self.send_header("Location", where)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _big(self) -> None:  # no Content-Length: the body runs until the connection closes
        self.send_response(200)
        self.end_headers()
        try:
            for _ in range(100):
                self.wfile.write(b"x" * 4096)
        except OSError:  # the client stopped reading
            pass

    def _slow(self) -> None:  # each byte well within a per-read timeout, the whole far past the deadline
        self.send_response(200)
        self.send_header("Content-Length", "30")
        self.end_headers()
        try:
            for _ in range(30):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


REMOTE = MediaSources(allow_remote=True, remote_timeout_s=5)


def test_remote_disabled(server):
    with pytest.raises(MediaError, match="allow_remote_media") as caught:
        load_bytes(f"{server}/img", NO_FILES, LIMITS, param="image_url")
    assert caught.value.param == "image_url"


def test_remote_ok_and_redirect(server):
    assert load_bytes(f"{server}/img", REMOTE, LIMITS) == PAYLOAD
    assert load_bytes(f"{server}/redirect", REMOTE, LIMITS) == PAYLOAD


@pytest.mark.parametrize(
    "path,error,message",
    [
        ("/missing", MediaError, "answered HTTP 404"),
        ("/loop", MediaError, "redirected more than 3 times"),
        ("/to-file", MediaError, "could not fetch the media URL"),
        ("/gzip", MediaError, "compressed body"),
        ("/big", MediaTooLarge, "larger than the limit; the limit is 50000 bytes"),
        ("/declared-big", MediaTooLarge, "10000000 bytes; the limit is 50000 bytes"),
    ],
)
def test_remote_failures(server, path, error, message):
    with pytest.raises(error, match=message):
        load_bytes(f"{server}{path}", REMOTE, MediaLimits(max_bytes=50_000))


def test_remote_deadline_covers_the_whole_download(server):
    sources = MediaSources(allow_remote=True, remote_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(MediaError, match="took longer than 0.5 s"):
        load_bytes(f"{server}/slow", sources, LIMITS)
    # The whole download takes 3 s (30 bytes, 0.1 s apart): the deadline cut it, with 2 s for a loaded VM.
    assert time.monotonic() - start < 2.5

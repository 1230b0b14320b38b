"""One file of `edgellm pull`: fetched resumably over HTTP(S), verified, then moved into place.

- The bytes go to NAME.part beside the destination (NAME.part.json says which URL and validator they
  belong to). A dropped connection resumes with a Range request where it stopped, in this run
  (bounded retries with backoff) or in the next one; a server that ignores Range or whose file changed
  (If-Range) sends it whole and the part starts over.
- The disk's free space is checked against what is left to fetch before the first byte is written.
- The sha256 is computed as the bytes arrive and checked before the file is renamed into place
  (atomically, in the same folder): a wrong hash leaves neither a model file nor a part behind. The
  expected hash comes from --sha256 or the preset, else from the server: the Hugging Face hub sends
  an LFS file's sha256 as X-Linked-Etag.
- A file already in the Hugging Face cache (hf_cache.py) is linked, not fetched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import httpx

from edgellm.errors import PullError
from edgellm.pull import hf_cache
from edgellm.pull.sources import RemoteFile, hf_endpoint

CHUNK = 1 << 20
SPACE_RESERVE = 16 << 20  # left free beyond the file: a full disk breaks the registry and the logs too
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class DiskUsage(NamedTuple):
    total: int
    used: int
    free: int


@dataclass(frozen=True)
class Fetched:
    path: Path
    sha256: str | None
    size: int
    how: str  # "downloaded", "already there", "linked from the Hugging Face cache"
    verified_by: str | None  # where the expected sha256 came from; None: nothing to check it against


Say = Callable[[str], None]


def fetch(
    remote: RemoteFile,
    dest: Path,
    *,
    client: httpx.Client,
    retries: int = 8,
    disk_usage: Callable[[str], DiskUsage] = shutil.disk_usage,  # type: ignore[assignment]
    say: Say = lambda line: print(line, file=sys.stderr),
    bar: bool | None = None,
) -> Fetched:
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PullError(f"cannot create {dest}: {exc.strerror or exc}; pass --dest DIR (or run as its owner)") from None
    final = dest / remote.filename
    expected, expected_from = remote.sha256, ("--sha256 or the preset" if remote.sha256 else None)
    if final.is_file():
        if expected is None:
            return Fetched(final, None, final.stat().st_size, "already there", None)
        if _sha256_of(final) == expected:
            return Fetched(final, expected, final.stat().st_size, "already there", expected_from)
        say(f"pull: {final} does not match the expected sha256; fetching it again")
    cached = _from_hf_cache(remote, final, expected, say)
    if cached is not None:
        return cached
    return _Download(remote, final, client, retries, disk_usage, say, bar).run(expected, expected_from)


def _from_hf_cache(remote: RemoteFile, final: Path, expected: str | None, say: Say) -> Fetched | None:
    if remote.hf_repo is None or remote.hf_path is None:
        return None
    found = hf_cache.find(remote.hf_repo, remote.hf_path, remote.revision)
    if found is None:
        return None
    want, source = (expected, "--sha256 or the preset") if expected else (found.sha256, "the cache's blob name")
    digest = _sha256_of(found.path)
    if want is not None and digest != want:
        say(f"pull: {found.path} in the Hugging Face cache does not match its sha256; downloading instead")
        return None
    target = found.path.resolve()
    link = final.with_name(final.name + ".link")
    link.unlink(missing_ok=True)
    os.symlink(target, link)
    os.replace(link, final)  # atomic, as for a download
    return Fetched(final, digest, target.stat().st_size, "linked from the Hugging Face cache", source if want else None)


class _Download:
    def __init__(self, remote: RemoteFile, final: Path, client: httpx.Client, retries: int, disk_usage, say, bar):
        self.remote, self.final, self.client = remote, final, client
        self.part = final.with_name(final.name + ".part")
        self.meta = final.with_name(final.name + ".part.json")
        self.retries, self.disk_usage, self.say = retries, disk_usage, say
        self.bar = sys.stderr.isatty() if bar is None else bar
        self.total: int | None = remote.size
        self.server_sha: str | None = None
        self.validator: str | None = None

    def run(self, expected: str | None, expected_from: str | None) -> Fetched:
        self._resume_point()
        progress = _Progress(self.remote.filename, self.bar, self.say)
        failures, checked_space = 0, False
        try:
            while True:
                if self.total is not None and not checked_space:
                    self._check_space(self.total - self.offset)
                    checked_space = True
                before = self.offset
                try:
                    done = self._transfer(progress)
                except httpx.TransportError as exc:
                    done, error = False, exc
                else:
                    error = None
                if done:
                    break
                # a drop after progress starts the count again: a slow, flaky link still gets there
                failures = 1 if self.offset > before else failures + 1
                if failures > self.retries:
                    have = f"{self.offset} of {self.total}" if self.total else str(self.offset)
                    raise PullError(
                        f"download of {self.remote.url} stopped at {have} bytes after {self.retries} retries"
                        f" ({error or 'the connection closed early'}); run the same command again to resume"
                    )
                time.sleep(min(0.25 * 2**failures, 10.0))
        finally:
            progress.close()
        digest = self.hasher.hexdigest()
        if expected is None and self.server_sha is not None:
            expected, expected_from = self.server_sha, "the server (X-Linked-Etag)"
        size = self.part.stat().st_size
        wrong = None
        if expected is not None and digest != expected:
            wrong = f"sha256 {digest}, expected {expected} (from {expected_from})"
        elif self.remote.size is not None and size != self.remote.size:
            wrong = f"{size} bytes, expected {self.remote.size}"
        if wrong:
            self.part.unlink(missing_ok=True)
            self.meta.unlink(missing_ok=True)
            raise PullError(f"{self.remote.url}: got {wrong}; the download was removed")
        with open(self.part, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(self.part, self.final)
        self.meta.unlink(missing_ok=True)
        _fsync_dir(self.final.parent)
        return Fetched(self.final, digest, size, "downloaded", expected_from)

    def _resume_point(self) -> None:
        """Where an earlier run stopped, when its part belongs to this URL, and the hash of what it holds."""
        self.offset, self.hasher = 0, hashlib.sha256()
        try:
            meta = json.loads(self.meta.read_text(encoding="utf-8"))
            size = self.part.stat().st_size
        except (OSError, ValueError):
            meta, size = None, 0
        if not isinstance(meta, dict) or meta.get("url") != self.remote.url or size == 0:
            self.part.unlink(missing_ok=True)
            return
        self.validator = meta.get("validator") if isinstance(meta.get("validator"), str) else None
        if isinstance(meta.get("total"), int) and self.total is None:
            self.total = meta["total"]
        self.hasher = _hash_file(self.part)  # what arrives next continues this hash
        self.offset = size
        self.say(f"pull: resuming {self.remote.filename} at {_mib(size)}")

    def _transfer(self, progress: _Progress) -> bool:
        """One request from self.offset (moved on, with self.hasher, as bytes arrive, also when the
        connection then drops); whether the file is complete."""
        offset = self.offset
        headers = {"Accept-Encoding": "identity"}  # byte offsets are of the file, not of a gzip stream
        if offset:
            headers["Range"] = f"bytes={offset}-"
            if self.validator:
                headers["If-Range"] = self.validator
        token = os.environ.get("HF_TOKEN")
        if token and self.remote.hf_repo is not None and _same_host(self.remote.url, hf_endpoint()):
            headers["Authorization"] = f"Bearer {token}"
        with self.client.stream("GET", self.remote.url, headers=headers) as resp:
            self._read_hub_headers(resp)
            if resp.status_code == 416 and offset and self.total == offset:
                return True
            if resp.status_code in (200, 206):
                if resp.status_code == 206:
                    start, total = _content_range(resp.headers.get("content-range"))
                    if start != offset:
                        raise PullError(f"{self.remote.url}: asked for bytes from {offset}, was sent from {start}")
                    self.total = total if total is not None else self.total
                else:
                    if offset:  # the whole file again (Range ignored, or If-Range: it changed)
                        self.say(f"pull: the server sent {self.remote.filename} from the start; starting over")
                    offset = self.offset = 0
                    self.hasher = hashlib.sha256()
                    length = resp.headers.get("content-length")
                    if length and length.isdigit():
                        self.total = int(length) if self.total is None else self.total
                if self.total is not None:
                    self._check_space(self.total - offset)
                self.validator = _validator(resp) or (self.validator if resp.status_code == 206 else None)
                self._write_meta()
                progress.start(self.total, offset)
                with open(self.part, "r+b" if offset else "wb") as f:
                    f.seek(offset)
                    f.truncate()
                    try:
                        for block in resp.iter_bytes():  # as it arrives: a fixed size would lose a cut tail
                            f.write(block)
                            self.hasher.update(block)
                            self.offset += len(block)
                            progress.update(self.offset)
                    finally:
                        f.flush()
                if self.total is not None and self.offset > self.total:
                    self.part.unlink(missing_ok=True)
                    raise PullError(f"{self.remote.url}: sent more than the {self.total} bytes announced")
                return self.total is None or self.offset >= self.total
            if resp.status_code == 416:  # the part is not a prefix of what the server has now
                self.part.unlink(missing_ok=True)
                self.offset, self.hasher = 0, hashlib.sha256()
                return False
            if resp.status_code in (408, 429) or resp.status_code >= 500:
                return False  # worth another try
            if resp.status_code in (401, 403):
                hint = "; a gated or private Hugging Face repo needs HF_TOKEN" if self.remote.hf_repo else ""
                raise PullError(f"{self.remote.url}: refused ({resp.status_code}){hint}")
            if resp.status_code == 404:
                raise PullError(f"{self.remote.url}: not found (404)")
            raise PullError(f"{self.remote.url}: the server answered {resp.status_code}")

    def _read_hub_headers(self, resp: httpx.Response) -> None:
        """The hub sends an LFS file's sha256 and size on the resolve answer (the redirect to the CDN)."""
        for r in (*resp.history, resp):
            etag = (r.headers.get("x-linked-etag") or "").strip().removeprefix("W/").strip('"').lower()
            if _SHA256.match(etag):
                self.server_sha = etag
            size = r.headers.get("x-linked-size")
            if size and size.isdigit() and self.total is None:
                self.total = int(size)

    def _check_space(self, needed: int) -> None:
        free = self.disk_usage(str(self.final.parent)).free
        if needed > 0 and free < needed + SPACE_RESERVE:
            raise PullError(
                f"not enough space in {self.final.parent} for {self.remote.filename}: {_mib(needed)} more to "
                f"fetch (+{_mib(SPACE_RESERVE)} kept free), {_mib(free)} free"
            )

    def _write_meta(self) -> None:
        data = {"url": self.remote.url, "validator": self.validator, "total": self.total}
        self.meta.write_text(json.dumps(data), encoding="utf-8")


class _Progress:
    """A tqdm bar on a terminal; otherwise a line at each tenth and at most every 30 s (journal, CI)."""

    def __init__(self, name: str, bar: bool, say: Say):
        self.name, self.use_bar, self.say = name, bar, say
        self.bar: Any = None
        self.total: int | None = None
        self.last_line, self.last_tenth, self.last_done = 0.0, -1, 0
        self.started = time.monotonic()

    def start(self, total: int | None, done: int) -> None:
        self.total, self.started, self.first = total, time.monotonic(), done
        if self.use_bar:
            from tqdm import tqdm

            if self.bar is not None:
                self.bar.close()
            self.bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, unit_divisor=1024, desc=self.name)
        else:
            self.say(f"pull: {self.name}: {_mib(done)} of {_mib(total) if total else 'unknown size'}")

    def update(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            return
        now = time.monotonic()
        tenth = done * 10 // self.total if self.total else -1
        if tenth > self.last_tenth or now - self.last_line >= 30:
            self.last_tenth, self.last_line = tenth, now
            rate = (done - self.first) / max(now - self.started, 1e-6)
            share = f"{done * 100 // self.total}% " if self.total else ""
            self.say(f"pull: {self.name}: {share}{_mib(done)} ({_mib(rate)}/s)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _content_range(value: str | None) -> tuple[int, int | None]:
    match = _CONTENT_RANGE.match((value or "").strip())
    if match is None:
        raise PullError(f"a partial answer with an unreadable Content-Range: {value!r}")
    return int(match[1]), None if match[3] == "*" else int(match[3])


def _validator(resp: httpx.Response) -> str | None:
    """A strong ETag, else Last-Modified: what If-Range may carry (a weak ETag may not)."""
    etag = resp.headers.get("etag")
    if etag and not etag.startswith("W/"):
        return etag
    return resp.headers.get("last-modified")


def _same_host(url: str, other: str) -> bool:
    return urlsplit(url).netloc == urlsplit(other).netloc


def _hash_file(path: Path) -> Any:
    """The sha256 state after `path`'s bytes (hashlib.file_digest is 3.11+; JetPack 6 has 3.10)."""
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            hasher.update(block)
    return hasher


def _sha256_of(path: Path) -> str:
    return _hash_file(path).hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mib(n: float | None) -> str:
    if n is None:
        return "?"
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"

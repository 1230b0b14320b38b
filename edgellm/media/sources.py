"""A client's media reference -> the encoded bytes: a data: URL, a local file in an allowed folder, or
(when the operator allows it) an http(s) URL.

Every reference is client input: whatever the string holds, only MediaError (400) or MediaTooLarge (413)
come out of here, and no file outside `media_dirs` is opened (a missing file outside and an existing one
get the same answer, so the error is no probe of the disk).
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import re
import stat
import threading
import time
import urllib.parse
from typing import cast

from edgellm.media.errors import MediaError, MediaTooLarge, show_input
from edgellm.media.limits import MediaLimits, MediaSources

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
# Longer than any plausible relative path, and nothing but base64: a client that forgot the data: prefix.
_BASE64_TEXT = re.compile(r"[A-Za-z0-9+/=\s]{200,}")
_MAX_REDIRECTS = 3
_READ_CHUNK = 1 << 16


def load_bytes(
    ref: str,
    sources: MediaSources,
    limits: MediaLimits,
    *,
    param: str | None = None,
    base_dir: str | None = None,
) -> bytes:
    """The bytes `ref` names. `base_dir` resolves a relative path (the folder of the file that holds it)."""
    return cast(bytes, _resolve(ref, sources, limits, param, base_dir, fetch=True))  # fetch: never None


def check_source(
    ref: str,
    sources: MediaSources,
    limits: MediaLimits,
    *,
    param: str | None = None,
    base_dir: str | None = None,
) -> None:
    """Raises what load_bytes would for `ref` by the node's policy (scheme, media_dirs, remote media),
    without reading a file or fetching a URL: a local file is only looked at (stat), an http(s) URL only
    allowed or not. A data: URL is decoded as load_bytes does: its bytes are already in the request."""
    _resolve(ref, sources, limits, param, base_dir, fetch=False)


def _resolve(
    ref: str, sources: MediaSources, limits: MediaLimits, param: str | None, base_dir: str | None, *, fetch: bool
) -> bytes | None:
    """load_bytes and check_source in one: the same routing and refusals; `fetch` False reads nothing."""
    if not isinstance(ref, str):
        raise MediaError(f"a media reference must be a string, got {type(ref).__name__}", param=param)
    ref = ref.strip()
    if not ref:
        raise MediaError("the media reference is empty", param=param)
    match = _SCHEME.match(ref)
    scheme = match.group(1).lower() if match else ""
    if scheme == "data":
        return _data_url(ref, limits, param)
    if scheme == "file":
        return _read_local(_file_url_path(ref, param), sources, limits, param, base_dir=None, fetch=fetch)
    if scheme in ("http", "https"):
        _remote_allowed(sources, param)
        return _fetch_remote(ref, sources, limits, param) if fetch else None
    if scheme:
        raise MediaError(
            f"unsupported URL scheme {show_input(scheme, 20)}: use a data: URL, a file path or an http(s) URL",
            param=param,
        )
    if not ref.startswith("/") and _BASE64_TEXT.fullmatch(ref):
        raise MediaError("this looks like raw base64: send it as a data: URL (data:image/png;base64,...)", param=param)
    return _read_local(ref, sources, limits, param, base_dir=base_dir, fetch=fetch)


def decode_base64(text: str, limits: MediaLimits, *, param: str | None = None) -> bytes:
    """Strict base64 (standard alphabet, padded; whitespace ignored), refused by length before decoding."""
    if not isinstance(text, str):
        raise MediaError(f"base64 data must be a string, got {type(text).__name__}", param=param)
    cap = 4 * math.ceil(limits.max_bytes / 3)  # the encoded length of max_bytes
    if len(text) > 2 * cap + 1024:  # too long even with generous line breaks: skip copying it
        raise _too_large(limits, param)
    text = "".join(text.split())
    if len(text) > cap:
        raise _too_large(limits, param)
    if not text:
        raise MediaError("the base64 data is empty", param=param)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):  # ValueError: non-ASCII characters
        raise MediaError("invalid base64 data (standard alphabet, with = padding)", param=param) from None
    if len(data) > limits.max_bytes:
        raise _too_large(limits, param)
    return data


def _too_large(limits: MediaLimits, param: str | None, size: int | None = None) -> MediaTooLarge:
    what = f"{size} bytes" if size is not None else "larger than the limit"
    return MediaTooLarge(f"the media file is {what}; the limit is {limits.max_bytes} bytes", param=param)


# --- data: URLs ---------------------------------------------------------------------------------------


def _data_url(ref: str, limits: MediaLimits, param: str | None) -> bytes:
    # data:[<mediatype>][;base64],<data>  (RFC 2397). The mediatype is not trusted: decoding sniffs.
    header, comma, payload = ref[len("data:") :].partition(",")
    if not comma:
        raise MediaError("malformed data: URL: no ',' before the data", param=param)
    if header.split(";")[-1].strip().lower() == "base64":
        return decode_base64(payload, limits, param=param)
    if len(payload) > 3 * limits.max_bytes:  # each byte takes at least 1 character, at most 3 (%XX)
        raise _too_large(limits, param)
    try:
        data = urllib.parse.unquote_to_bytes(payload)
    except UnicodeError:  # lone surrogates cannot be encoded
        raise MediaError("malformed data: URL: the data is not valid text", param=param) from None
    if len(data) > limits.max_bytes:
        raise _too_large(limits, param)
    return data


# --- local files --------------------------------------------------------------------------------------


def _file_url_path(ref: str, param: str | None) -> str:
    try:
        url = urllib.parse.urlsplit(ref)
        path = urllib.parse.unquote(url.path, errors="strict")
    except (ValueError, UnicodeError):
        raise MediaError(f"malformed file URL {show_input(ref)}", param=param) from None
    if url.netloc not in ("", "localhost"):
        raise MediaError(
            f"a file URL must name a local path (file:///...), got host {show_input(url.netloc)}", param=param
        )
    if url.query or url.fragment:
        raise MediaError("a file URL must not have a query or fragment (percent-encode '?' and '#')", param=param)
    if not path.startswith("/"):
        raise MediaError(f"a file URL must hold an absolute path, got {show_input(ref)}", param=param)
    return path


def _read_local(
    path: str, sources: MediaSources, limits: MediaLimits, param: str | None, *, base_dir: str | None, fetch: bool
) -> bytes | None:
    if not sources.media_dirs:
        raise MediaError(
            "local media files are disabled on this server (set media_dirs to allow folders); "
            "send the file as a data: URL",
            param=param,
        )
    shown = show_input(path, tail=True)
    try:
        if not os.path.isabs(path):
            if base_dir is None:
                raise MediaError(f"relative path {shown}: give an absolute path inside media_dirs", param=param)
            path = os.path.join(base_dir, path)
        # realpath resolves symlinks and "..", so the check is on where the file really is.
        real = os.path.realpath(path)
        if not any(_inside(real, os.path.realpath(d)) for d in sources.media_dirs):
            raise MediaError(f"{shown} is outside the configured media_dirs ({_dirs(sources)})", param=param)
        if not fetch:
            return _look_at(real, limits, param, shown=shown)
        return _read_capped(real, limits, param, shown=shown)
    except (OSError, ValueError):  # ValueError: NUL bytes, unencodable surrogates
        raise MediaError(f"cannot read {shown}", param=param) from None


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _dirs(sources: MediaSources) -> str:
    # Operator settings, not client input: shown whole (the first few).
    return ", ".join(repr(d) for d in sources.media_dirs[:3]) + (", ..." if len(sources.media_dirs) > 3 else "")


def _read_capped(real: str, limits: MediaLimits, param: str | None, *, shown: str) -> bytes:
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOFOLLOW: the checked path's last
        # component cannot have become a symlink since realpath.
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MediaError(f"{shown}: no such file", param=param) from None
    except OSError as exc:
        raise MediaError(f"{shown}: cannot open it ({exc.strerror})", param=param) from None
    try:
        info = os.fstat(fd)  # of what was opened, not of the path: no race between check and read
        if stat.S_ISDIR(info.st_mode):
            raise MediaError(f"{shown} is a directory, not a file", param=param)
        if not stat.S_ISREG(info.st_mode):
            raise MediaError(f"{shown} is not a regular file", param=param)
        if info.st_size > limits.max_bytes:
            raise _too_large(limits, param, info.st_size)
        data = _read_upto(fd, limits.max_bytes + 1)  # the file may have grown since fstat
    finally:
        os.close(fd)
    if len(data) > limits.max_bytes:
        raise _too_large(limits, param)
    return data


def _look_at(real: str, limits: MediaLimits, param: str | None, *, shown: str) -> None:
    """_read_capped's refusals from the file's metadata alone (a check reads no bytes)."""
    try:
        info = os.stat(real)
    except FileNotFoundError:
        raise MediaError(f"{shown}: no such file", param=param) from None
    except OSError as exc:
        raise MediaError(f"{shown}: cannot open it ({exc.strerror})", param=param) from None
    if stat.S_ISDIR(info.st_mode):
        raise MediaError(f"{shown} is a directory, not a file", param=param)
    if not stat.S_ISREG(info.st_mode):
        raise MediaError(f"{shown} is not a regular file", param=param)
    if info.st_size > limits.max_bytes:
        raise _too_large(limits, param, info.st_size)
    if not os.access(real, os.R_OK):
        raise MediaError(f"{shown}: cannot open it (Permission denied)", param=param)
    return None


def _read_upto(fd: int, n: int) -> bytes:
    parts: list[bytes] = []
    while n > 0:
        part = os.read(fd, min(n, 1 << 20))
        if not part:
            break
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


# --- http(s) ------------------------------------------------------------------------------------------


def _remote_allowed(sources: MediaSources, param: str | None) -> None:
    if not sources.allow_remote:
        raise MediaError(
            "remote media URLs are disabled on this server (set allow_remote_media to allow http(s) URLs); "
            "send the file as a data: URL",
            param=param,
        )


def _fetch_remote(url: str, sources: MediaSources, limits: MediaLimits, param: str | None) -> bytes:
    # httpx timeouts apply to each connect/read, so a server trickling a byte at a time would never hit
    # them. The download runs in a thread and the caller waits only until the deadline; the thread then
    # stops at its next chunk or its next per-read timeout, whichever comes first.
    timeout = sources.remote_timeout_s
    cancel = threading.Event()
    outcome: list[bytes | BaseException] = []

    def work() -> None:
        try:
            outcome.append(_download(url, timeout, limits, param, cancel))
        except BaseException as exc:  # handed to the caller
            outcome.append(exc)

    worker = threading.Thread(target=work, name="media-fetch", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive() or not outcome:
        cancel.set()
        raise MediaError(f"fetching the media URL took longer than {timeout:g} s", param=param)
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result


def _download(url: str, timeout: float, limits: MediaLimits, param: str | None, cancel: threading.Event) -> bytes:
    import httpx  # only needed when remote media is allowed

    shown = show_input(url)
    deadline = time.monotonic() + timeout
    try:
        with httpx.Client(timeout=timeout, follow_redirects=True, max_redirects=_MAX_REDIRECTS) as client:
            # identity: a compressed body would be inflated past the byte cap before it is counted.
            with client.stream("GET", url, headers={"Accept-Encoding": "identity"}) as response:
                if not response.is_success:
                    raise MediaError(f"the media URL {shown} answered HTTP {response.status_code}", param=param)
                if response.headers.get("content-encoding", "identity").lower() != "identity":
                    raise MediaError(f"the media URL {shown} sent a compressed body", param=param)
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limits.max_bytes:
                    raise _too_large(limits, param, int(declared))
                parts: list[bytes] = []
                size = 0
                for part in response.iter_raw(_READ_CHUNK):
                    if cancel.is_set() or time.monotonic() > deadline:
                        raise MediaError(f"fetching the media URL took longer than {timeout:g} s", param=param)
                    size += len(part)
                    if size > limits.max_bytes:
                        raise _too_large(limits, param)
                    parts.append(part)
                return b"".join(parts)
    except httpx.TooManyRedirects:
        raise MediaError(f"the media URL {shown} redirected more than {_MAX_REDIRECTS} times", param=param) from None
    except httpx.TimeoutException:
        raise MediaError(f"fetching the media URL took longer than {timeout:g} s", param=param) from None
    except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError, ValueError, OSError) as exc:
        raise MediaError(f"could not fetch the media URL {shown}: {type(exc).__name__}", param=param) from None

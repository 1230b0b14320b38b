"""The journal `<out>.partial` of `edgellm batch-run` and the results file written from it (see runner.py's
doc for when each is written, kept and removed)."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from edgellm.batch.http_client import strict_json
from edgellm.batch.inputs import BatchInputError, BatchOptions

# Codes that say the request itself is wrong: sending it again gives the same answer, so --resume keeps
# them. 408 and 429 are about timing, not the request, and are sent again like 5xx and http_code 0.
_FINAL_CLIENT_ERRORS = range(400, 500)
_TIMING_CLIENT_ERRORS = frozenset({408, 429})


def dumps(line: dict[str, Any]) -> str:
    # Compact separators: the documented recipes grep for '"status":"error"'. ensure_ascii=False keeps
    # CJK/emoji readable; a line holding a lone surrogate (a server may echo one) falls back to \u
    # escapes, which are valid JSON where the raw code point is not valid UTF-8.
    text = json.dumps(line, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(line, separators=(",", ":"), allow_nan=False)
    return text


def encoded(line: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The line and its text; a response that cannot be written back as JSON becomes an error line."""
    try:
        return line, dumps(line)
    except (ValueError, RecursionError) as exc:
        bad = {k: v for k, v in line.items() if k != "response"}
        bad.update(status="error", error=f"response cannot be written as JSON ({type(exc).__name__})")
        return bad, dumps(bad)


def write_lines(path: Path, texts: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_finished(line: dict[str, Any]) -> bool:
    """What --resume keeps: ok lines, and errors the server gave for the request itself (4xx other than
    408/429). Connection failures and read timeouts (http_code 0), 408, 429 and 5xx are sent again."""
    if line.get("status") == "ok":
        return True
    code = line.get("http_code")
    return isinstance(code, int) and code in _FINAL_CLIENT_ERRORS and code not in _TIMING_CLIENT_ERRORS


def id_key(rid: Any) -> str:
    return json.dumps(rid)  # 4 and "4" are different ids in a result line


def _parse_results(name: str, raw: bytes) -> Iterator[dict[str, Any]]:
    """The result lines of a journal or results file; BatchInputError if it is not one of ours."""
    for n, text in enumerate(raw.split(b"\n"), 1):
        if not text.strip():
            continue
        try:
            line = strict_json(text)
        except ValueError:  # includes UnicodeDecodeError
            line = None
        rid = line.get("id") if isinstance(line, dict) else None
        if (
            not isinstance(line, dict)
            or isinstance(rid, bool)
            or not isinstance(rid, str | int)
            or line.get("status") not in ("ok", "error")
        ):
            raise BatchInputError(
                f"{name}: line {n} is not a batch-run result line; move the file away or pass --overwrite"
            )
        yield line


def journal_path(out: str | Path) -> Path:
    """The journal of the results file `out`: `<out>.partial` (see the module doc)."""
    out = Path(out)
    return out.with_name(out.name + ".partial")


class Journal:
    """`<out>.partial`, locked for the run; opened without ever truncating what an earlier run wrote."""

    def __init__(self, out: Path, opts: BatchOptions):
        self.path = journal_path(out)
        created = not self.path.exists()
        try:
            self.f: IO[bytes] = open(self.path, "a+b")  # "a": never truncates on open
        except OSError as exc:
            raise BatchInputError(f"cannot write the journal {self.path} ({exc.strerror or exc})") from None
        try:
            try:  # two runs appending to one journal would interleave lines: the second one refuses
                fcntl.flock(self.f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise BatchInputError(f"another batch-run is writing {self.path}") from None
            self.f.seek(0)
            raw = self.f.read()
            self.earlier: dict[str, dict[str, Any]] = {}
            if raw.strip() and not (opts.resume or opts.overwrite):
                n = sum(1 for x in raw.split(b"\n") if x.strip())
                raise BatchInputError(
                    f"{self.path} holds {n} result(s) of an earlier run that did not finish. Pass --resume to keep "
                    "them and send only the rest, or --overwrite to discard them and start over"
                )
            if opts.overwrite:
                self.f.truncate(0)
            elif raw:
                self._load(raw)
            if not self.earlier and opts.resume and out.is_file():
                # The earlier run finished (no journal left): resume from its results file.
                try:
                    earlier = out.read_bytes()
                except OSError as exc:
                    raise BatchInputError(f"cannot read {out} ({exc.strerror or exc})") from None
                for line in _parse_results(str(out), earlier):
                    self.earlier[id_key(line["id"])] = line
                    self.append(dumps(line))
        except BaseException:
            if created and self.f.tell() == 0:  # refused before anything was written: leave no trace
                self.path.unlink(missing_ok=True)
            self.f.close()
            raise

    def _load(self, raw: bytes) -> None:
        if not raw.endswith(b"\n"):
            # A crash mid-write leaves a torn last line. Keep it if it is whole, else cut it: it was
            # never a result. This is the only thing ever removed from a journal.
            head, _, tail = raw.rpartition(b"\n")
            try:
                list(_parse_results(str(self.path), tail))
                self.f.write(b"\n")
            except BatchInputError:
                self.f.truncate(len(head) + 1 if head else 0)
                raw = head
        for line in _parse_results(str(self.path), raw):
            self.earlier[id_key(line["id"])] = line  # a later line for an id (a retry) wins

    def append(self, text: str) -> None:
        self.f.write(text.encode("utf-8") + b"\n")
        self.f.flush()

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        self.f.close()

    def close(self, *, discard_if_empty: bool = False) -> None:
        if discard_if_empty and self.f.seek(0, os.SEEK_END) == 0:
            self.path.unlink(missing_ok=True)
        self.f.close()


def write_after_crash(batch: list[dict[str, Any]], out: Path) -> int | None:
    """What Ctrl-C leaves, for a run whose process died (the crash guard's parent calls this): `out`
    gets, in input order, each request's latest line in the journal, byte for byte, and the journal
    stays for --resume. Returns how many lines were written; None when the journal holds no result
    (an empty one is removed, as a run stopped before anything was sent removes it; `out` is untouched).

    One difference from Ctrl-C, which knows what its own run sent: after a crashed --resume, a request
    whose earlier line is not finished (a 503, say) and that was not sent again yet keeps that line
    in `out` (Ctrl-C leaves it out); either way --resume sends it again.
    """
    out = Path(out)
    path = journal_path(out)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    latest: dict[str, str] = {}
    for text in raw.split(b"\n"):
        try:
            parsed = list(_parse_results(str(path), text))
        except BatchInputError:
            continue  # a torn last line: the process died writing it (the next --resume cuts it)
        for line in parsed:
            latest[id_key(line["id"])] = text.decode("utf-8")
    if not latest:
        if not raw.strip():
            path.unlink(missing_ok=True)
        return None
    texts = [latest[key] for key in (id_key(req["id"]) for req in batch) if key in latest]
    write_lines(out, texts)
    return len(texts)

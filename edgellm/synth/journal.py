"""The output of a synthetic run and its journal: what makes a run resumable.

`OUT` holds the records, one JSON object a line, nothing else (so it is usable as it is).
`OUT.journal` holds a header (schema hash, when it was started) and one line per finished attempt in
attempt-index order (`{"i": 7, "o": "valid"}`). A rerun with the same OUT reads both: the records
already written count and are the duplicate filter, the journal says which attempt comes next (so
per-record seeds continue rather than repeat). A torn last line (a crash mid-write) is cut off; a
different schema is refused, as is an OUT that no journal vouches for.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from edgellm.synth.schema import SynthInputError, canonical, strict_loads

JOURNAL_VERSION = 1
OUTCOMES = ("valid", "invalid", "duplicate", "failed")


def journal_path(out: Path) -> Path:
    return out.with_name(out.name + ".journal")


@dataclass
class OutputState:
    out: Path
    next_index: int = 0  # the next attempt index (per-record seeds derive from it)
    seen: set[str] = field(default_factory=set)  # canonical texts of the records in OUT
    valid: int = 0  # records in OUT
    _out_fh: IO[str] | None = None
    _journal_fh: IO[str] | None = None

    def append(self, index: int, outcome: str, record: Any = None) -> None:
        """Record first, then its journal line: a crash between the two redoes one attempt, whose
        (same-seed) record is then caught as a duplicate."""
        if outcome == "valid":
            text = canonical(record)
            self._out_fh.write(_line(record))
            self._out_fh.flush()
            self.seen.add(text)
            self.valid += 1
        self._journal_fh.write(json.dumps({"i": index, "o": outcome}) + "\n")
        self._journal_fh.flush()
        self.next_index = index + 1

    def close(self) -> None:
        for fh in (self._out_fh, self._journal_fh):
            if fh is not None and not fh.closed:
                fh.flush()
                os.fsync(fh.fileno())
                fh.close()  # closing the journal releases the lock


def _line(record: Any) -> str:
    text = json.dumps(record, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: \u escapes are valid JSON, the raw code point is not UTF-8
        text = json.dumps(record, allow_nan=False)
    return text + "\n"


def _read_lines(path: Path) -> tuple[list[Any], int]:
    """(parsed lines, byte length of the good prefix); a torn or unparsable last line is left out."""
    data = path.read_bytes()
    parsed: list[Any] = []
    good = 0
    pos = 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0:  # no newline: the last write did not finish
            break
        chunk = data[pos:end]
        try:
            parsed.append(strict_loads(chunk.decode("utf-8")))
        except (ValueError, UnicodeDecodeError):
            if data[end + 1 :].strip():
                line = len(parsed) + 1
                raise SynthInputError(f"{path}: line {line} is not valid JSON (was the file edited?)") from None
            break  # the last line is broken: cut it
        pos = end + 1
        good = pos
    return parsed, good


def open_output(out: Path, schema_sha256: str) -> OutputState:
    """Open OUT for appending (creating it, or resuming it), holding an exclusive lock on its journal."""
    out = Path(out)
    jpath = journal_path(out)
    if out.exists() and out.is_dir():
        raise SynthInputError(f"{out}: is a directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        journal_fh = open(jpath, "a+", encoding="utf-8")  # noqa: SIM115 - held for the run (the lock)
    except OSError as exc:
        raise SynthInputError(f"{jpath}: cannot open ({exc.strerror or exc})") from None
    try:
        fcntl.flock(journal_fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        journal_fh.close()
        raise SynthInputError(f"{out}: another `edgellm synth` run is writing it") from None
    try:
        return _open_locked(out, jpath, journal_fh, schema_sha256)
    except BaseException:
        journal_fh.close()
        raise


def _open_locked(out: Path, jpath: Path, journal_fh: IO[str], schema_sha256: str) -> OutputState:
    entries, good = _read_lines(jpath)
    fresh = not entries or not out.exists()
    if fresh:
        if out.exists() and out.stat().st_size > 0:
            raise SynthInputError(
                f"{out}: exists and has no journal ({jpath.name}); it was not written by `edgellm synth` "
                "with this schema: choose another output or remove it"
            )
        journal_fh.seek(0)
        journal_fh.truncate()
        header = {"synth_journal": JOURNAL_VERSION, "schema_sha256": schema_sha256, "started": time.time()}
        journal_fh.write(json.dumps(header) + "\n")
        journal_fh.flush()
        out_fh = open(out, "w", encoding="utf-8")  # noqa: SIM115 - held for the run
        return OutputState(out=out, _out_fh=out_fh, _journal_fh=journal_fh)
    header = entries[0]
    if not isinstance(header, dict) or header.get("synth_journal") != JOURNAL_VERSION:
        raise SynthInputError(f"{jpath}: not an `edgellm synth` journal")
    if header.get("schema_sha256") != schema_sha256:
        raise SynthInputError(
            f"{out}: was generated with a different schema (sha256 {str(header.get('schema_sha256'))[:12]}..., "
            f"this one {schema_sha256[:12]}...): records of two schemas are not mixed; choose another output"
        )
    next_index = 0
    for n, entry in enumerate(entries[1:]):
        if not (isinstance(entry, dict) and entry.get("i") == n and entry.get("o") in OUTCOMES):
            raise SynthInputError(f"{jpath}: line {n + 2} is not a journal entry (was the file edited?)")
        next_index = n + 1
    os.truncate(jpath, good)  # cut a torn last line
    journal_fh.seek(0, os.SEEK_END)
    records, out_good = _read_lines(out)
    os.truncate(out, out_good)
    seen = {canonical(r) for r in records}
    out_fh = open(out, "a", encoding="utf-8")  # noqa: SIM115 - held for the run
    return OutputState(
        out=out, next_index=next_index, seen=seen, valid=len(records), _out_fh=out_fh, _journal_fh=journal_fh
    )

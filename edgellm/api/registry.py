"""The request registry: one SQLite file (WAL) under the state dir, the node's durable record.

Every accepted request is written here (synchronous=FULL) before it is acknowledged, so a crash or
power loss after the 200/202 never loses it. Rows are keyed by the request's key
(api/request_state.request_key: a caller's own id is unique for its owner only; `error_type` is read
back as an ErrorType, a string this version does not know as engine_error). Each row carries the
boot id of the node process that accepted it: after a restart, the rows of earlier boots still
pending are exactly the work to recover. Finished records are kept `ttl_s` seconds, then evicted
by `evict_expired()`; nothing is cached in memory, so memory stays flat. One node per registry:
the file is locked while open.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgellm.api.request_ids import public_id
from edgellm.compat import StrEnum
from edgellm.errors import ErrorType, RegistryError, RegistryFull, RegistryLocked

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    request_id   TEXT PRIMARY KEY,
    mode         TEXT NOT NULL,          -- sync | async
    status       TEXT NOT NULL,
    params       TEXT NOT NULL,          -- normalised ChatRequest (JSON)
    metadata     TEXT NOT NULL,
    seed         INTEGER NOT NULL,       -- u64 stored as the signed 64-bit integer of the same bits
    result       TEXT,
    error        TEXT,
    error_type   TEXT,
    attempts     INTEGER NOT NULL DEFAULT 0,
    created_at   REAL NOT NULL,
    finished_at  REAL,
    expires_at   REAL,
    boot_id      TEXT NOT NULL DEFAULT '',
    owner        TEXT,                   -- hash of the token that submitted it; NULL = anonymous
    delegation   TEXT                    -- JSON: where request balancing sent it or took it from (fleet/)
);
CREATE INDEX IF NOT EXISTS requests_status ON requests(status);
CREATE INDEX IF NOT EXISTS requests_expires ON requests(expires_at);
CREATE INDEX IF NOT EXISTS requests_created ON requests(created_at);
"""


class RequestStatus(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"

    @property
    def is_finished(self) -> bool:
        return self is not RequestStatus.PENDING


_U64 = 2**64


def _seed_to_db(seed: int) -> int:
    return seed - _U64 if seed >= 2**63 else seed  # SQLite INTEGER is signed 64-bit


def _seed_from_db(value: int) -> int:
    return value % _U64


@dataclass
class RequestRecord:
    request_id: str
    mode: str
    status: RequestStatus
    params: dict[str, Any]
    metadata: dict[str, Any]
    seed: int
    result: dict[str, Any] | None
    error: str | None
    error_type: ErrorType | None
    attempts: int
    created_at: float
    finished_at: float | None
    expires_at: float | None
    owner: str | None = None
    # fleet/balancer.py: {"role": "origin" | "executor" | "withdrawn" | "rerun" | "failed", ...}
    delegation: dict[str, Any] | None = None

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> RequestRecord:
        return cls(
            request_id=row["request_id"],
            mode=row["mode"],
            status=RequestStatus(row["status"]),
            params=json.loads(row["params"]),
            metadata=json.loads(row["metadata"]),
            seed=_seed_from_db(row["seed"]),
            result=json.loads(row["result"]) if row["result"] else None,
            error=row["error"],
            error_type=ErrorType.of(row["error_type"]),  # a type this version does not know: engine_error
            attempts=row["attempts"],
            created_at=row["created_at"],
            finished_at=row["finished_at"],
            expires_at=row["expires_at"],
            owner=row["owner"],
            delegation=json.loads(row["delegation"]) if row["delegation"] else None,
        )


class Registry:
    def __init__(self, path: Path, ttl_s: float, *, boot_id: str = ""):
        self.path = Path(path)
        self.ttl_s = ttl_s
        self.boot_id = boot_id
        self.reset_reason: str | None = None  # set when a damaged file was moved aside at open
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._lock_file = _lock_exclusively(self.path.with_name(self.path.name + ".lock"))
        self._set_aside_if_empty()
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
            self._migrate()
        except sqlite3.Error as exc:
            self._lock_file.close()
            raise RegistryError(f"cannot open the request registry at {self.path}: {exc}") from exc

    def _set_aside_if_empty(self) -> None:
        """A zero-byte registry is a damaged one (every record gone), not a new one: keep it, say so."""
        if not self.path.exists() or self.path.stat().st_size > 0:
            return
        wal = self.path.with_name(self.path.name + "-wal")
        if wal.exists() and wal.stat().st_size > 0:
            log.warning("registry %s is empty but its WAL is not; letting SQLite recover from the WAL", self.path)
            return
        stamp = time.strftime("%Y%m%dT%H%M%S")
        kept = self.path.with_name(f"{self.path.name}.zero-byte-{stamp}")
        for suffix in ("", "-wal", "-shm"):
            src = self.path.with_name(self.path.name + suffix)
            if src.exists():
                src.rename(kept.with_name(kept.name + suffix))
        self.reset_reason = (
            f"the registry file {self.path} was empty (0 bytes): its records and pending requests are lost; "
            f"it was moved to {kept} and a new registry was started"
        )
        log.error("%s", self.reset_reason)

    def _migrate(self) -> None:
        """Registries written before boot ids and owners existed gain the columns (pending rows recover)."""
        columns = {row["name"] for row in self._db.execute("PRAGMA table_info(requests)")}
        if "boot_id" not in columns:
            self._db.execute("ALTER TABLE requests ADD COLUMN boot_id TEXT NOT NULL DEFAULT ''")
        if "owner" not in columns:
            self._db.execute("ALTER TABLE requests ADD COLUMN owner TEXT")
        if "delegation" not in columns:
            self._db.execute("ALTER TABLE requests ADD COLUMN delegation TEXT")
        # The balancer reads its rows every poll period: by role, and a result's row by delegation id.
        self._db.execute(
            "CREATE INDEX IF NOT EXISTS requests_delegation_role ON requests(json_extract(delegation, '$.role'))"
        )
        self._db.execute(
            "CREATE INDEX IF NOT EXISTS requests_delegation_id ON requests(json_extract(delegation, '$.delegation_id'))"
        )

    def _run(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        try:
            with self._lock:
                return self._db.execute(sql, args)
        except sqlite3.Error as exc:
            raise _registry_error(exc) from exc

    def _rows(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        """A query's rows, read while the lock is held (another thread's statement on this connection
        must not run between the execute and the fetch)."""
        try:
            with self._lock:
                return self._db.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise _registry_error(exc) from exc

    def insert(
        self,
        request_id: str,
        mode: str,
        params: dict,
        metadata: dict,
        seed: int,
        *,
        owner: str | None = None,
        delegation: dict | None = None,
    ) -> bool:
        """Record a new pending request; False when the id is already taken."""
        try:
            self._run(
                "INSERT INTO requests(request_id, mode, status, params, metadata, seed, attempts, created_at, "
                "boot_id, owner, delegation) VALUES (?, ?, ?, ?, ?, ?, 1, ?, ?, ?, ?)",
                (
                    request_id,
                    mode,
                    RequestStatus.PENDING.value,
                    json.dumps(params),
                    json.dumps(metadata),
                    _seed_to_db(seed),
                    time.time(),
                    self.boot_id,
                    owner,
                    json.dumps(delegation) if delegation is not None else None,
                ),
            )
        except RegistryError as exc:
            if isinstance(exc.__cause__, sqlite3.IntegrityError):
                return False
            raise
        return True

    def finish(
        self,
        request_id: str,
        status: RequestStatus,
        result: dict | None,
        error: str | None,
        error_type: ErrorType | None = None,
    ) -> None:
        self.finish_many([(request_id, status, result, error, error_type)])

    def finish_many(self, rows: list[tuple[str, RequestStatus, dict | None, str | None, ErrorType | None]]) -> None:
        """Finish several requests in one transaction: one fsync per engine message, not per request."""
        now = time.time()
        args = [
            (
                status.value,
                json.dumps(result) if result is not None else None,
                error,
                error_type,
                now,
                now + self.ttl_s,
                request_id,
                RequestStatus.PENDING.value,
            )
            for request_id, status, result, error, error_type in rows
        ]
        try:
            with self._lock:
                with self._db:  # BEGIN ... COMMIT, or ROLLBACK on error
                    self._db.execute("BEGIN")
                    self._db.executemany(
                        "UPDATE requests SET status=?, result=?, error=?, error_type=?, finished_at=?, expires_at=? "
                        "WHERE request_id=? AND status=?",
                        args,
                    )
        except sqlite3.Error as exc:
            raise _registry_error(exc) from exc

    def bump_attempts(self, request_id: str) -> None:
        self._run("UPDATE requests SET attempts = attempts + 1 WHERE request_id=?", (request_id,))

    def get(self, request_id: str) -> RequestRecord | None:
        row = next(iter(self._rows("SELECT * FROM requests WHERE request_id=?", (request_id,))), None)
        if row is None or (row["expires_at"] is not None and row["expires_at"] <= time.time()):
            return None
        return RequestRecord.from_row(row)

    def pending(self) -> list[RequestRecord]:
        rows = self._rows("SELECT * FROM requests WHERE status=? ORDER BY created_at", (RequestStatus.PENDING.value,))
        return [RequestRecord.from_row(r) for r in rows]

    def pending_from_earlier_boots(self) -> list[RequestRecord]:
        """The work a restart must recover: pending rows accepted by another node process, except those
        delegated to a peer (request balancing follows them up: their result comes back by mailbox) and
        those taken from a peer that its origin withdrew (it runs them itself: fleet/balancer.py)."""
        rows = self._rows(
            "SELECT * FROM requests WHERE status=? AND boot_id != ? AND (delegation IS NULL OR "
            "json_extract(delegation, '$.role') NOT IN ('origin', 'withdrawn')) ORDER BY created_at",
            (RequestStatus.PENDING.value, self.boot_id),
        )
        return [RequestRecord.from_row(r) for r in rows]

    # -- request balancing (fleet/balancer.py) ---------------------------------------------------
    def set_delegation(self, request_id: str, delegation: dict | None) -> None:
        self._run(
            "UPDATE requests SET delegation=? WHERE request_id=?",
            (json.dumps(delegation) if delegation is not None else None, request_id),
        )

    def delegated(self, role: str, *, pending: bool | None = None, unsent: bool = False) -> list[RequestRecord]:
        """Unexpired rows of a delegation role, oldest first; `pending`: only unfinished (True) or finished;
        `unsent`: finished rows whose result has not been sent back yet (an executor's)."""
        where = ["json_extract(delegation, '$.role') = ?", "(expires_at IS NULL OR expires_at > ?)"]
        args: list[Any] = [role, time.time()]
        if unsent:
            where.append("json_extract(delegation, '$.result_sent_at') IS NULL")
            pending = False
        if pending is not None:
            where.append("status = ?" if pending else "status != ?")
            args.append(RequestStatus.PENDING.value)
        rows = self._rows(f"SELECT * FROM requests WHERE {' AND '.join(where)} ORDER BY created_at", tuple(args))
        return [RequestRecord.from_row(r) for r in rows]

    def by_delegation_id(self, delegation_id: str) -> RequestRecord | None:
        rows = self._rows(
            "SELECT * FROM requests WHERE json_extract(delegation, '$.delegation_id') = ?", (delegation_id,)
        )
        return RequestRecord.from_row(rows[0]) if rows else None

    def recent(
        self, limit: int = 50, *, status: RequestStatus | None = None, owner: str | None = None
    ) -> list[dict[str, Any]]:
        """Summaries of the newest unexpired records, newest first, that `owner` may read (its own and
        anonymous ones, as request_status decides). Only the summary fields are read: params and
        results can be megabytes, and the console asks every second while it watches a request."""
        where, args = ["(expires_at IS NULL OR expires_at > ?)", "(owner IS NULL OR owner = ?)"], [time.time(), owner]
        if status is not None:
            where.append("status = ?")
            args.append(status.value)
        sql = (
            "SELECT request_id, mode, status, created_at, finished_at, error, error_type, attempts, "
            "json_extract(result, '$.FULL_OUTPUT[0].usage.prompt_tokens') AS prompt_tokens, "
            "json_extract(result, '$.FULL_OUTPUT[0].usage.completion_tokens') AS completion_tokens, "
            "json_extract(result, '$.FULL_OUTPUT[0].timings.ttft_ms') AS ttft_ms, "
            "json_extract(result, '$.FULL_OUTPUT[0].choices[0].finish_reason') AS finish_reason "
            f"FROM requests WHERE {' AND '.join(where)} ORDER BY created_at DESC LIMIT ?"
        )
        # The id as its caller knows it, not the owner-scoped key (the owner is the caller's own hash).
        return [{**dict(r), "request_id": public_id(r["request_id"])} for r in self._rows(sql, (*args, limit))]

    def counts(self) -> dict[str, int]:
        rows = self._rows("SELECT status, COUNT(*) AS n FROM requests GROUP BY status")
        return {r["status"]: r["n"] for r in rows}

    def delete(self, request_id: str) -> bool:
        """Remove one record (a client deleting what it stored); False when there was none."""
        return self._run("DELETE FROM requests WHERE request_id=?", (request_id,)).rowcount > 0

    def evict_expired(self) -> int:
        return self._run(
            "DELETE FROM requests WHERE expires_at IS NOT NULL AND expires_at <= ?", (time.time(),)
        ).rowcount

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._lock_file.close()  # releases the flock


SQLITE_FULL = 13  # SQLite's result code for a full disk (sqlite3.SQLITE_FULL exists only from Python 3.11)


def _registry_error(exc: sqlite3.Error) -> RegistryError:
    # sqlite_errorcode too is 3.11+; on 3.10 the message ("database or disk is full") tells.
    if getattr(exc, "sqlite_errorcode", None) == SQLITE_FULL or "full" in str(exc):
        return RegistryFull(f"the request registry cannot grow (disk full?): {exc}; free space and retry")
    return RegistryError(f"request registry failed: {exc}")


def _lock_exclusively(path: Path):
    """Hold an exclusive flock on `path` for the registry's lifetime; a second node on the same state
    directory fails here with a clear message instead of interleaving writes with the first."""
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RegistryLocked(
            f"another edgellm node (pid {holder}) is using the state directory {path.parent}; stop it or "
            "choose another --state-dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle

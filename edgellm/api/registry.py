"""The request registry: one SQLite file (WAL) under the state dir.

Every accepted request is written here (synchronous=FULL) before it is acknowledged, so a crash or
power loss after the 200/202 never loses it. Finished records are kept `ttl_s` seconds, then
evicted by `evict_expired()`; nothing is cached in memory, so memory stays flat.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from edgellm.errors import EdgeLLMError

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    request_id   TEXT PRIMARY KEY,
    mode         TEXT NOT NULL,          -- sync | async
    status       TEXT NOT NULL,
    params       TEXT NOT NULL,          -- normalised ChatRequest (JSON)
    metadata     TEXT NOT NULL,
    seed         INTEGER NOT NULL,
    result       TEXT,
    error        TEXT,
    error_type   TEXT,
    attempts     INTEGER NOT NULL DEFAULT 0,
    created_at   REAL NOT NULL,
    finished_at  REAL,
    expires_at   REAL
);
CREATE INDEX IF NOT EXISTS requests_status ON requests(status);
CREATE INDEX IF NOT EXISTS requests_expires ON requests(expires_at);
"""


class RequestStatus(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"

    @property
    def is_finished(self) -> bool:
        return self is not RequestStatus.PENDING


class RegistryError(EdgeLLMError):
    error_type = "registry_error"


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
    error_type: str | None
    attempts: int
    created_at: float
    finished_at: float | None
    expires_at: float | None

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> RequestRecord:
        return cls(
            request_id=row["request_id"],
            mode=row["mode"],
            status=RequestStatus(row["status"]),
            params=json.loads(row["params"]),
            metadata=json.loads(row["metadata"]),
            seed=row["seed"],
            result=json.loads(row["result"]) if row["result"] else None,
            error=row["error"],
            error_type=row["error_type"],
            attempts=row["attempts"],
            created_at=row["created_at"],
            finished_at=row["finished_at"],
            expires_at=row["expires_at"],
        )


class Registry:
    def __init__(self, path: Path, ttl_s: float):
        self.path = Path(path)
        self.ttl_s = ttl_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
        except sqlite3.Error as exc:
            raise RegistryError(f"cannot open the request registry at {self.path}: {exc}") from exc

    def _run(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        try:
            with self._lock:
                return self._db.execute(sql, args)
        except sqlite3.Error as exc:
            raise RegistryError(f"request registry failed: {exc}") from exc

    def insert(self, request_id: str, mode: str, params: dict, metadata: dict, seed: int) -> bool:
        """Record a new pending request; False when the id is already taken."""
        try:
            self._run(
                "INSERT INTO requests(request_id, mode, status, params, metadata, seed, attempts, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, 1, ?)",
                (
                    request_id,
                    mode,
                    RequestStatus.PENDING.value,
                    json.dumps(params),
                    json.dumps(metadata),
                    seed,
                    time.time(),
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
        error_type: str | None = None,
    ) -> None:
        now = time.time()
        self._run(
            "UPDATE requests SET status=?, result=?, error=?, error_type=?, finished_at=?, expires_at=? "
            "WHERE request_id=? AND status=?",
            (
                status.value,
                json.dumps(result) if result is not None else None,
                error,
                error_type,
                now,
                now + self.ttl_s,
                request_id,
                RequestStatus.PENDING.value,
            ),
        )

    def bump_attempts(self, request_id: str) -> None:
        self._run("UPDATE requests SET attempts = attempts + 1 WHERE request_id=?", (request_id,))

    def get(self, request_id: str) -> RequestRecord | None:
        row = self._run("SELECT * FROM requests WHERE request_id=?", (request_id,)).fetchone()
        if row is None or (row["expires_at"] is not None and row["expires_at"] <= time.time()):
            return None
        return RequestRecord.from_row(row)

    def pending(self) -> list[RequestRecord]:
        rows = self._run(
            "SELECT * FROM requests WHERE status=? ORDER BY created_at", (RequestStatus.PENDING.value,)
        ).fetchall()
        return [RequestRecord.from_row(r) for r in rows]

    def counts(self) -> dict[str, int]:
        rows = self._run("SELECT status, COUNT(*) AS n FROM requests GROUP BY status").fetchall()
        return {r["status"]: r["n"] for r in rows}

    def evict_expired(self) -> int:
        return self._run(
            "DELETE FROM requests WHERE expires_at IS NOT NULL AND expires_at <= ?", (time.time(),)
        ).rowcount

    def close(self) -> None:
        with self._lock:
            self._db.close()

"""The SQLite registry on a real file."""

from __future__ import annotations

import sqlite3
import time

from edgellm.api.registry import Registry, RequestStatus


def test_records_survive_reopening(tmp_path):
    path = tmp_path / "r.sqlite3"
    reg = Registry(path, ttl_s=60)
    assert reg.insert("a", "async", {"max_tokens": 16}, {"k": 1}, seed=5)
    reg.close()
    reg = Registry(path, ttl_s=60)
    rec = reg.get("a")
    assert rec.status is RequestStatus.PENDING and rec.metadata == {"k": 1} and rec.seed == 5 and rec.attempts == 1
    assert [r.request_id for r in reg.pending()] == ["a"]
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_duplicate_id_is_refused(tmp_path):
    reg = Registry(tmp_path / "r.sqlite3", ttl_s=60)
    assert reg.insert("a", "sync", {}, {}, 1)
    assert not reg.insert("a", "sync", {}, {}, 1)


def test_finish_only_once_and_ttl_eviction(tmp_path):
    reg = Registry(tmp_path / "r.sqlite3", ttl_s=0.3)
    reg.insert("a", "sync", {}, {}, 1)
    reg.insert("b", "sync", {}, {}, 1)
    reg.finish("a", RequestStatus.COMPLETED, {"TEXT_RESPONSE": ["x"]}, None)
    reg.finish("a", RequestStatus.FAILED, None, "late")  # ignored: already finished
    rec = reg.get("a")
    assert rec.status is RequestStatus.COMPLETED and rec.result == {"TEXT_RESPONSE": ["x"]} and rec.error is None
    time.sleep(0.35)
    assert reg.get("a") is None  # expired records are invisible even before eviction
    assert reg.evict_expired() == 1
    assert reg.get("b") is not None  # pending records never expire
    assert reg.counts() == {"pending": 1}

"""The SQLite registry on a real file."""

from __future__ import annotations

import logging
import sqlite3

import pytest

from edgellm.api.registry import Registry, RegistryFull, RegistryLocked, RequestStatus
from tests.nodeproc import wait_until


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
    reg = Registry(tmp_path / "r.sqlite3", ttl_s=1.0)  # the reads right after the finish come well before it
    reg.insert("a", "sync", {}, {}, 1)
    reg.insert("b", "sync", {}, {}, 1)
    reg.finish("a", RequestStatus.COMPLETED, {"TEXT_RESPONSE": ["x"]}, None)
    reg.finish("a", RequestStatus.FAILED, None, "late")  # ignored: already finished
    rec = reg.get("a")
    assert rec.status is RequestStatus.COMPLETED and rec.result == {"TEXT_RESPONSE": ["x"]} and rec.error is None
    # Its TTL runs out (1 s after the finish): the record is invisible, and still there to evict.
    wait_until(lambda: reg.get("a") is None, 10, "the finished record to expire")
    assert reg.evict_expired() == 1
    assert reg.get("b") is not None  # pending records never expire
    assert reg.counts() == {"pending": 1}


def test_u64_seeds_are_stored_losslessly(tmp_path):
    """Regression: seeds in [2^63, 2^64) overflowed SQLite's signed INTEGER (a 500 on main)."""
    reg = Registry(tmp_path / "r.sqlite3", ttl_s=60)
    for i, seed in enumerate((0, 2**63 - 1, 2**63, 2**64 - 1)):
        assert reg.insert(f"s{i}", "async", {}, {}, seed)
        assert reg.get(f"s{i}").seed == seed


def test_a_second_registry_on_the_same_file_is_refused(tmp_path):
    """Regression: nothing locked the state directory; two nodes interleaved writes."""
    reg = Registry(tmp_path / "r.sqlite3", ttl_s=60)
    with pytest.raises(RegistryLocked, match="another edgellm node .* is using the state directory"):
        Registry(tmp_path / "r.sqlite3", ttl_s=60)
    reg.close()
    Registry(tmp_path / "r.sqlite3", ttl_s=60).close()  # free again once the first is closed


def test_a_zero_byte_registry_is_set_aside_loudly(tmp_path, caplog):
    """Regression: on main a zero-byte file was silently used as a new, empty registry."""
    path = tmp_path / "r.sqlite3"
    path.write_bytes(b"")
    with caplog.at_level(logging.ERROR, logger="edgellm.api.registry"):
        reg = Registry(path, ttl_s=60)
    kept = list(tmp_path.glob("r.sqlite3.zero-byte-*"))
    assert len(kept) == 1 and kept[0].stat().st_size == 0
    assert reg.reset_reason and "0 bytes" in reg.reset_reason and str(kept[0]) in reg.reset_reason
    assert any("0 bytes" in r.getMessage() for r in caplog.records)
    assert reg.insert("a", "sync", {}, {}, 1)  # a working registry again


def test_pending_from_earlier_boots_excludes_this_boot(tmp_path):
    path = tmp_path / "r.sqlite3"
    old = Registry(path, ttl_s=60, boot_id="boot-1")
    old.insert("old", "async", {}, {}, 1)
    old.close()
    new = Registry(path, ttl_s=60, boot_id="boot-2")
    new.insert("new", "async", {}, {}, 1)
    assert [r.request_id for r in new.pending_from_earlier_boots()] == ["old"]


def test_disk_full_is_a_507_not_a_500(tmp_path):
    """SQLite's page limit stands in for a full disk: it raises the same SQLITE_FULL error."""
    reg = Registry(tmp_path / "r.sqlite3", ttl_s=60)
    reg.insert("a", "sync", {}, {}, 1)
    fill_registry(reg)
    with pytest.raises(RegistryFull) as info:
        reg.insert("b", "sync", {"big": "x" * 20_000}, {}, 1)
    assert info.value.http_status == 507


def fill_registry(reg: Registry) -> None:
    """Cap the database at its current size, so the next write that needs a page fails with SQLITE_FULL."""
    pages = reg._db.execute("PRAGMA page_count").fetchone()[0]
    reg._db.execute(f"PRAGMA max_page_count = {pages}")

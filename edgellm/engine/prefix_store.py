"""A prefix KV cache that survives restarts: llama.cpp sequence state files on disk, one per prefix.

A slot keeps the KV of its last prompt (Slot.cached) while the node runs; this store keeps the
prefixes that proved worth keeping across a restart, so the first request after a start does not
prefill a long system prompt or few-shot preamble again.

Layout: `<directory>/<fingerprint>/` (`directory` is `<state_dir>/prefix-cache`) holds `<key>.kv`
files, where key is the sha256 of the prefix's token ids (int32, little endian), and `index.json`
with each entry's n_tokens, key, size, crc32 (of the file) and last_used (wall clock).
`fingerprint.json` says, for a person, what the folder's fingerprint was made of. The fingerprint
(engine/kv_fingerprint.py) covers everything that makes a state file foreign: the model file (size, sha256
of its GGUF header and first and last MiB), the slot's context size, the KV cache type, flash
attention, the GPU layers and the llama-cpp-python version. A store only reads its own folder, so
the files of another model or layout are never loaded.

Before a file is loaded its size and crc32 must match the index; after, the token ids stored in it
must equal the prompt's first n_tokens, and the sequence must hold exactly the positions 0..n-1. A
file that fails any check is removed (file and entry), the sequence cleared, and restore returns 0:
the request then prefills as if the store did not exist. Nothing here raises into the engine; disk
errors (no space, a read-only folder) log a warning and turn the store off until the next start.

Policy (what the scheduler does with it):

- Save: a prefix is worth saving when a second request reuses at least `min_tokens` of an idle
  slot's cached prefix (a system prompt or few-shot preamble that repeats). Right after the
  scheduler trims that slot to the shared prefix (its KV then holds exactly prompt[:reused],
  positions 0..reused-1) it calls `save(model, slot.seq_id, prompt[:reused])`. A prefix already
  stored (same tokens), or one that a stored entry covers to within `min_gain` tokens, is not saved
  again; files go least recently used first once they pass `max_bytes`.
- Restore: on admission, when the best idle slot shares fewer prompt tokens than the store offers,
  by at least `min_gain` (64), `better_than(shared, prompt)` returns that entry and the scheduler
  calls `restore(model, slot.seq_id, entry, prompt)` into that slot: the slot's cache is replaced,
  so the scheduler sets `slot.cached = prompt[:restored]` (`[]` when restore returned 0: the
  sequence was cleared) and reuses `restored` tokens.
- Only text: a prompt's prefix never matches past its first media stand-in (a negative id), and a
  prefix with media is not saved. Only without a LoRA adapter (its KV is not the base model's), and
  only for models whose memory can drop a suffix (model.partial_trim); `for_model` returns None
  otherwise.

One engine thread drives it, as it drives the model: not thread-safe.

PrefixStore stays whole: its save, restore, eviction and start-up reconciliation all keep one invariant
(the index and the files in the folder agree, entry by entry), and splitting them would scatter it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from edgellm.engine.kv_fingerprint import FORMAT, fingerprint, fingerprint_parts

if TYPE_CHECKING:
    from edgellm.engine.model import LlamaModel

log = logging.getLogger(__name__)

INDEX = "index.json"
SUFFIX = ".kv"
MIN_GAIN = 64  # a restore must offer this many more tokens than the best idle slot already holds
_MIB = 1024 * 1024
_SPACE_RESERVE = 64 * _MIB  # free disk space a save leaves untouched
_SAFE_NAME = re.compile(r"^[0-9A-Za-z_.-]{1,128}$")


@dataclass
class Entry:
    """One stored prefix: its file is `<key>.kv` in the store's folder."""

    key: str  # sha256 (hex) of the prefix's token ids
    n_tokens: int
    size: int  # bytes of the file
    crc32: int  # of the file's bytes
    last_used: float  # time.time() of the last save or restore
    # Set in the index while llama.cpp loads the file: a file whose load never returned (llama.cpp aborts
    # the process on some malformed files instead of refusing them) is dropped at the next start.
    loading: bool = False


def token_digest(tokens: Sequence[int]) -> str:
    """The sha256 (hex) of token ids as int32 little endian: an entry's key."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


def text_length(prompt: Sequence[int]) -> int:
    """How many leading entries of a prompt are text tokens (media stand-ins are negative ids)."""
    for i, t in enumerate(prompt):
        if t < 0:
            return i
    return len(prompt)


def _identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns)


def _crc32_of(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(4 * _MIB):
            crc = zlib.crc32(chunk, crc)
    return crc


class PrefixStore:
    """Prefix KV states on disk for one model fingerprint, at most `max_bytes` of files.

    Prefixes shorter than `min_tokens` are not saved; a restore must offer `min_gain` more tokens
    than the best idle slot holds (better_than).
    """

    def __init__(
        self, directory: str, fingerprint: str, max_bytes: int, min_tokens: int = 256, *, min_gain: int = MIN_GAIN
    ):
        if not _SAFE_NAME.match(fingerprint) or fingerprint in (".", ".."):
            raise ValueError(f"prefix store fingerprint {fingerprint!r} is not a plain folder name")
        self.root = os.path.join(directory, fingerprint)
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.min_tokens = max(1, min_tokens)
        self.min_gain = min_gain
        self.entries: dict[str, Entry] = {}
        self.enabled = True
        self.disabled_reason: str | None = None
        self.counters = {"saves": 0, "restores": 0, "restored_tokens": 0, "evictions": 0, "rejected": 0}
        # key -> (size, mtime_ns) of a file whose checksum matched its entry: a restore of it skips the
        # read (~12-50 ms for 1,000 tokens' 23 MiB, most of a restored request's time to first token).
        # Filled for the files found at start by a background thread, and by save() for new ones.
        self._verified: dict[str, tuple[int, int]] = {}
        try:
            os.makedirs(self.root, exist_ok=True)
            self._load_index()
        except OSError as exc:
            self._disable(f"cannot use {self.root}: {exc}")
        except Exception as exc:  # a damaged index must never stop the engine from starting
            self.entries = {}
            self._disable(f"cannot read the index in {self.root}: {exc!r}")
        if self.enabled and self.entries:
            found = [(e.key, e.crc32, self.path_of(e)) for e in self.entries.values()]
            threading.Thread(target=self._verify, args=(found,), name="prefix-verify", daemon=True).start()

    def _verify(self, found: list[tuple[str, int, str]]) -> None:
        """Checksum the files found at start, off the engine thread (zlib releases the GIL). Only marks
        the good ones; a bad one is left to restore's own check, which removes it."""
        try:  # Linux threads have their own nice value: never take a core from the engine's decode
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        for key, crc, path in found:
            try:
                before = _identity(path)
                if _crc32_of(path) == crc and _identity(path) == before:
                    self._verified[key] = before
            except OSError:
                continue

    @classmethod
    def for_model(cls, model: LlamaModel, *, min_tokens: int = 256) -> PrefixStore | None:
        """The store a model's config asks for (prefix_cache_dir, prefix_cache_bytes); None when it is
        off, or when this model's memory cannot keep a prefix and drop the rest (recurrent, SWA)."""
        config = model.config
        if not config.prefix_cache_dir:
            return None
        if not model.partial_trim:
            log.info("prefix cache off: this model's memory cannot drop a suffix (recurrent or sliding-window)")
            return None
        try:
            parts = fingerprint_parts(model)
        except OSError as exc:
            log.warning("prefix cache off: cannot read the model file for its fingerprint: %s", exc)
            return None
        store = cls(config.prefix_cache_dir, fingerprint(parts), config.prefix_cache_bytes, min_tokens)
        if store.enabled:
            store._write_json("fingerprint.json", parts)
        return store

    # -- queries ---------------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries.values())

    def path_of(self, entry: Entry) -> str:
        return os.path.join(self.root, entry.key + SUFFIX)

    def lookup(self, prompt: Sequence[int]) -> Entry | None:
        """The longest stored prefix whose tokens are a prefix of `prompt` (by hash; restore compares
        the tokens themselves), never reaching past the prompt's first media stand-in."""
        if not self.enabled or not self.entries:
            return None
        limit = text_length(prompt)
        candidates = sorted((e for e in self.entries.values() if e.n_tokens <= limit), key=lambda e: e.n_tokens)
        if not candidates:
            return None
        data = np.asarray(prompt[: candidates[-1].n_tokens], dtype="<i4").tobytes()
        h = hashlib.sha256()
        done = 0
        best = None
        for e in candidates:  # shortest first: one running hash over the prompt serves every length
            h.update(data[4 * done : 4 * e.n_tokens])
            done = e.n_tokens
            if h.hexdigest() == e.key:
                best = e
        return best

    def better_than(self, shared: int, prompt: Sequence[int]) -> Entry | None:
        """The stored prefix worth restoring for `prompt` when the best idle slot shares `shared` of its
        tokens: one that offers at least min_gain more reusable tokens, else None. (At least one prompt
        token is always decoded again, so neither side counts the prompt's last one.)"""
        entry = self.lookup(prompt)
        if entry is None:
            return None
        cap = len(prompt) - 1
        return entry if min(entry.n_tokens, cap) - min(shared, cap) >= self.min_gain else None

    def stats(self) -> dict[str, object]:
        return {
            "enabled": self.enabled,
            "disabled_reason": self.disabled_reason,
            "entries": len(self.entries),
            "bytes": self.total_bytes,
            "max_bytes": self.max_bytes,
            **self.counters,
        }

    # -- restore -----------------------------------------------------------------------------------
    def restore(self, model: LlamaModel, seq_id: int, entry: Entry, prompt: Sequence[int]) -> int:
        """Load `entry` into sequence `seq_id` (whatever it held is dropped): the tokens restored, its
        n_tokens, once they are checked to equal prompt[:n_tokens]. 0 when the file is missing,
        corrupt, truncated, foreign or for other tokens: it is removed, the sequence left empty."""
        if not self.enabled or self.entries.get(entry.key) is not entry:
            return 0
        n = entry.n_tokens
        path = self.path_of(entry)
        started = time.perf_counter()
        try:
            why = self._check_file(entry, path)
            tokens = None
            if why is None and (n > len(prompt) or n > model.seq_ctx):
                why = f"{n} tokens do not fit the prompt or the slot"
            if why is None:
                entry.loading = True
                self._save_index()
                tokens = model.load_sequence(seq_id, path, n)
                entry.loading = False
                if tokens is None:
                    why = "llama.cpp refused the state file"
                elif len(tokens) != n or tokens != list(prompt[:n]):
                    why = "its tokens are not the prompt's"
            if why is not None:
                self._reject(model, seq_id, entry, why)
                return 0
        except Exception as exc:  # never into the engine: the request prefills instead
            self._reject(model, seq_id, entry, f"{type(exc).__name__}: {exc}")
            return 0
        entry.last_used = time.time()
        self.counters["restores"] += 1
        self.counters["restored_tokens"] += n
        self._save_index()
        log.debug(
            "prefix cache: restored %d tokens into seq %d in %.1f ms", n, seq_id, 1000 * (time.perf_counter() - started)
        )
        return n

    def _check_file(self, entry: Entry, path: str) -> str | None:
        try:
            size = os.path.getsize(path)
            if size != entry.size:
                return f"size {size} is not the indexed {entry.size}"
            if self._verified.get(entry.key) == _identity(path):
                return None  # checked since start, and not changed since
            if _crc32_of(path) != entry.crc32:
                return "checksum mismatch"
        except FileNotFoundError:
            return "file missing"
        return None

    def _reject(self, model: LlamaModel, seq_id: int, entry: Entry, why: str) -> None:
        log.warning("prefix cache: dropping %s (%d tokens): %s", entry.key[:16], entry.n_tokens, why)
        self.counters["rejected"] += 1
        try:
            model.trim_sequence(seq_id, 0)
        except Exception as exc:
            log.warning("prefix cache: could not clear seq %d: %s", seq_id, exc)
        self._remove(entry)
        self._save_index()

    # -- save ----------------------------------------------------------------------------------------
    def save(self, model: LlamaModel, seq_id: int, tokens: Sequence[int]) -> bool:
        """Store sequence `seq_id`'s KV, which holds exactly `tokens` at positions 0..n-1; True when a
        file was written. Not saved: fewer than min_tokens, media, a prefix already stored (or covered
        by a stored one to within min_gain tokens), a state larger than max_bytes."""
        if not self.enabled or len(tokens) < self.min_tokens or len(tokens) > model.seq_ctx:
            return False
        if text_length(tokens) < len(tokens):
            return False
        key = token_digest(tokens)
        known = self.entries.get(key)
        if known is not None:
            known.last_used = time.time()
            return False
        cover = self.lookup(tokens)
        if cover is not None and len(tokens) - cover.n_tokens < self.min_gain:
            return False
        tmp = os.path.join(self.root, f".{key}.tmp")
        try:
            return self._write(model, seq_id, list(tokens), key, tmp)
        except OSError as exc:
            self._disable(f"cannot write {self.root}: {exc}")
        except Exception as exc:  # never into the engine
            log.warning("prefix cache: saving %d tokens failed: %s: %s", len(tokens), type(exc).__name__, exc)
        _unlink(tmp)
        return False

    def _write(self, model: LlamaModel, seq_id: int, tokens: list[int], key: str, tmp: str) -> bool:
        expected = model.sequence_state_size(seq_id) + 4 * len(tokens) + 64
        if expected > self.max_bytes:
            log.debug("prefix cache: %d tokens take %d bytes, over max_bytes %d", len(tokens), expected, self.max_bytes)
            return False
        st = os.statvfs(self.root)
        if st.f_bavail * st.f_frsize < expected + _SPACE_RESERVE:
            raise OSError(errno.ENOSPC, "not enough free space for a prefix state", self.root)
        started = time.perf_counter()
        written = model.save_sequence(seq_id, tmp, tokens)
        if written <= 0:
            # llama.cpp says only that it failed: a full disk, a folder that cannot be written.
            raise OSError(errno.EIO, "llama.cpp could not write the sequence state", tmp)
        size = os.path.getsize(tmp)
        if size != written:
            raise OSError(errno.EIO, f"state file has {size} bytes, llama.cpp wrote {written}", tmp)
        if size > self.max_bytes:
            _unlink(tmp)
            return False
        entry = Entry(key, len(tokens), size, _crc32_of(tmp), time.time())
        final = os.path.join(self.root, key + SUFFIX)
        os.replace(tmp, final)
        self._verified[key] = _identity(final)
        self.entries[key] = entry
        self.counters["saves"] += 1
        self._evict(keep=key)
        self._save_index()
        log.info(
            "prefix cache: saved %d tokens (%.1f MiB) in %.0f ms; %d entries, %.1f MiB",
            len(tokens),
            size / _MIB,
            1000 * (time.perf_counter() - started),
            len(self.entries),
            self.total_bytes / _MIB,
        )
        return True

    def _evict(self, keep: str | None = None) -> None:
        """Least recently used first, until the files fit max_bytes (`keep` last of all)."""
        order = sorted(self.entries.values(), key=lambda e: (e.key == keep, e.last_used))
        total = self.total_bytes
        for e in order:
            if total <= self.max_bytes:
                break
            total -= e.size
            self._remove(e)
            self.counters["evictions"] += 1

    # -- memory pressure -------------------------------------------------------------------------------
    def drop_page_cache(self) -> tuple[int, int]:
        """Ask the kernel to drop the page cache of the stored files (posix_fadvise DONTNEED): (files,
        bytes) advised. The files stay; a later restore reads its file from disk again. Under a cgroup
        limit their cached pages count against the node, and a restore or save of tens of MiB leaves
        that much behind. Dirty pages of a recent save are only queued for writeback, not dropped."""
        advise = getattr(os, "posix_fadvise", None)
        if advise is None or not self.entries:  # not Linux / BSD
            return 0, 0
        files = size = 0
        for entry in list(self.entries.values()):
            try:
                fd = os.open(self.path_of(entry), os.O_RDONLY)
            except OSError:
                continue  # gone: restore's own check handles the entry
            try:
                advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                files += 1
                size += entry.size
            except OSError:
                pass
            finally:
                os.close(fd)
        return files, size

    # -- the folder ------------------------------------------------------------------------------------
    def _remove(self, entry: Entry) -> None:
        self.entries.pop(entry.key, None)
        self._verified.pop(entry.key, None)
        _unlink(self.path_of(entry))

    def _load_index(self) -> None:
        """The index as the last run left it, reconciled with the folder: entries without their file (or
        with another size) dropped, files without an entry and temp files removed."""
        try:
            with open(os.path.join(self.root, INDEX), encoding="utf-8") as f:
                data = json.load(f)
            if data.get("format") != FORMAT:
                raise ValueError(f"index format {data.get('format')!r}")
            raw = data["entries"]
            if not isinstance(raw, list):
                raise TypeError(f"entries is {type(raw).__name__}, not a list")
        except FileNotFoundError:
            raw = []
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("prefix cache: unreadable index in %s (%s): starting empty", self.root, exc)
            raw = []
        for item in raw:
            try:
                e = Entry(
                    str(item["key"]),
                    int(item["n_tokens"]),
                    int(item["size"]),
                    int(item["crc32"]),
                    float(item["last_used"]),
                )
            except (KeyError, TypeError, ValueError):
                continue
            if item.get("loading"):
                log.warning("prefix cache: dropping %s: the engine died while loading it", e.key[:16])
                continue  # its file goes with the other files without an entry, below
            if re.fullmatch(r"[0-9a-f]{64}", e.key) and e.n_tokens > 0:
                try:
                    if os.path.getsize(self.path_of(e)) == e.size:
                        self.entries[e.key] = e
                except OSError:
                    pass
        for name in os.listdir(self.root):
            if name.endswith(".tmp") or (name.endswith(SUFFIX) and name[: -len(SUFFIX)] not in self.entries):
                _unlink(os.path.join(self.root, name))
        before = len(self.entries)
        self._evict()  # max_bytes may be smaller than last time
        if len(self.entries) != before or len(self.entries) != len(raw):
            self._save_index()
        if self.entries:
            log.info(
                "prefix cache: %d stored prefixes (%.1f MiB) in %s",
                len(self.entries),
                self.total_bytes / _MIB,
                self.root,
            )

    def _save_index(self) -> None:
        if not self.enabled:
            return
        self._write_json(INDEX, {"format": FORMAT, "entries": [asdict(e) for e in self.entries.values()]})

    def _write_json(self, name: str, data: dict) -> None:
        path = os.path.join(self.root, name)
        tmp = path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, path)
        except OSError as exc:
            _unlink(tmp)
            self._disable(f"cannot write {path}: {exc}")

    def _disable(self, why: str) -> None:
        if self.enabled:
            log.warning("prefix cache disabled until the next start: %s", why)
        self.enabled = False
        self.disabled_reason = why


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass

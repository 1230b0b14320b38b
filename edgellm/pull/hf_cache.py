"""The local Hugging Face hub cache, read as huggingface_hub lays it out, without importing it.

    $HF_HUB_CACHE (else $HF_HOME/hub, else ~/.cache/huggingface/hub)
      models--ORG--NAME/
        refs/main                   the commit a revision names
        snapshots/<commit>/FILE     a link to ../../blobs/<hash>
        blobs/<hash>                the content; for an LFS file (every GGUF) <hash> is its sha256

A file another tool already fetched there (huggingface-cli, llama.cpp's -hf, a stock Ratio1 node) is
used instead of fetched again; the blob name gives its sha256 when no other source does.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def repo_folder(repo: str) -> str:
    """models--ORG--NAME for the model repo ORG/NAME."""
    return "models--" + repo.replace("/", "--")


@dataclass(frozen=True)
class CachedFile:
    path: Path  # the snapshot's entry (a link into blobs/, or a plain file)
    sha256: str | None  # from the blob's name, when it is an LFS blob


def find(repo: str, filename: str, revision: str = "main", cache_dir: Path | None = None) -> CachedFile | None:
    """`filename` of `repo` at `revision` (a branch, a tag or a commit) when the cache holds it, else None.
    A snapshot is read only through the commit the revision names (refs/<revision>, or the revision
    itself when it is a commit): another snapshot could be another version of the file."""
    root = (cache_dir or hub_cache_dir()) / repo_folder(repo)
    commit = revision if _COMMIT.match(revision) else _read_ref(root / "refs" / revision)
    if commit is None:
        return None
    entry = root / "snapshots" / commit / filename
    try:
        target = entry.resolve(strict=True)
    except (OSError, RuntimeError):  # missing, a dangling link (a half-deleted cache), a loop
        return None
    if not target.is_file():
        return None
    name = target.name
    return CachedFile(entry, name if target.parent.name == "blobs" and _SHA256.match(name) else None)


def _read_ref(path: Path) -> str | None:
    try:
        commit = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return commit if _COMMIT.match(commit) else None

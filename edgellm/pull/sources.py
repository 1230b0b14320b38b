"""What `edgellm pull SPEC` fetches and where it puts it: SPEC is a preset name (or a preset file), an
http(s) URL, or hf://ORG/NAME/FILE. Each becomes a list of RemoteFile (several for a split GGUF, whose
first part is the one named) and a destination folder."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from edgellm import gguf_split
from edgellm.errors import PullError
from edgellm.runtime.board.presets import PresetError, available, load_preset

HF_ENDPOINT = "https://huggingface.co"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class RemoteFile:
    url: str
    filename: str  # its name in the destination folder
    sha256: str | None = None  # the expected hash, when the spec, the preset or --sha256 gives one
    size: int | None = None  # the expected size in bytes, when known beforehand
    hf_repo: str | None = None  # ORG/NAME when it comes from the Hugging Face hub (its cache is looked in)
    hf_path: str | None = None  # its path in that repo
    revision: str = "main"


@dataclass(frozen=True)
class PullPlan:
    files: list[RemoteFile]
    dest: Path
    what: str  # for messages: "preset orin-nano (Qwen2.5-1.5B-Instruct Q4_K_M)", the URL, ...

    @property
    def model_path(self) -> Path:
        """The file the node is given: the first (a split GGUF's first part)."""
        return self.dest / self.files[0].filename


def default_dest() -> Path:
    """Where a URL or hf:// file goes without --dest: the user's data folder (a preset says its own)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "edgellm" / "models"


def hf_endpoint() -> str:
    """HF_ENDPOINT, as huggingface_hub reads it (a mirror, or a local server in tests)."""
    return (os.environ.get("HF_ENDPOINT") or HF_ENDPOINT).rstrip("/")


def hf_url(repo: str, path: str, revision: str = "main") -> str:
    return f"{hf_endpoint()}/{repo}/resolve/{quote(revision, safe='')}/{quote(path)}"


def check_sha256(value: str, what: str) -> str:
    digest = value.strip().lower()
    if not _SHA256.match(digest):
        raise PullError(f"{what}: {value!r} is not a sha256 (64 hex digits)")
    return digest


def plan(spec: str, *, dest: str | None = None, sha256: str | None = None, revision: str = "main") -> PullPlan:
    """The files SPEC names. --sha256 checks the file SPEC names (the first part of a split GGUF; the
    others are checked against what their server publishes, when it does)."""
    expected = check_sha256(sha256, "--sha256") if sha256 else None
    if spec.startswith("hf://"):
        repo, path = _split_hf(spec)
        files = [
            RemoteFile(hf_url(repo, p, revision), Path(p).name, None, None, repo, p, revision)
            for p in _with_parts(path)
        ]
        result = PullPlan(files, Path(dest) if dest else default_dest(), spec)
    elif re.match(r"^https?://", spec, re.IGNORECASE):
        parts = urlsplit(spec)
        folder, _, last = parts.path.rpartition("/")
        name = unquote(last)
        if not name or name in (".", "..") or "/" in name or "\x00" in name:
            raise PullError(f"{spec}: the URL does not end in a file name")
        files = [
            RemoteFile(spec if n == name else urlunsplit(parts._replace(path=f"{folder}/{quote(n)}", query="")), n)
            for n in gguf_split.split_parts(name)
        ]
        result = PullPlan(files, Path(dest) if dest else default_dest(), spec)
    elif "://" in spec:
        raise PullError(f"{spec}: only http://, https:// and hf:// sources are pulled")
    else:
        result = _preset_plan(spec, dest, revision)
    if expected is not None:
        first = result.files[0]
        result.files[0] = RemoteFile(
            first.url, first.filename, expected, first.size, first.hf_repo, first.hf_path, first.revision
        )
    return result


def _split_hf(spec: str) -> tuple[str, str]:
    rest = spec[len("hf://") :]
    pieces = rest.split("/")
    repo, path = "/".join(pieces[:2]), "/".join(pieces[2:])
    if not _REPO.match(repo) or not path or any(p in ("", ".", "..") for p in pieces[2:]):
        raise PullError(f"{spec}: expected hf://ORG/NAME/FILE (a file in a Hugging Face model repo)")
    return repo, path


def _with_parts(path: str) -> list[str]:
    folder, _, name = path.rpartition("/")
    return [f"{folder}/{n}" if folder else n for n in gguf_split.split_parts(name)]


def _preset_plan(name: str, dest: str | None, revision: str) -> PullPlan:
    try:
        preset = load_preset(name)
    except PresetError as exc:
        raise PullError(
            f"{exc.message}; a spec is a preset ({', '.join(available()) or 'none installed'}), "
            "an http(s) URL or hf://ORG/NAME/FILE"
        ) from None
    model = preset.model
    repo, first = model.get("hf_repo"), model.get("file")
    if not isinstance(repo, str) or not isinstance(first, str) or not _REPO.match(repo):
        raise PullError(f"preset {preset.name} names no Hugging Face file to pull (model: hf_repo and file)")
    hashes = model.get("sha256") or {}
    if isinstance(hashes, str):  # one file: its hash alone
        hashes = {first: hashes}
    if not isinstance(hashes, dict):
        raise PullError(f"preset {preset.name}: sha256 must be a hash or a mapping of file -> hash")
    files = [
        RemoteFile(
            hf_url(repo, part, revision),
            Path(part).name,
            check_sha256(str(hashes[part]), f"preset {preset.name}") if hashes.get(part) else None,
            None,
            repo,
            part,
            revision,
        )
        for part in _with_parts(first)
    ]
    configured = preset.settings.get("model_path")
    folder = Path(dest) if dest else Path(configured).parent if configured else default_dest()
    label = " ".join(str(model[k]) for k in ("name", "quant") if model.get(k))
    return PullPlan(files, folder, f"preset {preset.name} ({label or first})")

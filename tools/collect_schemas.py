"""Rebuild the real-world JSON-schema corpus in tests/fixtures/schemas/ from local git mirrors.

Every source is read from a git directory (a bare mirror or a clone's .git) at its HEAD with `git ls-tree` and
`git cat-file`, so no checkout is needed. The selection is deterministic: the same commits give the same files.

    python tools/collect_schemas.py \\
        --schemastore /path/SchemaStore+schemastore.git \\
        --kubernetes /path/kubernetes-json-schema.git \\
        --gorilla /path/gorilla.git \\
        --iglu /path/iglu-central.git

A source left out is left alone; a source given has its folder (<out>/<source>/*.json) rewritten. What is
picked, per source (see SOURCES.md beside the corpus for commits and licenses):

- schemastore: src/schemas/json/*.json. One file per family (the name with its version digits removed, the
  latest name kept), then an even spread over the name order in three size bands: <= 4 KiB, <= 20 KiB, <= 60 KiB.
- kubernetes: v1.7.2-standalone/*.json of garethr's kubernetes-json-schema (dereferenced, self-contained);
  an even spread over the same three size bands.
- gorilla: the `parameters` object of each function in some BFCL data sets (JSON lines); distinct ones only,
  an even spread over each data set's order; written re-indented, one per file.
- iglu: schemas/<vendor>/<name>/jsonschema/<version>, the latest version of each schema, an even spread.

Common rules: a file must parse with `json` to an object and be at most 60 KiB; byte-identical or
JSON-identical files are kept once; a schema that leans on other documents is skipped (more than 15% of its
objects hold a `$ref` to another document; some with fewer such refs are kept, as real-world data has them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_BYTES = 60 * 1024
BANDS = (4 * 1024, 20 * 1024, MAX_BYTES)  # upper bounds of the small, medium and large size bands
MAX_EXTERNAL_REF_SHARE = 0.15
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Blob:
    path: str
    sha: str
    size: int


@dataclass(frozen=True)
class Picked:
    name: str  # file name under <out>/<source>/
    data: bytes


class GitTree:
    """Read-only access to the HEAD tree of a git directory."""

    def __init__(self, git_dir: Path) -> None:
        self.git_dir = git_dir

    def _git(self, *args: str) -> bytes:
        return subprocess.run(["git", f"--git-dir={self.git_dir}", *args], capture_output=True, check=True).stdout

    def head(self) -> str:
        return self._git("rev-parse", "HEAD").decode().strip()

    def files(self, prefix: str) -> list[Blob]:
        """Blobs under prefix, sorted by path; blobs absent from the mirror (size 'BAD') are left out."""
        found = []
        for record in self._git("ls-tree", "-r", "-l", "-z", "HEAD", "--", prefix).split(b"\0"):
            if not record:
                continue
            meta, path = record.split(b"\t", 1)
            _mode, kind, sha, size = meta.split()
            if kind == b"blob" and size.isdigit():
                found.append(Blob(path.decode(), sha.decode(), int(size)))
        return sorted(found, key=lambda b: b.path)

    def read(self, blobs: list[Blob]) -> dict[str, bytes]:
        """Contents by path, through one `git cat-file --batch`."""
        request = b"".join(f"{b.sha}\n".encode() for b in blobs)
        out = subprocess.run(
            ["git", f"--git-dir={self.git_dir}", "cat-file", "--batch"], input=request, capture_output=True, check=True
        ).stdout
        contents, pos = {}, 0
        for blob in blobs:
            header_end = out.index(b"\n", pos)
            size = int(out[pos:header_end].split()[2])
            contents[blob.path] = out[header_end + 1 : header_end + 1 + size]
            pos = header_end + 1 + size + 1
        return contents


def parse_object(data: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(data)
    except ValueError:  # includes UnicodeDecodeError
        return None
    return value if isinstance(value, dict) else None


def walk_objects(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk_objects(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk_objects(value)


def external_ref_share(schema: dict[str, Any], file_name: str) -> float:
    """Share of the schema's objects holding a $ref to another document.

    A ref is local when its document part is empty, is the schema's own $id (or draft-04 id), or is a relative name
    that is the file's own name or the last segment of its $id."""
    own_id = str(schema.get("$id", schema.get("id", ""))).split("#", 1)[0]
    own_names = {file_name, Path(file_name).stem, own_id.rsplit("/", 1)[-1]} - {""}

    def is_external(ref: str) -> bool:
        document = ref.split("#", 1)[0]
        if not document or document == own_id:
            return False
        return "://" in document or document not in own_names

    objects = list(walk_objects(schema))
    external = sum(isinstance(o.get("$ref"), str) and is_external(o["$ref"]) for o in objects)
    return external / len(objects)


def usable(data: bytes, file_name: str) -> bool:
    if len(data) > MAX_BYTES:
        return False
    schema = parse_object(data)
    return schema is not None and external_ref_share(schema, file_name) <= MAX_EXTERNAL_REF_SHARE


def spread(items: list[Any], count: int) -> list[Any]:
    """count items evenly spaced over items (all of them when there are no more than count)."""
    if len(items) <= count:
        return list(items)
    return [items[(2 * i + 1) * len(items) // (2 * count)] for i in range(count)]


def by_bands(items: list[Picked], counts: tuple[int, int, int]) -> list[Picked]:
    chosen: list[Picked] = []
    low = -1
    for high, count in zip(BANDS, counts, strict=True):
        chosen += spread([p for p in items if low < len(p.data) <= high], count)
        low = high
    return chosen


def natural_key(text: str) -> list[Any]:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text)]


def schemastore(tree: GitTree) -> list[Picked]:
    blobs = [b for b in tree.files("src/schemas/json/") if b.path.endswith(".json") and b.size <= MAX_BYTES]
    contents = tree.read(blobs)
    families: dict[str, Picked] = {}
    for blob in sorted(blobs, key=lambda b: natural_key(b.path)):  # the latest version of a family comes last
        name = blob.path.rsplit("/", 1)[-1]
        if usable(contents[blob.path], name):
            family = re.sub(r"[-_.]*\d[\d.x]*", "-", name.removesuffix(".json")).strip("-")
            families[family] = Picked(name, contents[blob.path])
    return by_bands(dedupe(sorted(families.values(), key=lambda p: p.name)), (70, 90, 60))


def kubernetes(tree: GitTree) -> list[Picked]:
    blobs = [b for b in tree.files("v1.7.2-standalone/") if b.path.endswith(".json") and b.size <= MAX_BYTES]
    contents = tree.read(blobs)
    items = [Picked(b.path.rsplit("/", 1)[-1], contents[b.path]) for b in blobs]
    items = dedupe([p for p in items if usable(p.data, p.name)])
    return by_bands(items, (6, 12, 12))


GORILLA_DATA = "berkeley-function-call-leaderboard/bfcl_eval/data/"
GORILLA_SETS = (  # data set (JSON lines), how many distinct parameter schemas to take from it
    ("BFCL_v4_live_simple.json", 12),
    ("BFCL_v4_live_multiple.json", 14),
    ("BFCL_v4_live_parallel_multiple.json", 4),
    ("BFCL_v4_simple_python.json", 8),
    ("BFCL_v4_multiple.json", 6),
    ("BFCL_v4_parallel_multiple.json", 4),
    ("multi_turn_func_doc/gorilla_file_system.json", 2),
    ("multi_turn_func_doc/travel_booking.json", 2),
    ("multi_turn_func_doc/vehicle_control.json", 2),
    ("multi_turn_func_doc/trading_bot.json", 2),
    ("BFCL_v4_simple_java.json", 2),
    ("BFCL_v4_simple_javascript.json", 2),
)


def functions(line: dict[str, Any]) -> list[dict[str, Any]]:
    """The function documents of one JSON line: a test entry's `function` list, or the line itself."""
    found = line.get("function", [line])
    return [f for f in found if isinstance(f, dict)]


def gorilla(tree: GitTree) -> list[Picked]:
    blobs = {b.path: b for b in tree.files(GORILLA_DATA)}
    chosen: list[Picked] = []
    seen: set[str] = set()
    for data_set, count in GORILLA_SETS:
        path = GORILLA_DATA + data_set
        text = tree.read([blobs[path]])[path].decode()
        stem = Path(data_set).stem.removeprefix("BFCL_v4_")
        candidates: list[Picked] = []
        for line in filter(None, map(str.strip, text.splitlines())):
            for function in functions(json.loads(line)):
                parameters = function.get("parameters")
                if not isinstance(parameters, dict) or not parameters.get("properties"):
                    continue
                key = json.dumps(parameters, sort_keys=True)
                if key in seen:
                    continue
                seen.add(key)
                name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(function.get("name", "unnamed")))
                data = (json.dumps(parameters, indent=2, ensure_ascii=False) + "\n").encode()
                candidates.append(Picked(f"{stem}__{name}.json", data))
        chosen += [p for p in spread(candidates, count) if len(p.data) <= MAX_BYTES]
    return unique_names(chosen)


def iglu(tree: GitTree) -> list[Picked]:
    latest: dict[str, Blob] = {}
    for blob in tree.files("schemas/"):
        parts = blob.path.split("/")  # schemas/<vendor>/<name>/jsonschema/<model-revision-addition>
        if len(parts) == 5 and parts[3] == "jsonschema" and blob.size <= MAX_BYTES:
            key = "/".join(parts[1:3])
            if key not in latest or natural_key(parts[4]) > natural_key(latest[key].path.split("/")[4]):
                latest[key] = blob
    blobs = [latest[k] for k in sorted(latest)]
    contents = tree.read(blobs)
    items = []
    for blob in blobs:
        _, vendor, name, _, version = blob.path.split("/")
        file_name = f"{vendor}__{name}__{version}.json"
        if usable(contents[blob.path], version):
            items.append(Picked(file_name, contents[blob.path]))
    return spread(dedupe(items), 50)


def dedupe(items: list[Picked]) -> list[Picked]:
    """Keep the first of byte-identical or JSON-identical files."""
    seen: set[str] = set()
    kept = []
    for item in items:
        keys = {hashlib.sha256(item.data).hexdigest(), canonical_hash(item.data)}
        if not keys & seen:
            kept.append(item)
        seen |= keys
    return kept


def canonical_hash(data: bytes) -> str:
    return hashlib.sha256(json.dumps(json.loads(data), sort_keys=True).encode()).hexdigest()


def unique_names(items: list[Picked]) -> list[Picked]:
    taken: set[str] = set()
    renamed = []
    for item in items:
        name, n = item.name, 2
        while name in taken:
            name = item.name.replace(".json", f"__{n}.json")
            n += 1
        taken.add(name)
        renamed.append(Picked(name, item.data))
    return renamed


SOURCES: dict[str, Callable[[GitTree], list[Picked]]] = {
    "schemastore": schemastore,
    "kubernetes": kubernetes,
    "gorilla": gorilla,
    "iglu": iglu,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/schemas", help="corpus folder")
    for source in SOURCES:
        parser.add_argument(f"--{source}", type=Path, metavar="GIT_DIR", help=f"git directory of the {source} mirror")
    args = parser.parse_args(argv)
    given = {source: getattr(args, source) for source in SOURCES if getattr(args, source)}
    if not given:
        parser.error("give at least one mirror")
    seen: set[str] = set()  # content already written by an earlier source, this run
    for source, git_dir in given.items():
        tree = GitTree(git_dir)
        picked = [p for p in dedupe(SOURCES[source](tree)) if canonical_hash(p.data) not in seen]
        seen |= {canonical_hash(p.data) for p in picked}
        folder = args.out / source
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.json"):
            old.unlink()
        for item in picked:
            (folder / item.name).write_bytes(item.data)
        size = sum(len(p.data) for p in picked)
        print(f"{source}: {len(picked)} files, {size / 1024:.0f} KiB, HEAD {tree.head()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The JSON schema a synthetic run is driven by: loading, checking, hashing, the prompt, record checks.

Framework-agnostic: used by `edgellm synth` and by the Ratio1 plugin's bridge alike.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.validators import validator_for

from edgellm import jsonsafe
from edgellm.errors import SynthInputError

MAX_SCHEMA_BYTES = 256 * 1024  # the node refuses bigger request bodies anyway; say so before sending
DEFAULT_PROMPT = (
    "Create one synthetic record #{index} as a single JSON object with these fields: {fields}. "
    "Use realistic, varied values; make this record different from the others."
)
SYSTEM_PROMPT = "You generate synthetic data. Answer with one JSON object that matches the given JSON schema."


def strict_loads(text: str | bytes, *, lone_surrogates: jsonsafe.Surrogates = "keep") -> Any:
    """JSON as the node's one strict reader takes it (edgellm/jsonsafe.py: no NaN/Infinity, no duplicate
    keys, bounded numbers and depth); ValueError naming the problem otherwise. A lone surrogate is kept
    by default: an answer holding one is still JSON; the schema file refuses it."""
    try:
        return jsonsafe.loads(text, lone_surrogates=lone_surrogates)
    except jsonsafe.JSONProblem as p:
        if p.kind == "duplicate":
            inside = f" in {jsonsafe.json_path(p.parts[:-1])}" if len(p.parts) > 1 else ""
            raise ValueError(f"duplicate key {jsonsafe.key_text(p.key or '')} in an object{inside}") from None
        if p.kind == "syntax":  # callers say "not valid JSON" themselves
            raise ValueError(p.problem.removeprefix("is not valid JSON: ")) from None
        raise ValueError(p.describe("the text")) from None


def check_schema(schema: Any, where: str = "schema") -> dict[str, Any]:
    """The schema itself if it is a usable JSON schema object, else SynthInputError naming the problem."""
    if not isinstance(schema, dict):
        raise SynthInputError(f"{where}: a JSON schema object is required, got {type(schema).__name__}")
    if not schema:
        raise SynthInputError(f"{where}: the schema is empty ({{}} accepts anything: give it properties)")
    try:
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise SynthInputError(f"{where}: not serialisable as JSON ({exc})") from None
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SCHEMA_BYTES:
        raise SynthInputError(f"{where}: over {MAX_SCHEMA_BYTES // 1024} KiB")
    remote = _remote_ref(schema)
    if remote is not None:
        raise SynthInputError(f"{where}: $ref {remote!r} points outside the schema; inline it (under $defs)")
    try:
        validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path) or "(root)"
        raise SynthInputError(f"{where}: not a valid JSON schema at {path}: {exc.message[:300]}") from None
    except RecursionError:
        raise SynthInputError(f"{where}: nested too deeply") from None
    return schema


def _remote_ref(schema: Any) -> str | None:
    """The first $ref that is not a local '#...' pointer: nothing is fetched, by us or by the node."""
    stack = [schema]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            ref = value.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return ref
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return None


def load_schema(path: str | Path) -> dict[str, Any]:
    """Read and check a schema file; SynthInputError (never another exception) for any problem."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SynthInputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SynthInputError(f"{path}: is a directory, not a schema file") from None
    except OSError as exc:
        raise SynthInputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(raw) > MAX_SCHEMA_BYTES:
        raise SynthInputError(f"{path}: over {MAX_SCHEMA_BYTES // 1024} KiB")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SynthInputError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        schema = strict_loads(text, lone_surrogates="refuse")
    except ValueError as exc:  # JSONDecodeError is one
        raise SynthInputError(f"{path}: not valid JSON ({exc})") from None
    return check_schema(schema, where=str(path))


def schema_hash(schema: dict[str, Any]) -> str:
    return hashlib.sha256(canonical(schema).encode("utf-8", "surrogatepass")).hexdigest()


def canonical(value: Any) -> str:
    """One text per JSON value, whatever its key order: what duplicates are judged by."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def describe_fields(schema: dict[str, Any]) -> str:
    """'name (string), age (integer), ...' for the default prompt; the schema itself when it has no properties."""
    props = schema.get("properties")
    if not isinstance(props, dict) or not props:
        return json.dumps(schema, ensure_ascii=False)[:2000]
    parts = []
    for name, spec in props.items():
        kind = spec.get("type") if isinstance(spec, dict) else None
        if isinstance(kind, list):
            kind = "/".join(str(k) for k in kind)
        if isinstance(spec, dict) and isinstance(spec.get("enum"), list):
            kind = "one of " + ", ".join(json.dumps(v, ensure_ascii=False) for v in spec["enum"][:20])
        desc = spec.get("description") if isinstance(spec, dict) else None
        text = f"{name} ({kind})" if kind else str(name)
        if isinstance(desc, str) and desc.strip():
            text += f": {desc.strip()[:200]}"
        parts.append(text)
    return "; ".join(parts)


def render_prompt(template: str | None, schema: dict[str, Any], index: int) -> str:
    """Placeholders {index} (1-based), {fields} and {schema}, replaced literally (other braces stay as they are)."""
    text = template if template and template.strip() else DEFAULT_PROMPT
    replacements = {
        "{index}": str(index + 1),
        "{fields}": describe_fields(schema),
        "{schema}": json.dumps(schema, ensure_ascii=False),
    }
    for key, value in replacements.items():
        text = text.replace(key, value)
    return text


class RecordChecker:
    """Parses an answer and validates it against the schema (formats checked where jsonschema can)."""

    def __init__(self, schema: dict[str, Any]):
        cls = validator_for(schema)
        self._validator = cls(schema, format_checker=cls.FORMAT_CHECKER)

    def check(self, text: str) -> tuple[Any | None, str | None]:
        """(record, None) when valid, (None, reason) otherwise."""
        try:
            record = strict_loads(text)
        except ValueError as exc:
            return None, f"not valid JSON: {str(exc)[:200]}"
        if isinstance(record, float) and not math.isfinite(record):
            return None, "not a finite number"
        try:
            error = next(iter(self._validator.iter_errors(record)), None)
        except RecursionError:
            return None, "nested too deeply"
        except Exception as exc:  # noqa: BLE001 - a schema jsonschema cannot apply costs a record, not the run
            return None, f"schema cannot be applied ({type(exc).__name__}: {str(exc)[:200]})"
        if error is not None:
            path = "/".join(str(p) for p in error.absolute_path) or "(root)"
            return None, f"schema violation at {path}: {error.message[:200]}"
        return record, None

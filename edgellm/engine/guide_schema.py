"""A guide as llguidance is given it: its text, a JSON schema read as meant, and what of it is not enforced.

`spec_text(spec)` is the text a GuideSpec compiles from (a JSON schema through `as_generated`: the type
names other generators write read as JSON types, an unknown `$schema` dialect dropped, int64 bounds
clamped; a structural tag checked and stripped to its `triggers` + `structures` form). `schema_gaps`
words llguidance's compile warnings as notes placed by JSON pointer, and `keywords` walks every keyword of
a schema (the pre-scan in guide_limits.py walks with it too).

Pure Python, no llguidance: a schema's reading changes with the clients' schemas, the compile with
llguidance (engine/guide_llguidance.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from edgellm.engine.types import GuideKind, GuideSpec
from edgellm.errors import GuideError

# Keywords whose values are JSON data, not subschemas: a {"pattern": ...} in an example is no regex.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})


def spec_text(spec: GuideSpec) -> str:
    """The text llguidance compiles the guide from (a JSON schema: as_generated, keys sorted)."""
    if spec.kind is GuideKind.JSON_OBJECT:
        return json.dumps({"type": "object"})
    if spec.kind is GuideKind.JSON_SCHEMA:
        if not isinstance(spec.spec, dict):
            raise GuideError("json_schema must be a JSON object (a dict)")
        return json.dumps(as_generated(spec.spec), sort_keys=True)
    if spec.kind is GuideKind.CHOICE:
        if not isinstance(spec.spec, list) or not spec.spec or not all(isinstance(c, str) and c for c in spec.spec):
            raise GuideError("choice must be a non-empty list of non-empty strings")
        return json.dumps(spec.spec)
    if spec.kind is GuideKind.STRUCTURAL_TAG:
        return json.dumps(structural_tag(spec.spec), sort_keys=True)
    if not isinstance(spec.spec, str) or not spec.spec.strip():
        raise GuideError(f"{spec.kind.value} must be a non-empty string")
    return spec.spec


# Type names function-calling data sets and other languages' generators write (Berkeley's function-calling
# leaderboard: "dict", "float", "tuple"; Java/JS: "String", "long"), read as the JSON schema type they mean.
TYPE_ALIASES = {
    "dict": "object", "float": "number", "double": "number", "long": "integer", "int": "integer",
    "tuple": "array", "list": "array", "bool": "boolean", "str": "string",
    "String": "string", "Boolean": "boolean", "Integer": "integer", "Number": "number", "Object": "object",
    "Array": "array",
}  # fmt: skip
# JSON's safe integers: llguidance cannot build the regex of a range bounded by an int64 limit
# (`minimum: -9223372036854775808`, common in Kubernetes and OpenAPI schemas); a model writes no such number
# anyway, and every value generated within the clamp satisfies the original bound.
_SAFE_INT = 2**53
_DIALECTS = ("json-schema.org/draft-04/", "json-schema.org/draft-06/", "json-schema.org/draft-07/",
             "json-schema.org/draft/2019-09/", "json-schema.org/draft/2020-12/")  # fmt: skip


def as_generated(schema: dict) -> dict:
    """The schema llguidance is given: the client's, with what it would refuse for no reason of the
    schema's own read as meant: a `$schema` naming a dialect it does not bundle (Snowplow's self-describing
    schemas, Kubernetes' "http://json-schema.org/schema#") dropped, so the default dialect applies; the
    TYPE_ALIASES read as JSON types; integer bounds beyond +-2^53 clamped. The answer is checked after
    generation against this same schema, whole (engine/schema_check.py: a validator would refuse a `dict`
    type or an unknown dialect just as llguidance does)."""
    out = _as_generated(schema, 0)
    meta = out.get("$schema")
    if isinstance(meta, str) and not any(d in meta for d in _DIALECTS):
        out = {k: v for k, v in out.items() if k != "$schema"}
    return out


# Keywords whose value maps names to subschemas: its keys are property or definition names, not keywords.
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _as_generated(node: object, depth: int, names: bool = False) -> object:
    if isinstance(node, list):
        return [_as_generated(item, depth + 1) for item in node]
    if not isinstance(node, dict) or depth > 128:
        return node
    if names:  # {"default": {...schema...}}: a property named like a keyword
        return {key: _as_generated(value, depth + 1) for key, value in node.items()}
    out = {}
    for key, value in node.items():
        if key in _NAME_MAPS:
            out[key] = _as_generated(value, depth + 1, names=True)
        elif key in _DATA_KEYS:
            out[key] = value
        elif key == "type" and value == "any":
            continue  # an older dialect's word for no type constraint
        elif key == "type" and isinstance(value, str):
            out[key] = TYPE_ALIASES.get(value, value)
        elif key == "type" and isinstance(value, list):
            out[key] = [TYPE_ALIASES.get(v, v) if isinstance(v, str) else v for v in value]
        elif key == "format" and value in ("int64", "uint64"):
            continue  # llguidance reads it as the int64 range, the bound it cannot build (see _SAFE_INT)
        elif key in ("minimum", "exclusiveMinimum") and isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = max(value, -_SAFE_INT) if value < -_SAFE_INT else value
        elif key in ("maximum", "exclusiveMaximum") and isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = min(value, _SAFE_INT) if value > _SAFE_INT else value
        else:
            out[key] = _as_generated(value, depth + 1)
    return out


def structural_tag(spec: object) -> dict:
    """Checks the `triggers` + `structures` form and returns it without anything else."""
    if not isinstance(spec, dict):
        raise GuideError("structural_tag must be an object with `triggers` and `structures`")
    triggers, structures = spec.get("triggers"), spec.get("structures")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise GuideError("structural_tag.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise GuideError("structural_tag.structures must be a non-empty list")
    for i, st in enumerate(structures):
        where = f"structural_tag.structures[{i}]"
        if not isinstance(st, dict) or not isinstance(st.get("begin"), str) or not isinstance(st.get("end"), str):
            raise GuideError(f"{where} must be an object with string `begin` and `end` and a `schema` object")
        if set(st) - {"begin", "schema", "end"}:
            raise GuideError(f"{where} has unknown keys {sorted(set(st) - {'begin', 'schema', 'end'})}")
        if not isinstance(st.get("schema"), dict):
            raise GuideError(f"{where}.schema must be a JSON schema object")
        if not any(st["begin"].startswith(t) for t in triggers):
            raise GuideError(f"{where}.begin {st['begin']!r} does not start with any of the triggers")
    return {
        "triggers": triggers,
        "structures": [{"begin": st["begin"], "schema": st["schema"], "end": st["end"]} for st in structures],
    }


def schema_gaps(schema: object, warnings: tuple[str, ...]) -> list[str]:
    keys: set[str] = set()
    formats: set[str] = set()
    one_of = False
    for warning in warnings:
        if warning.startswith("Unimplemented keys:"):
            try:
                keys.update(json.loads(warning.split(":", 1)[1]))
            except ValueError:
                pass
        elif warning.startswith("Unknown format:"):
            formats.add(warning.split(":", 1)[1].strip())
        elif "oneOf" in warning:
            one_of = True
    notes: list[str] = []
    for at, key, value in keywords(schema):
        if len(notes) >= 64:
            break
        if key in keys:
            notes.append(f"{key} at {at} is not enforced while generating (checked after)")
        elif key == "format" and isinstance(value, str) and value in formats:
            notes.append(f"format {value!r} at {at} is unknown: generated as a plain string")
        elif key == "oneOf" and one_of:
            notes.append(f"oneOf at {at} is generated as anyOf (checked after)")
        elif key == "type" and isinstance(value, str) and value in TYPE_ALIASES:
            notes.append(f"type {value!r} at {at} is read as {TYPE_ALIASES[value]!r}")
    return notes


def keywords(schema: object) -> Iterator[tuple[str, str, object]]:
    """(JSON pointer of the subschema, keyword, value) for every keyword of every subschema; data values
    (enum, const, default, examples) are not entered, and the keys of a name map (properties, $defs) are
    names, never keywords."""
    stack: list[tuple[object, str, bool]] = [(schema, "", False)]
    while stack:
        node, path, names = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{path}/{i}", False) for i, item in reversed(list(enumerate(node))))
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if names:
                stack.append((value, f"{path}/{_pointer(key)}", False))
                continue
            if key in _DATA_KEYS:
                continue
            yield path or "/", key, value
            if isinstance(value, dict | list):
                stack.append((value, f"{path}/{_pointer(key)}", key in _NAME_MAPS))


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")

"""A schema as the alternatives a JSON container may take: what json_cursor.py's open objects and arrays owe against.

`SchemaShapes(root).of(schema)` gives a subschema's alternatives, each a `Shape`: the conjunction of the
schema objects its value must match (`$ref` followed, `allOf` merged, `anyOf`/`oneOf` split into
alternatives), made once per schema object and bounded (MAX_ALTERNATIVES, MAX_REF_HOPS, MAX_EXPAND_VISITS)
whatever the schema's nesting. A Shape answers what the cursor asks of it: a property's or an item's schema,
whether a key is allowed, the required keys, min/max items, a string's fewest characters, the costliest
optional entry.

Apart from the cursor: this reads schemas (it changes with the JSON Schema keywords followed), the cursor
reads bytes (it changes with what generation writes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgellm.engine.schema_size import INF, SchemaSize, implied_types, item_schema, min_string_chars, resolve

# Alternatives followed per container (an allOf of anyOfs multiplies them); past it, the first ones.
MAX_ALTERNATIVES = 32
# `$ref` hops followed to reach a container's schema (a chain of refs to refs; a loop ends here).
MAX_REF_HOPS = 32
# Schema nodes one container's alternatives may visit; past it, the rest reads as unknown.
MAX_EXPAND_VISITS = 512
# Entries of each memo before it is emptied (a schema's nodes, and the merged ones values make).
MEMO_ENTRIES = 4096


def costly(size: float) -> int:
    """A size from SchemaSize as a token count (an instance the schema cannot finish counts 0: the
    grammar check refused such schemas up front, and a wrong branch must not stop the closing)."""
    return 0 if size == INF else int(size)


@dataclass
class Shape:
    """One alternative of a container's schema: the conjunction of the schema objects it must match."""

    parts: list[dict]
    _props: dict[str, Any] = field(default_factory=dict)  # key -> its schema, made once (stable ids)
    _optional: list[tuple[int, str]] | None = None  # (entry cost, key) of the optional keys, costliest first
    _open: bool = True  # undeclared keys allowed

    def prop(self, key: str) -> Any:
        """The schema of property `key` (None: unknown, any value)."""
        if key not in self._props:
            if len(self._props) > 4096:
                self._props.clear()
            self._props[key] = self._prop(key)
        return self._props[key]

    def _prop(self, key: str) -> Any:
        found = [
            p["properties"][key] for p in self.parts if isinstance(p.get("properties"), dict) and key in p["properties"]
        ]
        if found:
            return found[0] if len(found) == 1 else {"allOf": found}
        for p in self.parts:
            extra = p.get("additionalProperties")
            if isinstance(extra, dict) and not p.get("patternProperties"):
                return extra
        return None

    def allows(self, key: str) -> bool:
        """Whether a key may appear (as far as can be told without running patterns)."""
        for p in self.parts:
            props = p.get("properties") if isinstance(p.get("properties"), dict) else {}
            if p.get("additionalProperties") is False and key not in props and not p.get("patternProperties"):
                return False
        return True

    def required(self) -> list[str]:
        keys = [
            k for p in self.parts if isinstance(p.get("required"), list) for k in p["required"] if isinstance(k, str)
        ]
        return list(dict.fromkeys(keys))

    def item(self, index: int) -> Any:
        """The schema of an array's item at `index` (None: unknown, any value)."""
        return next((s for p in self.parts if (s := item_schema(p, index)) is not None), None)

    def max_items(self) -> int:
        counts = [p.get("maxItems") for p in self.parts]
        return min((int(c) for c in counts if isinstance(c, int) and not isinstance(c, bool)), default=1 << 30)

    def next_key_cost(self, written: set[str], sizes: SchemaSize) -> int:
        """The costliest optional entry not written yet (a required one is owed already), or an
        undeclared key's where the shape allows one."""
        if self._optional is None:
            required = set(self.required())
            declared = {
                k: v for p in self.parts if isinstance(p.get("properties"), dict) for k, v in p["properties"].items()
            }
            self._optional = sorted(
                ((entry_tokens(k, v, sizes), k) for k, v in declared.items() if k not in required), reverse=True
            )
            self._open = all(p.get("additionalProperties") is not False for p in self.parts)
        worst = next((cost for cost, key in self._optional if key not in written), 0)
        return max(worst, 6) if self._open else worst

    def min_items(self) -> int:
        counts = [p.get("minItems") for p in self.parts]
        return max((int(min(c, 1 << 20)) for c in counts if isinstance(c, int) and not isinstance(c, bool)), default=0)

    def min_chars(self) -> int:
        """The fewest characters a string of this shape has (minLength, pattern, format)."""
        return max((min_string_chars(p) for p in self.parts), default=0)


def entry_tokens(key: str, schema: Any, sizes: SchemaSize) -> int:
    """Tokens of one object entry written at its shortest: the comma, the key, the colon, the value."""
    return int(sizes.unit.key(key)) + 2 + costly(sizes.size(schema if schema is not None else True))


def container_kinds(schema: dict) -> set[str]:
    """ "object" and/or "array", as a schema's own keywords say its instances may be (type, or implied)."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else implied_types(schema)
    return {k for k in kinds if k in ("object", "array")}


def product(left: list[Shape], right: list[Shape]) -> list[Shape]:
    """Every alternative of `left` with every one of `right` (both must hold), at most MAX_ALTERNATIVES."""
    return [Shape(a.parts + b.parts) for a in left for b in right][:MAX_ALTERNATIVES]


class SchemaShapes:
    """The alternatives of a root schema's subschemas, memoized by schema object (each entry holds its node, so
    an id is not reused while its entry lives)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self._memo: dict[int, tuple[dict, list[Shape]]] = {}
        self._expanded: dict[int, tuple[dict, list[Shape]]] = {}
        self.visits = 0  # schema nodes the last expansion visited (bounded by MAX_EXPAND_VISITS)

    def of(self, schema: Any) -> list[Shape]:
        """The alternatives of `schema` as conjunctions of schema objects ($ref followed, allOf merged,
        anyOf/oneOf split); [] for an unknown schema. Made once per schema object."""
        if not isinstance(schema, dict):
            return []
        hit = self._memo.get(id(schema))
        if hit is None or hit[0] is not schema:
            if len(self._memo) > MEMO_ENTRIES:
                self._memo.clear()
            self.visits = 0
            hit = self._memo[id(schema)] = (schema, self._expand(schema, MAX_REF_HOPS, set())[:MAX_ALTERNATIVES])
        return hit[1]

    def _expand(self, node: Any, hops: int, opened: set[int]) -> list[Shape]:
        """`node`'s alternatives. A node met again inside itself (`$ref` recursion), a chain past
        MAX_REF_HOPS or a schema past MAX_EXPAND_VISITS nodes reads as unknown (no keys owed) there: the
        work per schema stays bounded whatever its anyOf/$ref nesting (one memo entry per node)."""
        self.visits += 1
        if not isinstance(node, dict) or hops <= 0 or id(node) in opened or self.visits > MAX_EXPAND_VISITS:
            return [Shape([])]
        hit = self._expanded.get(id(node))
        if hit is not None and hit[0] is node:
            return hit[1]
        opened.add(id(node))
        try:
            own = {k: v for k, v in node.items() if k not in ("$ref", "allOf", "anyOf", "oneOf")}
            shapes = [Shape([own])]
            ref = node.get("$ref")
            if isinstance(ref, str) and self.root is not None:
                target = resolve(self.root, ref)
                if isinstance(target, dict):
                    shapes = product(shapes, self._expand(target, hops - 1, opened))
            parts = node.get("allOf")
            if isinstance(parts, list):
                for part in parts:
                    shapes = product(shapes, self._expand(part, hops - 1, opened))
            for key in ("anyOf", "oneOf"):
                branches = node.get(key)
                if isinstance(branches, list) and branches:
                    union: list[Shape] = []
                    for branch in branches:
                        union += self._expand(branch, hops - 1, opened)
                        if len(union) >= MAX_ALTERNATIVES:
                            break
                    shapes = product(shapes, union[:MAX_ALTERNATIVES])
        finally:
            opened.discard(id(node))
        if len(self._expanded) > MEMO_ENTRIES:
            self._expanded.clear()
        self._expanded[id(node)] = (node, shapes)
        return shapes

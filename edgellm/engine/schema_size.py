"""The shortest instance of a JSON schema, in bytes of compact JSON: computed from the schema, exactly
where the schema says it (types, required keys, minimum counts, enums, `$ref` recursion) and as a lower
bound where it does not (a pattern's shortest match counts characters, `allOf` takes its largest part).

Why: whether a schema can be completed within the output budget used to be decided by a greedy walk
over llguidance's matcher, which can miss the way out of a large finite schema (GOV.UK publishing
schemas: many required `$ref`'d objects with URL patterns) and refuse it. Here recursion is solved as a
fixed point over the `$ref` targets (as the shortest derivation of a grammar is): a target is finite as
soon as one of its alternatives is made of finite parts, so a recursion with a base case has a finite
size and one without stays infinite, and the targets that stay infinite are the recursion to name.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from typing import Any

INF = math.inf
# Bytes of the shortest value of each JSON type, compact.
_TYPE_MIN = {"null": 4, "boolean": 4, "integer": 1, "number": 1, "string": 2, "array": 2, "object": 2}
# Strings of a known format, at their shortest ("a@b.c", "2024-01-01", ...), with the quotes.
_FORMAT_MIN = {
    "date": 12, "time": 10, "date-time": 22, "email": 7, "idn-email": 7, "hostname": 3, "ipv4": 9,
    "ipv6": 4, "uuid": 38, "uri": 4, "uri-reference": 2, "iri": 4, "duration": 5,
}  # fmt: skip
_MAX_ROUNDS = 64  # fixed-point rounds: more means a ref chain this long, which is answered "unknown"


class Bytes:
    """Sizes in bytes of compact JSON: what an instance takes in the output."""

    def key(self, name: str) -> float:
        """An object key, quoted, written whole (the grammar forces it)."""
        return _json_len(name)

    def chars(self, n: int) -> float:
        """Free characters of a value (string content, an enum value, `true`): one byte each."""
        return n


class Tokens(Bytes):
    """Sizes in tokens, generous: what finishing an instance takes in the output budget.

    A key is counted as the tokenizer splits it (`count`, when the caller has the model's tokenizer;
    else ~2 bytes a token); what the model writes (string characters, an enum value, `true`) a token a
    byte, because the closing steering prefers the shortest pieces; punctuation (quotes, brackets,
    commas, colons) a token each, as in Bytes."""

    def __init__(self, count: Callable[[bytes], int] | None = None):
        self._count = count
        self._keys: dict[str, int] = {}

    def key(self, name: str) -> float:
        if name not in self._keys:
            text = json.dumps(name, ensure_ascii=False).encode("utf-8", "surrogatepass")
            if len(self._keys) > 4096:
                self._keys.clear()
            self._keys[name] = self._count(text) if self._count is not None else len(text) // 2 + 1
        return self._keys[name]


class SchemaSize:
    """Shortest-instance sizes of one schema document (its `$ref`s resolved against `root`), in bytes
    or, with `unit=Tokens(...)`, in tokens.

    `match_patterns=False` never runs a schema's regex (a required key is not matched against
    patternProperties): the engine's worker uses it, where a client's pathological pattern must not
    backtrack; the guide checks run it in their budgeted child process.

    `worst_choice=True` sizes a choice (anyOf, an enum, a list of types) by its costliest finite option:
    the closing steering prefers closers, it cannot tell which branch a first character leads into, so a
    budget must hold whichever the model takes."""

    def __init__(self, root: Any, unit: Bytes | None = None, match_patterns: bool = True, worst_choice: bool = False):
        self.root = root
        self.worst_choice = worst_choice
        self.unit = unit if unit is not None else Bytes()
        self.match_patterns = match_patterns
        self._refs: dict[str, float] = {}  # $ref string -> current estimate (INF until proven finite)
        self._targets: dict[str, Any] = {}
        self.converged = True
        self._memo: dict[int, tuple[dict, float]] = {}  # id(node) -> (node, size) while the table holds
        self._solve()
        self._memo = {}

    # -- the fixed point over $ref targets --------------------------------------------------------

    def _solve(self) -> None:
        pending, seen = [self.root], {id(self.root)}
        while pending:  # every $ref reachable from the root, each resolved once, each target walked once
            node = pending.pop()
            for ref in _refs_in(node):
                if ref not in self._targets:
                    target = resolve(self.root, ref)
                    self._targets[ref] = target
                    if target is not None and id(target) not in seen:
                        seen.add(id(target))
                        pending.append(target)
        for _ in range(_MAX_ROUNDS):
            # Each round reads the table as the last one left it (and writes it after), so a node's size
            # is memoized within the round: a round is linear in the schema, however many refs alias a node.
            self._memo = {}
            # A ref this document cannot resolve (an external URL) is llguidance's to refuse; here it costs
            # what any value costs.
            sizes = {ref: self.size(target) if target is not None else 1 for ref, target in self._targets.items()}
            better = {ref: size for ref, size in sizes.items() if size < self._refs.get(ref, INF)}
            self._refs.update(better)
            if not better:
                return
        self.converged = False

    def unresolved(self) -> list[str]:
        """The `$ref`s with no finite instance: the recursion with no way out (or a ref to nothing)."""
        return sorted(ref for ref in self._targets if self._refs.get(ref, INF) == INF)

    def _pick(self, sizes: list[float]) -> float:
        """The size of a choice (anyOf branches, enum values, types): the cheapest, or with worst_choice
        the costliest finite one."""
        if not self.worst_choice:
            return min(sizes, default=INF)
        return max((x for x in sizes if x != INF), default=INF)

    # -- one subschema, refs read from the table --------------------------------------------------

    def size(self, node: Any) -> float:
        if not isinstance(node, dict):
            return self._size(node)
        # Keyed by id, holding the node: a node made by a caller (an allOf of merged parts) stays alive
        # while its entry does, so its id is never reused for another.
        hit = self._memo.get(id(node))
        if hit is None:
            hit = self._memo[id(node)] = (node, self._size(node))
        return hit[1]

    def _size(self, node: Any) -> float:
        if node is True or node == {}:
            return 1  # any value: `0`
        if node is False or not isinstance(node, dict):
            return INF if node is False else 1
        # A value's text is written by the model, a piece at a time (while closing, the shortest pieces
        # win): its bytes count as free characters. Keys are literals: the grammar forces them whole.
        if "const" in node:
            return self.unit.chars(_json_len(node["const"]))
        if isinstance(node.get("enum"), list):
            return self._pick([self.unit.chars(_json_len(v)) for v in node["enum"]])
        best = self._own(node)
        ref = node.get("$ref")
        if isinstance(ref, str):
            best = max(best, self._refs.get(ref, INF))  # the ref and the siblings must both hold
        for key in ("allOf",):
            parts = node.get(key)
            if isinstance(parts, list):
                for part in parts:
                    best = max(best, self.size(part))
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and branches:
                best = max(best, self._pick([self.size(b) for b in branches]))
        return best

    def _own(self, node: dict) -> float:
        """The node's own keywords (types and their counts), without allOf/anyOf/oneOf/$ref."""
        types = node.get("type")
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list) or not types:
            types = implied_types(node)
            if not types:
                return 1
        return self._pick([self._typed(node, t) for t in types if isinstance(t, str)])

    def _typed(self, node: dict, kind: str) -> float:
        if kind == "string":
            return 2 + self.unit.chars(min_string_chars(node))
        if kind == "array":
            return self._array(node)
        if kind == "object":
            return self._object(node)
        if kind in ("integer", "number"):
            low = node.get("minimum", node.get("exclusiveMinimum"))
            if isinstance(low, int | float) and not isinstance(low, bool) and low > 9:
                return self.unit.chars(len(str(int(min(low, 1e300)))))
            return 1
        return self.unit.chars(_TYPE_MIN[kind]) if kind in _TYPE_MIN else INF

    def _array(self, node: dict) -> float:
        total = 2.0
        for i in range(max(_count(node, "minItems"), 0)):
            item = item_schema(node, i)
            total += self.size(True if item is None else item) + (1 if i else 0)
            if total == INF:
                return INF
        return total

    def _object(self, node: dict) -> float:
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = [k for k in node["required"] if isinstance(k, str)] if isinstance(node.get("required"), list) else []
        total = 2.0
        for i, key in enumerate(dict.fromkeys(required)):
            sub = props.get(key)
            if sub is None and self.match_patterns:
                sub = _pattern_schema(node, key)
            value = self.size(sub if sub is not None else node.get("additionalProperties", True))
            total += self.unit.key(key) + 1 + value + (1 if i else 0)
            if total == INF:
                return INF
        extra = _count(node, "minProperties") - len(set(required))
        if extra > 0:  # the cheapest other properties (declared ones first, else any key)
            optional = sorted(self.unit.key(k) + 1 + self.size(s) for k, s in props.items() if k not in required)
            costs = optional[:extra]
            if len(costs) < extra:  # then keys of a patternProperties pattern, or any key
                patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
                fresh = [
                    3 + self.unit.chars(max(1, pattern_min_chars(p))) + self.size(sub) for p, sub in patterns.items()
                ]
                fresh.append(3 + self.unit.chars(1) + self.size(node.get("additionalProperties", True)))
                costs += [min(fresh)] * (extra - len(costs))
            total += sum(costs) + extra
        return total


def resolve(root: Any, ref: str) -> Any:
    """A local `$ref` (`#`, `#/a/b`, with ~0/~1 and %-escapes) in `root`; None for anything else."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), part)
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def min_string_chars(node: dict) -> int:
    """The fewest characters a string matching `node` has: its minLength, its pattern's shortest match,
    its format's shortest value (no regex is run: the pattern is only parsed)."""
    chars = _count(node, "minLength")
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        chars = max(chars, pattern_min_chars(pattern))
    fmt = node.get("format")
    return max(chars, _FORMAT_MIN.get(fmt, 2) - 2 if isinstance(fmt, str) else 0)


@functools.lru_cache(maxsize=1024)
def pattern_min_chars(pattern: str) -> int:
    """The fewest characters a match of `pattern` has (Python's regex parser; 0 if it cannot read it).
    JSON schema patterns are not anchored: a match is a substring, so this is the match's own length."""
    try:
        import re._parser as sre_parse  # 3.11+
    except ImportError:  # 3.10
        import sre_parse  # type: ignore[no-redef]
    try:
        low = sre_parse.parse(pattern).getwidth()[0]
    except Exception:  # noqa: BLE001 - an ECMA-only construct, or a pattern too large: no bound
        return 0
    return int(min(low, 1 << 30))


def _refs_in(node: Any) -> list[str]:
    out: list[str] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            for key, value in n.items():
                if key == "$ref" and isinstance(value, str):
                    out.append(value)
                elif key not in ("enum", "const", "default", "examples") and isinstance(value, dict | list):
                    stack.append(value)
        elif isinstance(n, list):
            stack.extend(n)
    return out


def item_schema(node: dict, index: int) -> Any:
    """The schema of item `index` of an array schema: its prefixItems entry (or the draft-04..2019
    tuple form's `items` entry), else the schema of the rest (`items`, or `additionalItems` after a
    tuple); None where the schema does not say."""
    prefix = node.get("prefixItems")
    rest = node.get("items")
    if not isinstance(prefix, list):
        prefix = rest if isinstance(rest, list) else []
        rest = node.get("additionalItems") if isinstance(rest, list) else rest
    return prefix[index] if index < len(prefix) else rest


def implied_types(node: dict) -> list[str]:
    if any(k in node for k in ("properties", "required", "additionalProperties", "minProperties")):
        return ["object"]
    if any(k in node for k in ("items", "prefixItems", "minItems")):
        return ["array"]
    if any(k in node for k in ("minLength", "pattern", "format")):
        return ["string"]
    return []


def _pattern_schema(node: dict, key: str) -> Any:
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict):
        for pattern, sub in patterns.items():
            try:
                if re.search(pattern, key):
                    return sub
            except re.error:
                continue
    return None


def _count(node: dict, key: str) -> int:
    value = node.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return int(min(value, 1 << 30))
    return 0


def _json_len(value: Any) -> int:
    try:
        return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass"))
    except (TypeError, ValueError):
        return 1


def shortest_instance_bytes(schema: Any) -> tuple[float, list[str]]:
    """(bytes of the shortest instance, INF if none; the `$ref`s that have no finite instance)."""
    sizes = SchemaSize(schema)
    return sizes.size(schema), sizes.unresolved()

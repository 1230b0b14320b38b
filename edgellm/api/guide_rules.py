"""The rules for a request's output constraint: `response_format` and `guided_decoding`.

Only the shape is checked here (types, lone surrogates, nesting); whether a schema, pattern or grammar
compiles is llguidance's to say (`engine.guide_llguidance.grammar_for`, run by the service before the
request is accepted). Every rule raises InvalidRequest naming guided_decoding or response_format.
"""

from __future__ import annotations

from typing import Any

from edgellm import jsonsafe
from edgellm.api.display import kind_of, show, show_names
from edgellm.api.json_values import has_surrogate, json_problem
from edgellm.engine.types import GuideKind, GuideSpec
from edgellm.errors import InvalidRequest

# Schemas nest a few levels in practice; the bound keeps every later walk (json.dumps, llguidance) off
# Python's recursion limit.
MAX_SCHEMA_DEPTH = 64
GUIDE_KEYS = tuple(k.value for k in GuideKind)
_STRUCTURE_KEYS = ("begin", "schema", "end")


def normalize_response_format(value: Any) -> dict[str, Any] | None:
    """null | dict | JSON string of a dict -> None or {"type": "json_object", "schema"?: {...}}."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = jsonsafe.loads(value, lone_surrogates="keep", depth=1)
        except jsonsafe.JSONProblem as exc:
            if exc.kind == "syntax":  # "is not valid JSON: <what> (line, column)"
                what = exc.problem.removeprefix("is not valid JSON: ")
                raise InvalidRequest(
                    f"response_format is a string but not valid JSON: {what}", param="response_format"
                ) from None
            if exc.kind == "depth":
                raise InvalidRequest(
                    "response_format is a JSON string nested too deeply", param="response_format"
                ) from None
            where = jsonsafe.json_path(exc.parts, relative=True)
            raise InvalidRequest(f"response_format{where}: {exc.problem}", param="response_format") from None
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"response_format must be an object (dict) or a JSON string of one, got {kind_of(value)}",
            param="response_format",
        )
    rtype = value.get("type")
    if not isinstance(rtype, str):
        raise InvalidRequest("response_format.type is required and must be a string", param="response_format")
    if rtype not in ("json_object", "json_schema"):
        raise InvalidRequest(
            f"Unsupported response_format type {show(rtype)}. Supported: 'json_object', 'json_schema'.",
            param="response_format",
        )
    schema = value.get("schema")
    nested = value.get("json_schema")
    if schema is None and isinstance(nested, dict):
        schema = nested.get("schema")
    if rtype == "json_schema" and schema is None:
        raise InvalidRequest(
            "response_format of type 'json_schema' requires a schema (json_schema.schema or schema)",
            param="response_format",
        )
    if schema is None:
        return {"type": "json_object"}
    if not isinstance(schema, dict):
        raise InvalidRequest(
            f"response_format schema must be a JSON object (dict), got {kind_of(schema)}", param="response_format"
        )
    problem = json_problem(schema, "response_format schema", max_depth=MAX_SCHEMA_DEPTH)
    if problem:
        raise InvalidRequest(problem, param="response_format")
    strict = nested.get("strict") if isinstance(nested, dict) else value.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest("response_format json_schema.strict must be true or false", param="response_format")
    # strict: what the schema asks that generation cannot enforce is refused, not checked after
    return {"type": "json_object", "schema": schema, **({"strict": True} if strict else {})}


def guided_decoding(value: Any) -> GuideSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"guided_decoding must be an object with exactly one of {', '.join(GUIDE_KEYS)}", param="guided_decoding"
        )
    unknown = sorted(str(k) for k in value if k not in GUIDE_KEYS)
    if unknown:
        raise InvalidRequest(
            f"guided_decoding mode(s) {show_names(unknown)} not supported; use one of {', '.join(GUIDE_KEYS)}",
            param="guided_decoding",
        )
    set_keys = [k for k in GUIDE_KEYS if value.get(k) not in (None, False)]
    if len(set_keys) != 1:
        raise InvalidRequest(
            f"guided_decoding must set exactly one of {', '.join(GUIDE_KEYS)}; got {len(set_keys)}",
            param="guided_decoding",
        )
    kind = GuideKind(set_keys[0])
    spec = value[kind.value]
    if kind is GuideKind.JSON_OBJECT:
        if spec is not True and spec != {}:
            raise InvalidRequest(
                "guided_decoding.json_object must be true (any JSON object); use json_schema for a schema",
                param="guided_decoding",
            )
        return GuideSpec(kind)
    if kind is GuideKind.JSON_SCHEMA:
        if not isinstance(spec, dict):
            raise InvalidRequest("guided_decoding.json_schema must be a JSON schema object", param="guided_decoding")
        problem = json_problem(spec, "guided_decoding.json_schema", max_depth=MAX_SCHEMA_DEPTH)
        if problem:
            raise InvalidRequest(problem, param="guided_decoding")
    if kind is GuideKind.STRUCTURAL_TAG:
        spec = structural_tag(spec)
    if kind is GuideKind.CHOICE:
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise InvalidRequest(
                "guided_decoding.choice must be a non-empty list of non-empty strings", param="guided_decoding"
            )
        spec = list(spec)
        for i, choice in enumerate(spec):
            if has_surrogate(choice):
                raise InvalidRequest(
                    f"guided_decoding.choice[{i}] contains a lone surrogate (invalid UTF-16)", param="guided_decoding"
                )
    if kind in (GuideKind.REGEX, GuideKind.EBNF):
        if not isinstance(spec, str) or not spec.strip():
            raise InvalidRequest(f"guided_decoding.{kind.value} must be a non-empty string", param="guided_decoding")
        if has_surrogate(spec):
            raise InvalidRequest(
                f"guided_decoding.{kind.value} contains a lone surrogate (invalid UTF-16)", param="guided_decoding"
            )
    return GuideSpec(kind, spec)


def structural_tag(spec: Any) -> dict[str, Any]:
    """The form llguidance is given (engine/guide_llguidance.py): {"triggers": [non-empty str],
    "structures": [{"begin", "schema", "end"}]}, each begin starting with a trigger. vLLM's
    {"type": "structural_tag", ...} wrapper is taken off; any other key is refused (it would be ignored)."""
    where = "guided_decoding.structural_tag"

    def bad(message: str) -> InvalidRequest:
        return InvalidRequest(f"{where}{message}", param="guided_decoding")

    if not isinstance(spec, dict):
        raise bad(f" must be an object with triggers and structures, got {kind_of(spec)}")
    problem = json_problem(spec, where, max_depth=MAX_SCHEMA_DEPTH)
    if problem:
        raise InvalidRequest(problem, param="guided_decoding")
    if "type" in spec and spec["type"] != "structural_tag":
        raise bad(f'.type must be "structural_tag" when given, got {show(spec["type"])}')
    unknown = sorted(str(k) for k in spec if k not in ("type", "triggers", "structures"))
    if unknown:
        raise bad(f" has unknown key(s) {show_names(unknown)} (expected triggers and structures)")
    triggers, structures = spec.get("triggers"), spec.get("structures")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise bad(".triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise bad(".structures must be a non-empty list of {begin, schema, end} objects")
    out = []
    for i, st in enumerate(structures):
        at = f".structures[{i}]"
        if not isinstance(st, dict):
            raise bad(f"{at} must be an object with begin, schema and end, got {kind_of(st)}")
        extra = sorted(str(k) for k in st if k not in _STRUCTURE_KEYS)
        if extra:
            raise bad(f"{at} has unknown key(s) {show_names(extra)} (expected begin, schema and end)")
        if not isinstance(st.get("begin"), str) or not isinstance(st.get("end"), str):
            raise bad(f"{at}.begin and .end must be strings")
        if not isinstance(st.get("schema"), dict):
            raise bad(f"{at}.schema must be a JSON schema object")
        if not any(st["begin"].startswith(t) for t in triggers):
            raise bad(f"{at}.begin {show(st['begin'])} does not start with any of the triggers")
        out.append({k: st[k] for k in _STRUCTURE_KEYS})
    return {"triggers": list(triggers), "structures": out}

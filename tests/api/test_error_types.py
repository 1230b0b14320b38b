"""Errors as data: every ErrorType maps back to its class (and so its status), derived from the tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from edgellm.api.registry import Registry, RequestStatus
from edgellm.api.results import Outcome
from edgellm.errors import (
    Cancelled,
    EdgeLLMError,
    EngineError,
    ErrorType,
    GuideError,
    WaitTimeout,
    carriers,
    error_class,
    error_from,
)

ROOT = Path(__file__).resolve().parents[2] / "edgellm"

# The status each type answers with: the contract the README documents (400 ... 507).
STATUS = {
    ErrorType.INTERNAL: 500,
    ErrorType.INVALID_REQUEST: 400,
    ErrorType.INVALID_GUIDE: 400,
    ErrorType.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorType.INVALID_MEDIA: 400,
    ErrorType.LORA: 400,
    ErrorType.UNAUTHORIZED: 401,
    ErrorType.NOT_FOUND: 404,
    ErrorType.MODEL_NOT_FOUND: 404,
    ErrorType.PAYLOAD_TOO_LARGE: 413,
    ErrorType.MEDIA_TOO_LARGE: 413,
    ErrorType.RATE_LIMITED: 429,
    ErrorType.DEADLINE_UNMET: 429,
    ErrorType.GENERATION_FAILED: 422,
    ErrorType.ENGINE_UNAVAILABLE: 503,
    ErrorType.REGISTRY_ERROR: 503,
    ErrorType.INSUFFICIENT_STORAGE: 507,
    ErrorType.REGISTRY_LOCKED: 503,
    ErrorType.TIMEOUT: 504,
    ErrorType.ENGINE_ERROR: 500,
    ErrorType.CANCELLED: 500,
    ErrorType.REQUEST_TIMEOUT: 408,
    ErrorType.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorType.MISDIRECTED_REQUEST: 421,
    ErrorType.SETTINGS_ERROR: 500,
    ErrorType.RATIO1_NODE_ERROR: 500,
    ErrorType.INFER_INPUT: 400,
    ErrorType.SYNTH_INPUT: 400,
    ErrorType.BATCH_INPUT: 500,
    ErrorType.PULL_FAILED: 500,
}


def test_every_error_type_has_a_status_here():
    assert set(STATUS) == set(ErrorType)


@pytest.mark.parametrize("kind", list(ErrorType))
def test_each_error_type_maps_to_its_class_and_status(kind):
    cls = error_class(kind)
    assert cls.error_type is kind and cls.http_status == STATUS[kind]
    assert error_class(kind.value) is cls  # as a string (a registry row, a Ratio1 answer) too
    assert cls.__module__ == "edgellm.errors"  # the whole tree is in the ground floor: no import to find it
    # Every other class carrying the type is a subclass of it, or answers the same status.
    assert all(issubclass(c, cls) or c.http_status == cls.http_status for c in carriers(kind))
    exc = error_from(kind, "why", request_id="r1")
    assert isinstance(exc, cls) and exc.request_id == "r1"
    assert exc.to_body()["error_type"] == kind.value and type(exc.to_body()["error_type"]) is str
    assert exc.to_body()["status_code"] == STATUS[kind]


def test_a_class_with_an_unknown_type_cannot_be_defined():
    with pytest.raises(ValueError):

        class Stray(EdgeLLMError):  # noqa: F841 (defining it is the test)
            error_type = "no_such_type"


def test_unknown_or_missing_types_read_as_engine_errors():
    assert ErrorType.of(None) is None
    assert ErrorType.of("a type an older node wrote") is ErrorType.ENGINE_ERROR
    assert error_class(None) is EngineError and error_class("gone") is EngineError


def _error_classes_in_source() -> list[tuple[str, str, str]]:
    """(module, class, the error_type it sets) for every class in edgellm/ that sets one."""
    found = []
    for path in ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for stmt in node.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
                if any(isinstance(t, ast.Name) and t.id == "error_type" for t in targets) and stmt.value is not None:
                    value = stmt.value
                    kind = value.value if isinstance(value, ast.Constant) else getattr(value, "attr", "").lower()
                    if kind is not None:  # a dataclass field that may carry a type (None by default)
                        found.append((module, node.name, kind))
    return found


def test_every_error_class_is_in_the_ground_floor():
    """The whole tree in edgellm/errors.py: an error that arrives as data finds its class there, without
    importing the part that raised it (no import by string, none upward)."""
    classes = _error_classes_in_source()
    assert len(classes) >= len(ErrorType) - 1  # the root carries `internal`
    for module, name, kind in classes:
        ErrorType(kind)
        assert module == "edgellm.errors", (module, name)


def test_outcomes_raise_the_class_of_their_type():
    with pytest.raises(GuideError):  # was InvalidRequest with error_type invalid_request
        Outcome("r", RequestStatus.FAILED, None, "bad schema", "invalid_guide").result_or_raise()
    with pytest.raises(Cancelled) as info:  # was a 500 with error_type engine_error
        Outcome("r", RequestStatus.FAILED, None, "request cancelled", ErrorType.CANCELLED).result_or_raise()
    assert info.value.http_status == 500 and info.value.to_body()["error_type"] == "cancelled"
    with pytest.raises(WaitTimeout):
        Outcome("r", RequestStatus.TIMEOUT, None, "late", ErrorType.TIMEOUT).result_or_raise()
    with pytest.raises(EngineError):  # a type a peer of another version sent
        Outcome("r", RequestStatus.FAILED, None, "?", "brand_new_type").result_or_raise()
    assert Outcome("r", RequestStatus.FAILED, None, "?", "brand_new_type").error_type is ErrorType.ENGINE_ERROR


def test_a_row_with_an_unknown_error_type_reads_back_as_engine_error(tmp_path):
    registry = Registry(tmp_path / "r.sqlite3", ttl_s=60)
    registry.insert("old", "async", {}, {}, 1)
    registry.finish("old", RequestStatus.FAILED, None, "failed long ago", "a_type_of_an_older_version")
    registry.insert("new", "async", {}, {}, 1)
    registry.finish("new", RequestStatus.FAILED, None, "grammar", ErrorType.GENERATION_FAILED)
    assert registry.get("old").error_type is ErrorType.ENGINE_ERROR
    assert registry.get("new").error_type is ErrorType.GENERATION_FAILED
    registry.close()

"""`edgellm synth` input errors: exit 2 with one line on stderr, never a traceback, nothing sent."""

from __future__ import annotations

import json

import pytest

from edgellm.cli import main
from edgellm.synth.journal import journal_path, open_output
from edgellm.synth.schema import schema_hash
from tests.nodeproc import free_port

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


def run(capsys, *argv) -> tuple[int, str]:
    try:
        rc = main(["synth", *argv])
    except SystemExit as exc:  # argparse's own usage errors
        rc = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


@pytest.fixture
def schema_file(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(json.dumps(SCHEMA))
    return p


# A port nobody listens on: any request would fail (exit 1), so exit 2 proves nothing was sent.
def base(tmp_path, schema):
    return ["--schema", str(schema), "-o", str(tmp_path / "o.jsonl"), "--endpoint", f"http://127.0.0.1:{free_port()}"]


@pytest.mark.parametrize(
    ("content", "extra", "needle"),
    [
        (None, ["--count", "5"], "no such file"),
        ("{", ["--count", "5"], "not valid JSON"),
        ('{"type": "nope"}', ["--count", "5"], "not a valid JSON schema"),
        ('"just a string"', ["--count", "5"], "a JSON schema object is required"),
        (json.dumps(SCHEMA), ["--count", "0"], "count must be an integer >= 1"),
        (json.dumps(SCHEMA), ["--count", "-3"], "count must be an integer >= 1"),
        (json.dumps(SCHEMA), ["--count", "5", "--temperature", "9"], "temperature must be in [0, 1.5]"),
        (json.dumps(SCHEMA), ["--count", "5", "--concurrency", "0"], "concurrency must be in"),
        (json.dumps(SCHEMA), ["--count", "5", "--max-tokens", "1"], "max_tokens must be in"),
        (json.dumps(SCHEMA), ["--count", "abc"], "invalid int value"),
    ],
)
def test_bad_input_exits_2(capsys, tmp_path, content, extra, needle):
    schema = tmp_path / "given.json"
    if content is not None:
        schema.write_text(content)
    rc, err = run(capsys, *base(tmp_path, schema), *extra, "-q")
    assert rc == 2 and needle in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_an_output_of_another_schema_or_not_ours_exits_2(capsys, tmp_path, schema_file):
    out = tmp_path / "o.jsonl"
    open_output(out, schema_hash({**SCHEMA, "required": []})).close()
    rc, err = run(capsys, *base(tmp_path, schema_file), "--count", "1", "-q")
    assert rc == 2 and "different schema" in err
    journal_path(out).unlink()
    out.write_text('{"a": "mine"}\n')
    rc, err = run(capsys, *base(tmp_path, schema_file), "--count", "1", "-q")
    assert rc == 2 and "has no journal" in err
    assert out.read_text() == '{"a": "mine"}\n'


def test_a_duplicate_key_in_the_schema_exits_2_naming_it(capsys, tmp_path):
    """One strict reader for every CLI (issue 20): the schema file's duplicate key is refused, named."""
    schema = tmp_path / "dup.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "string", "type": "integer"}}}')
    rc, err = run(capsys, *base(tmp_path, schema), "--count", "1", "-q")
    assert rc == 2 and 'duplicate key "type"' in err and "properties.a" in err, err
    assert not (tmp_path / "o.jsonl").exists()

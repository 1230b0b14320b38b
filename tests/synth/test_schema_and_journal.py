"""The generator's parts that need no node: schema checks, prompt, answer parsing, seeds, the journal."""

from __future__ import annotations

import json

import pytest

from edgellm.synth.generator import SynthOptions, answer_text, closed_early, record_seed
from edgellm.synth.journal import journal_path, open_output
from edgellm.synth.schema import (
    RecordChecker,
    SynthInputError,
    canonical,
    load_schema,
    render_prompt,
    schema_hash,
)

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _write(tmp_path, text: str | bytes, name: str = "s.json"):
    p = tmp_path / name
    p.write_bytes(text.encode() if isinstance(text, str) else text)
    return p


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "a JSON schema object is required"),
        ("true", "a JSON schema object is required"),
        ("{}", "the schema is empty"),
        ('{"type": 5}', "not a valid JSON schema"),
        ('{"type": "object", "minProperties": -1}', "not a valid JSON schema"),
        ('{"type": "object", "properties": {"a": {"maximum": NaN}}}', "NaN is not valid JSON"),
        ('{"type": "object", "type": "array"}', "duplicate key"),
        ('{"$ref": "https://example.com/s.json"}', "points outside the schema"),
        ('{"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}', "points outside the schema"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        ('{"type": "object", "description": "' + "x" * 300_000 + '"}', "KiB"),
    ],
)
def test_bad_schema_files_are_refused_with_a_message(tmp_path, content, needle):
    with pytest.raises(SynthInputError) as err:
        load_schema(_write(tmp_path, content))
    assert needle in err.value.message


def test_unreadable_schema_paths(tmp_path):
    with pytest.raises(SynthInputError, match="no such file"):
        load_schema(tmp_path / "missing.json")
    with pytest.raises(SynthInputError, match="is a directory"):
        load_schema(tmp_path)


def test_a_good_schema_loads_and_hashes_independently_of_key_order(tmp_path):
    schema = load_schema(_write(tmp_path, "\ufeff" + json.dumps(SCHEMA)))  # a BOM is not an error
    assert schema == SCHEMA
    assert schema_hash(schema) == schema_hash(dict(reversed(list(SCHEMA.items()))))
    assert schema_hash(schema) != schema_hash({**SCHEMA, "required": ["name"]})


def test_record_checker():
    checker = RecordChecker(SCHEMA)
    assert checker.check('{"name": "a", "age": 3}') == ({"name": "a", "age": 3}, None)
    for text, reason in [
        ('{"name": "a"}', "schema violation"),
        ('{"name": "a", "age": -1}', "schema violation at age"),
        ('{"name": "a", "age": 1, "x": 0}', "schema violation"),
        ('{"name": "a", "age": NaN}', "not valid JSON"),
        ('{"name": "a", "name": "b", "age": 1}', "duplicate key"),
        ('{"name": "a", "age": 1', "not valid JSON"),
        ("[" * 50_000, "not valid JSON"),
    ]:
        record, why = checker.check(text)
        assert record is None and reason in why, (text[:40], why)
    dated = RecordChecker({"type": "object", "properties": {"d": {"type": "string", "format": "date"}}})
    assert dated.check('{"d": "2024-02-30"}')[0] is None  # formats are checked where jsonschema can
    assert dated.check('{"d": "2024-02-28"}')[0] == {"d": "2024-02-28"}


def test_prompt_placeholders_are_replaced_literally():
    default = render_prompt(None, SCHEMA, 0)
    assert "#1" in default and "name (string)" in default and "age (integer)" in default
    custom = render_prompt('Record {index} of {"json": braces} with {fields}; {unknown}', SCHEMA, 41)
    assert custom.startswith('Record 42 of {"json": braces} with name (string)') and "{unknown}" in custom
    assert json.loads(render_prompt("{schema}", SCHEMA, 0)) == SCHEMA


def test_record_seeds_are_stable_distinct_and_in_range():
    seeds = [record_seed(7, i) for i in range(2000)]
    assert seeds == [record_seed(7, i) for i in range(2000)]
    assert len(set(seeds)) == 2000 and all(0 <= s < 2**63 for s in seeds)
    assert record_seed(8, 0) != record_seed(7, 0)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"result": {"TEXT_RESPONSE": ["{}"], "FULL_OUTPUT": []}, "ee_node_address": "x"}, ("{}", None)),
        ({"REQUEST_ID": "r", "TEXT_RESPONSE": ["{}"]}, ("{}", None)),  # RAW
        ({"result": {"TEXT_RESPONSE": "{}"}}, ("{}", None)),  # a plain string
        ({"result": {"text": "{}"}}, ("{}", None)),
        ({"result": {"FULL_OUTPUT": [{"choices": [{"message": {"content": "{}"}}]}]}}, ("{}", None)),
        ({"choices": [{"message": {"content": "{}"}}]}, ("{}", None)),  # OpenAI shape
        ({"result": {"error": "boom", "status_code": 500}}, (None, "boom")),  # an error inside a 200
        ({"result": {}}, (None, "the answer holds no text (TEXT_RESPONSE / choices[0].message.content)")),
        ([1], (None, "unexpected answer (list)")),
    ],
)
def test_answer_text_understands_wrapped_and_raw(body, expected):
    assert answer_text(body) == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"result": {"FULL_OUTPUT": [{"truncated_structure": True}]}}, True),  # WRAPPED seed answer
        ({"FULL_OUTPUT": [{"choices": []}]}, False),
        ({"choices": [], "truncated_structure": True}, True),  # an OpenAI body
        ("not json", False),
    ],
)
def test_a_record_closed_early_to_fit_max_tokens_is_not_kept(body, expected):
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    assert closed_early(raw) is expected


@pytest.mark.parametrize(
    "kw",
    [
        {"count": 0},
        {"count": True},
        {"count": 1, "concurrency": 0},
        {"count": 1, "concurrency": 1000},
        {"count": 1, "temperature": 2.0},
        {"count": 1, "max_tokens": 8},
        {"count": 1, "seed": -1},
        {"count": 1, "endpoint": "ftp://x"},
        {"count": 1, "max_attempts": 0},
    ],
)
def test_bad_options_are_refused(kw):
    with pytest.raises(SynthInputError):
        SynthOptions(**kw).check()


def _state(tmp_path, schema=SCHEMA):
    return open_output(tmp_path / "out.jsonl", schema_hash(schema))


def test_journal_resumes_counts_and_cuts_torn_lines(tmp_path):
    out = tmp_path / "out.jsonl"
    state = _state(tmp_path)
    state.append(0, "valid", {"name": "a", "age": 1})
    state.append(1, "invalid")
    state.append(2, "duplicate")
    state.append(3, "valid", {"name": "b", "age": 2})
    state.close()
    with open(out, "a") as fh:  # a crash in the middle of writing the next record
        fh.write('{"name": "c", "ag')
    with open(journal_path(out), "a") as fh:
        fh.write('{"i": 4, "o"')
    state = _state(tmp_path)
    assert (state.valid, state.next_index) == (2, 4)
    assert state.seen == {canonical({"name": "a", "age": 1}), canonical({"age": 2, "name": "b"})}
    state.append(4, "valid", {"name": "c", "age": 3})
    state.close()
    assert [json.loads(line)["name"] for line in out.read_text().splitlines()] == ["a", "b", "c"]


def test_journal_refuses_another_schema_a_foreign_file_and_a_second_writer(tmp_path):
    _state(tmp_path).close()
    with pytest.raises(SynthInputError, match="different schema"):
        _state(tmp_path, {**SCHEMA, "required": ["name"]})
    first = _state(tmp_path)
    with pytest.raises(SynthInputError, match="another `edgellm synth` run"):
        _state(tmp_path)
    first.close()
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"x": 1}\n')
    with pytest.raises(SynthInputError, match="has no journal"):
        open_output(foreign, schema_hash(SCHEMA))
    assert foreign.read_text() == '{"x": 1}\n'  # untouched


def test_journal_refuses_an_edited_middle_line(tmp_path):
    state = _state(tmp_path)
    state.append(0, "valid", {"name": "a", "age": 1})
    state.append(1, "valid", {"name": "b", "age": 1})
    state.close()
    out = tmp_path / "out.jsonl"
    out.write_text("garbage\n" + out.read_text().splitlines()[1] + "\n")
    with pytest.raises(SynthInputError, match="line 1 is not valid JSON"):
        _state(tmp_path)


def test_a_missing_output_starts_over(tmp_path):
    state = _state(tmp_path)
    state.append(0, "valid", {"name": "a", "age": 1})
    state.close()
    (tmp_path / "out.jsonl").unlink()
    state = _state(tmp_path)
    assert (state.valid, state.next_index) == (0, 0)
    state.close()

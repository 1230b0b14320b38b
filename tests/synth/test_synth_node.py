"""`edgellm synth` and the generator against the real node (bundled model, one node for the module)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from edgellm.synth.generator import SynthOptions, generate
from edgellm.synth.schema import canonical
from tests.nodeproc import NodeProcess, free_port

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
MAX_QUEUED = 3  # small, so that the Retry-After test can overrun it; the other tests stay at or under it


@pytest.fixture(scope="module")
def synth_node(tmp_path_factory):
    proc = NodeProcess(tmp_path_factory.mktemp("synth-node"), "--max-queued", str(MAX_QUEUED)).start()
    yield proc
    proc.stop()


@pytest.fixture
def schema_file(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    return path


def synth(node, schema_file, out, count, *extra) -> tuple[int, dict | None, str]:
    cmd = [sys.executable, "-m", "edgellm", "synth", "--schema", str(schema_file), "--count", str(count)]
    cmd += ["-o", str(out), "--endpoint", node.base, "--concurrency", "3", "-q", "--summary-json", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1]) if proc.stdout.strip() else None
    return proc.returncode, summary, proc.stderr


def records(out) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_generates_count_valid_unique_records(synth_node, schema_file, tmp_path):
    out = tmp_path / "people.jsonl"
    rc, summary, err = synth(synth_node, schema_file, out, 20)
    assert rc == 0, err
    rows = records(out)
    assert len(rows) == 20
    for row in rows:
        jsonschema.validate(row, SCHEMA)
    assert len({canonical(r) for r in rows}) == 20
    assert summary["valid"] == summary["new_valid"] == 20 and summary["complete"]
    assert summary["attempts"] == 20 + summary["invalid"] + summary["duplicates"] + summary["failed"]
    assert summary["records_per_min"] > 0
    print(f"\nsynth: {summary['records_per_min']} valid records/min (bundled model, concurrency 3)")


def test_a_rerun_resumes_and_only_makes_the_missing_records(synth_node, schema_file, tmp_path):
    out = tmp_path / "resume.jsonl"
    rc, first, err = synth(synth_node, schema_file, out, 10)
    assert rc == 0 and first["new_valid"] == 10, err
    before = out.read_text()
    rc, second, err = synth(synth_node, schema_file, out, 20)
    assert rc == 0, err
    assert (second["valid"], second["new_valid"]) == (20, 10)
    assert out.read_text().startswith(before)  # the first ten are kept as they were
    rows = records(out)
    assert len(rows) == 20 and len({canonical(r) for r in rows}) == 20
    rc, third, err = synth(synth_node, schema_file, out, 20)  # nothing left to do: nothing is sent
    assert rc == 0 and third["attempts"] == 0 and third["new_valid"] == 0
    assert len(records(out)) == 20


def test_the_seed_decides_the_requests(synth_node, tmp_path):
    # The same seed sends the same requests (same prompts and per-record seeds); whether the node
    # answers them with the same bytes is the engine's business (a prefix-cache hit can move a
    # near-tie), so only the request side and "another seed, other records" are asserted here.
    from edgellm.synth.generator import _Client

    bodies = [_Client(SCHEMA, SynthOptions(count=3, seed=s)).body(i) for s in (5, 5, 6) for i in range(3)]
    assert bodies[0:3] == bodies[3:6] and bodies[0:3] != bodies[6:9]
    texts = []
    for seed in (5, 6):
        opts = SynthOptions(count=4, endpoint=synth_node.base, seed=seed, concurrency=1, max_tokens=96)
        assert generate(SCHEMA, tmp_path / f"{seed}.jsonl", opts).complete
        texts.append((tmp_path / f"{seed}.jsonl").read_text())
    assert texts[0] != texts[1]


def test_progress_callback_and_retry_after_on_a_full_node(synth_node, tmp_path):
    seen = []
    opts = SynthOptions(count=12, endpoint=synth_node.base, concurrency=2 * MAX_QUEUED, max_tokens=96)
    summary = generate(SCHEMA, tmp_path / "busy.jsonl", opts, on_progress=seen.append)
    assert summary.complete and summary.valid == 12, summary
    assert summary.retried > 0  # the node answered 429 + Retry-After and the requests were sent again
    assert [p.valid for p in seen] == sorted(p.valid for p in seen) and seen[-1].valid == 12
    assert len(records(tmp_path / "busy.jsonl")) == 12


def test_exit_1_when_the_attempts_run_out(synth_node, schema_file, tmp_path):
    out = tmp_path / "short.jsonl"
    rc, summary, err = synth(synth_node, schema_file, out, 5, "--max-attempts", "2")
    assert rc == 1, err
    assert summary["attempts"] == 2 and not summary["complete"] and len(records(out)) <= 2
    assert "attempts gave" in err


def test_exit_1_when_the_node_is_down(schema_file, tmp_path):
    dead = NodeProcess(tmp_path)  # never started: only its free port is used
    rc, summary, err = synth(dead, schema_file, tmp_path / "down.jsonl", 2, "--max-attempts", "1")
    assert rc == 1, err
    assert summary["failed"] == 1 and summary["retried"] == 3 and "ConnectionError" in err
    opts = SynthOptions(count=50, endpoint=f"http://127.0.0.1:{free_port()}", retries=0, concurrency=2)
    gave_up = generate(SCHEMA, tmp_path / "down2.jsonl", opts)
    assert gave_up.failed == 5 and "in a row failed" in gave_up.error  # stops, does not spend 150 attempts


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        # deeper than the node's schema depth limit: the node refuses, the run stops at once
        ({"type": "object", "properties": {"a": json.loads('{"type": "array", "items": ' * 70 + "{}" + "}" * 70)}},
         "the node refused"),
    ],
)  # fmt: skip
def test_exit_2_when_the_node_refuses_the_schema(synth_node, tmp_path, schema, needle):
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(schema))
    rc, summary, err = synth(synth_node, path, tmp_path / "hostile.jsonl", 3)
    assert rc == 2, err
    assert needle in err and summary["refused"] and summary["valid"] == 0


def test_the_plugin_bridge_runs_a_job_against_the_node(synth_node, tmp_path):
    from extensions.business.synthetic_data.synth_bridge import SynthJob

    config = {"SCHEMA": SCHEMA, "COUNT": 6, "API_PORT": synth_node.port, "CONCURRENCY": 2, "MAX_TOKENS": 96}
    job = SynthJob(config, tmp_path, "synth__SYNTHETIC_DATA_GENERATOR__demo").start()
    assert job.poll()["SYNTH_STATUS"] in ("waiting_for_api", "running")
    job._thread.join(120)
    final = job.poll()
    assert final["SYNTH_STATUS"] == "done" and final["SYNTH_VALID"] == 6, final
    rows = records(Path(final["SYNTH_OUTPUT_FILE"]))
    assert len(rows) == 6 and len({canonical(r) for r in rows}) == 6
    for row in rows:
        jsonschema.validate(row, SCHEMA)
    again = SynthJob(config, tmp_path, "synth__SYNTHETIC_DATA_GENERATOR__demo").start()  # a node restart
    again._thread.join(60)
    assert again.poll()["SYNTH_NEW_VALID"] == 0 and len(records(Path(final["SYNTH_OUTPUT_FILE"]))) == 6

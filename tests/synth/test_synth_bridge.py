"""The SYNTHETIC_DATA_GENERATOR plugin without naeural-core: its bridge, and its source against the
node's loader and code-safety rules (the node itself runs it in tests/ratio1/test_synth_plugin.py)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from edgellm.synth.generator import SynthProgress
from edgellm.synth.schema import SynthInputError
from extensions.business.synthetic_data.synth_bridge import SynthJob, options_from_config, output_path

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "plugins" / "business" / "synthetic_data" / "synthetic_data_generator.py"
SIGNATURE = "SYNTHETIC_DATA_GENERATOR"
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
# ratio1.code_cheker's UNALLOWED_DICT (names and attributes) and naeural_core's SAFE_BIZ_IMPORTS.
FORBIDDEN_NAMES = {"open", "eval", "exec", "getattr", "dir", "vars", "globals", "locals", "memoryview", "__builtins__"}
FORBIDDEN_ATTRS = {"log", "global_shmem", "plugins_shmem", "config_data", "_default_config", "_upstream_config",
                   "__traceback__"}  # fmt: skip
SAFE_IMPORTS = ("naeural_core.business", "extensions.business")


def test_plugin_source_follows_the_loader_and_code_safety_rules():
    tree = ast.parse(PLUGIN.read_text())
    assert PLUGIN.stem == SIGNATURE.lower()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert all(any(s in a.name for s in SAFE_IMPORTS) for a in node.names), ast.dump(node)
        elif isinstance(node, ast.ImportFrom):
            assert any(s in (node.module or "") for s in SAFE_IMPORTS), node.module
        elif isinstance(node, ast.Name):
            assert node.id not in FORBIDDEN_NAMES, f"line {node.lineno}: {node.id}"
        elif isinstance(node, ast.Attribute):
            assert node.attr not in FORBIDDEN_ATTRS, f"line {node.lineno}: .{node.attr}"
    top = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert {"_CONFIG", "__VER__"} <= top
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    assert cls.name.lower() == SIGNATURE.replace("_", "").lower() + "plugin"
    assert any(isinstance(n, ast.Assign) and n.targets[0].id == "CONFIG" and n.value.id == "_CONFIG" for n in cls.body)
    # every bridge config key is read from the plugin config (cfg_<key>)
    from extensions.business.synthetic_data.synth_bridge import PLUGIN_DEFAULTS

    read = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and n.attr.startswith("cfg_")}
    assert read == {"cfg_" + k.lower() for k in PLUGIN_DEFAULTS}


def test_config_is_checked_and_names_the_key():
    schema, opts = options_from_config({"SCHEMA": json.dumps(SCHEMA), "API_PORT": 9000, "COUNT": 3, "seed": 4})
    assert schema == SCHEMA and opts.endpoint == "http://127.0.0.1:9000" and (opts.count, opts.seed) == (3, 4)
    for config, needle in [
        ({}, "SCHEMA is required"),
        ({"SCHEMA": "{"}, "SCHEMA is a string but not JSON"),
        ({"SCHEMA": {"type": 7}}, "SCHEMA: not a valid JSON schema"),
        ({"SCHEMA": SCHEMA, "API_PORT": "x"}, "API_PORT must be a port number"),
        ({"SCHEMA": SCHEMA, "COUNT": 0}, "COUNT: count must be"),
        ({"SCHEMA": SCHEMA, "TEMPERATURE": 3}, "TEMPERATURE: temperature must be"),
    ]:
        with pytest.raises(SynthInputError) as err:
            options_from_config(config)
        assert needle in err.value.message, err.value.message


def test_output_path_stays_in_the_output_folder(tmp_path):
    assert (
        output_path(tmp_path, "pipe__SYNTHETIC_DATA_GENERATOR__a/b")
        == (tmp_path / "synthetic_data" / "pipe__SYNTHETIC_DATA_GENERATOR__a_b.jsonl").resolve()
    )
    assert output_path(tmp_path, "x", "sub/people.jsonl").parent.name == "sub"
    for bad in ("../escape.jsonl", "/etc/passwd"):
        with pytest.raises(SynthInputError, match="must stay inside"):
            output_path(tmp_path, "x", bad)


def test_a_config_error_is_reported_not_raised(tmp_path):
    job = SynthJob({"SCHEMA": None}, tmp_path, "p").start()
    fields = job.poll()
    assert fields["SYNTH_STATUS"] == "config_error" and "SCHEMA is required" in fields["SYNTH_ERROR"]
    assert job.finished and job.poll() is None  # said once
    job.stop()


def test_poll_reports_state_changes_at_once_and_progress_at_most_every_interval(tmp_path):
    job = SynthJob({"SCHEMA": SCHEMA, "COUNT": 5, "PROGRESS_INTERVAL": 10}, tmp_path, "p")
    job.state = "running"  # driven by hand: no thread, no node
    assert job.poll(now=100.0)["SYNTH_STATUS"] == "running"
    job._on_progress(SynthProgress(5, 1, 1, 0, 0, 0, 1, 2.0))
    assert job.poll(now=101.0) is None  # new progress, but within the interval
    fields = job.poll(now=111.0)
    assert (fields["SYNTH_VALID"], fields["SYNTH_COUNT"], fields["SYNTH_RECORDS_PER_MIN"]) == (1, 5, 30.0)
    assert job.poll(now=130.0) is None  # nothing new
    job.state = "done"
    assert job.poll(now=130.5)["SYNTH_STATUS"] == "done"


def test_a_dead_endpoint_ends_in_failed_with_the_reason(tmp_path):
    from tests.nodeproc import free_port

    config = {"SCHEMA": SCHEMA, "COUNT": 2, "API_PORT": free_port(), "API_WAIT": 2}
    job = SynthJob(config, tmp_path, "p").start()
    assert job.poll()["SYNTH_STATUS"] == "waiting_for_api"
    job._thread.join(30)
    fields = job.poll()
    assert fields["SYNTH_STATUS"] == "failed" and "did not answer 200 within 2 s" in fields["SYNTH_ERROR"]
    assert Path(fields["SYNTH_OUTPUT_FILE"]).parent == (tmp_path / "synthetic_data").resolve()
    stopped = SynthJob({**config, "API_WAIT": 60}, tmp_path, "p").start()
    stopped.stop()  # the node closing the plugin ends the wait at once
    assert stopped.state == "stopped"

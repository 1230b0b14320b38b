#!/usr/bin/env bash
# The llama-cpp-python build for this machine: flags chosen for the host, built once, kept by its flags.
#
#   tools/engine_wheel.sh --print-flags      # DEVICE, CUDA_ARCH, CMAKE_ARGS, CUDACXX, KEY (what would be built)
#   tools/engine_wheel.sh --wheel [PYTHON]   # the wheel's path, building it first when there is none
#   tools/engine_wheel.sh --install VENV     # puts that build into VENV (skipped when VENV has it already)
#   tools/engine_wheel.sh --print-version    # the llama-cpp-python version (pyproject.toml's pin)
#
# Flags (CMAKE_ARGS handed to llama-cpp-python's CMake build):
#   Jetson (/proc/device-tree/model, /etc/nv_tegra_release)  -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=<board>
#   NVIDIA GPU with nvcc                                      -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native
#   x86_64 (with or without a GPU)                            + the AMX kernels off: -mno-amx-tile -mno-amx-int8
#       -mno-amx-bf16 in CMAKE_C_FLAGS and CMAKE_CXX_FLAGS. llama.cpp's AMX matmul segfaults on the first
#       prompt (upstream issue 20824); everything else -march=native turns on (AVX2, AVX-512, VNNI) stays.
#   anything else                                             llama.cpp's default (native CPU build)
# EDGELLM_LLAMA_CMAKE_ARGS, when set, replaces the chosen flags (set it to "" for llama.cpp's own default,
# e.g. to turn AMX back on once upstream fixes it).
#
# The build is identified by KEY = sha256(llama-cpp-python version, architecture, CMAKE_ARGS, the patch, for a native
# build the CPU's ISA flags from /proc/cpuinfo, for a CUDA "native" build the GPU's compute capability and
# nvcc's version): a wheel made with other flags, or for another CPU or GPU, is never reused.
# Wheels live in ${EDGELLM_WHEEL_ROOT:-$HOME/.cache/edgellm/wheels}/llama-cpp-python-<version>-<KEY>/, built
# with pip's cache off (pip's wheel cache is keyed by the sdist only, so it would hand back a build made
# with any flags) in a temporary folder that is renamed into place only once complete; concurrent callers
# wait for each other (flock). --install records the build in VENV/edgellm-engine-build.json, which
# `edgellm doctor` prints.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The one pin of llama-cpp-python is pyproject.toml's.
LLAMA_CPP_VERSION="$(sed -n 's/.*"llama-cpp-python==\([0-9][0-9.]*\)".*/\1/p' "$REPO/pyproject.toml")"
[ -n "$LLAMA_CPP_VERSION" ] || { echo "engine_wheel: no llama-cpp-python==X pin in $REPO/pyproject.toml" >&2; exit 2; }
DT_MODEL_FILE="${EDGELLM_DT_MODEL_FILE:-/proc/device-tree/model}"
TEGRA_RELEASE_FILE="${EDGELLM_TEGRA_RELEASE_FILE:-/etc/nv_tegra_release}"
CPUINFO_FILE="${EDGELLM_CPUINFO_FILE:-/proc/cpuinfo}"
MACHINE="${EDGELLM_MACHINE:-$(uname -m)}"   # tests fake another architecture with it
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
WHEEL_ROOT="${EDGELLM_WHEEL_ROOT:-$HOME/.cache/edgellm/wheels}"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# edgellm's changes to the vendored llama.cpp (applied to the sdist before building; part of KEY):
# in-order KV placement in a unified cache and a batch-invariant CPU flash-attention kernel (the patch says why).
PATCH="$REPO/tools/llama_cpp/edgellm.patch"

log() { echo "engine_wheel: $*" >&2; }
die() { log "$*"; exit 2; }

thor_arch() {   # Jetson Thor: sm_110 for CUDA 13 (JetPack 7); the CUDA 12.8/12.9 previews called it sm_101
    if "${CUDA_HOME}/bin/nvcc" --version 2>/dev/null | grep -q "release 12\."; then echo 101; else echo 110; fi
}

cuda_arch() {   # the Jetson board's CUDA architecture; nothing off a Jetson
    local model="" release=""
    [ -r "$DT_MODEL_FILE" ] && model="$(tr -d '\0' < "$DT_MODEL_FILE")"
    case "$model" in
        *Thor*) thor_arch; return ;;
        *Orin*) echo 87; return ;;
        *Xavier*) echo 72; return ;;
        *TX2*) echo 62; return ;;
        *Nano*|*TX1*) echo 53; return ;;
    esac
    [ -r "$TEGRA_RELEASE_FILE" ] && release="$(cat "$TEGRA_RELEASE_FILE")"
    case "$release" in
        *t264*|*"R38 "*) thor_arch ;;   # JetPack 7.0 (L4T R38) is Thor's; an Orin on R38 names itself above
        *t234*|*"R36 "*) echo 87 ;;
        *t194*) echo 72 ;;
        *t186*) echo 62 ;;
        *t210*) echo 53 ;;
        *) [ -n "$release" ] && echo 87 ;;   # an unknown L4T release: JetPack 5/6 boards are Orin-class
    esac
    return 0
}

choose_flags() {   # sets DEVICE, CUDA_ARCH, CMAKE_ARGS, CUDACXX, KEY
    local arch; arch="$(cuda_arch)"
    CMAKE_ARGS=""; CUDACXX=""
    if [ -n "$arch" ]; then
        DEVICE="jetson"
        CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${arch}"
        CUDACXX="${CUDA_HOME}/bin/nvcc"
    elif command -v nvidia-smi >/dev/null 2>&1 && { [ -x "${CUDA_HOME}/bin/nvcc" ] || command -v nvcc >/dev/null 2>&1; }; then
        DEVICE="nvidia-gpu"; arch="native"
        CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native"
        CUDACXX="$( [ -x "${CUDA_HOME}/bin/nvcc" ] && echo "${CUDA_HOME}/bin/nvcc" || command -v nvcc)"
    else
        DEVICE="cpu"
    fi
    case "$MACHINE" in
        x86_64|amd64|i686)
            CMAKE_ARGS="${CMAKE_ARGS:+$CMAKE_ARGS }-DCMAKE_C_FLAGS='${NO_AMX}' -DCMAKE_CXX_FLAGS='${NO_AMX}'" ;;
    esac
    if [ -n "${EDGELLM_LLAMA_CMAKE_ARGS+set}" ]; then CMAKE_ARGS="$EDGELLM_LLAMA_CMAKE_ARGS"; fi
    CUDA_ARCH="$arch"
    local cpu=""
    case "$CMAKE_ARGS" in
        *GGML_NATIVE=OFF*|*GGML_NATIVE=off*) ;;
        *)  # -march=native: the build is only good for this ISA. No flags line (riscv, some containers):
            # the whole cpuinfo minus what changes while running (MHz, bogomips) names the CPU instead.
            cpu="$({ grep -m1 -E '^(flags|Features)' "$CPUINFO_FILE" 2>/dev/null || true; } | cut -d: -f2 \
                   | tr ' ' '\n' | sort -u | tr '\n' ' ')"
            if [ -z "${cpu// /}" ]; then
                cpu="$({ grep -v -i -E 'mhz|bogomips' "$CPUINFO_FILE" 2>/dev/null || true; } | sort -u | sha256sum)"
            fi ;;
    esac
    # A CUDA build for "native" is only good for this GPU and this CUDA toolkit.
    local gpu=""
    if [ "$CUDA_ARCH" = "native" ]; then
        gpu="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | sort -u | tr '\n' ' ' || true)"
        gpu="$gpu $("$CUDACXX" --version 2>/dev/null | tail -n 1 || true)"
    fi
    KEY="$({ printf '%s\n%s\n%s\n%s\n' "$LLAMA_CPP_VERSION" "$MACHINE" "$CMAKE_ARGS" "$cpu"
             [ -z "$gpu" ] || printf '%s\n' "$gpu"
             cat "$PATCH"; } | sha256sum | cut -c1-16)"
}

print_flags() {
    echo "DEVICE=${DEVICE}"
    echo "CUDA_ARCH=${CUDA_ARCH}"
    echo "CMAKE_ARGS=${CMAKE_ARGS}"
    echo "CUDACXX=${CUDACXX}"
    echo "KEY=${KEY}"
}

wheel_dir() { echo "${WHEEL_ROOT}/llama-cpp-python-${LLAMA_CPP_VERSION}-${KEY}"; }

find_wheel() { ls "$(wheel_dir)"/llama_cpp_python-"${LLAMA_CPP_VERSION}"-*.whl 2>/dev/null | head -n 1; }

build_wheel() {   # build_wheel PYTHON: prints the wheel's path
    local python="$1" dir; dir="$(wheel_dir)"
    mkdir -p "$WHEEL_ROOT"
    exec 9>"$WHEEL_ROOT/.build.lock"
    flock 9
    if [ -f "$dir/.complete" ] && [ -n "$(find_wheel)" ]; then find_wheel; return 0; fi
    rm -rf "$dir"
    local tmp; tmp="$(mktemp -d "$WHEEL_ROOT/.building-${KEY}.XXXXXX")"
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" EXIT
    local start; start=$(date +%s)
    log "building llama-cpp-python ${LLAMA_CPP_VERSION} for ${DEVICE} with CMAKE_ARGS=${CMAKE_ARGS:-<llama.cpp default>}"
    log "(about 10 minutes on 2 cores, 10-40 on a Jetson; kept in ${dir})"
    [ -z "$CUDACXX" ] || export PATH="${CUDA_HOME}/bin:$PATH"
    "$python" -m pip download --quiet --no-cache-dir --no-deps --no-binary :all: -d "$tmp/src" \
        "llama-cpp-python==${LLAMA_CPP_VERSION}" >&2 || die "could not download the llama-cpp-python sdist"
    tar -xzf "$tmp"/src/llama_cpp_python-*.tar.gz -C "$tmp/src"
    local src="$tmp/src/llama_cpp_python-${LLAMA_CPP_VERSION}"
    if command -v patch >/dev/null; then
        patch --quiet --forward -p1 -d "$src/vendor/llama.cpp" < "$PATCH" >&2 || die "$PATCH does not apply"
    else
        (cd "$src/vendor/llama.cpp" && GIT_CEILING_DIRECTORIES="$tmp" git apply -p1 "$PATCH") >&2 \
            || die "$PATCH does not apply"
    fi
    if ! CMAKE_ARGS="$CMAKE_ARGS" CUDACXX="$CUDACXX" FORCE_CMAKE=1 \
            CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}" \
            "$python" -m pip wheel --quiet --no-cache-dir --no-deps -w "$tmp" "$src" >&2; then
        die "the llama-cpp-python build failed (see above); flags: ${CMAKE_ARGS:-<default>}"
    fi
    "$python" - "$tmp/build.json" "$LLAMA_CPP_VERSION" "$DEVICE" "$CUDA_ARCH" "$CMAKE_ARGS" "$KEY" <<'PY'
import json, platform, sys, time
path, version, device, arch, args, key = sys.argv[1:]
json.dump({"package": "llama-cpp-python", "version": version, "device": device, "cuda_arch": arch,
           "cmake_args": args, "key": key, "machine": platform.machine(),
           "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, open(path, "w"), indent=1)
PY
    rm -rf "$tmp/src"
    touch "$tmp/.complete"
    mv -T "$tmp" "$dir"
    trap - EXIT
    log "built in $(($(date +%s) - start)) s"
    find_wheel
}

installed_from() {   # installed_from VENV: the URL pip installed VENV's llama-cpp-python from (empty: none)
    "$1/bin/python" - <<'PY' 2>/dev/null || true
import importlib.metadata as md
import json

try:
    print(json.loads(md.distribution("llama_cpp_python").read_text("direct_url.json") or "{}").get("url", ""))
except md.PackageNotFoundError:
    pass
PY
}

install_into() {   # install_into VENV
    local venv="$1" marker="$1/edgellm-engine-build.json"
    [ -x "$venv/bin/python" ] || die "--install: $venv has no bin/python"
    # Skipped only when the venv's llama-cpp-python was installed from this key's wheel (pip's record of
    # where it came from, direct_url.json), not merely when the marker says so: a later `pip install
    # --force-reinstall` or a wheel from pip's cache replaces the package and leaves the marker behind.
    if [ -f "$marker" ] && grep -q "\"key\": \"${KEY}\"" "$marker" \
            && installed_from "$venv" | grep -q "/llama-cpp-python-${LLAMA_CPP_VERSION}-${KEY}/"; then
        return 0
    fi
    local wheel; wheel="$(build_wheel "$venv/bin/python")"
    log "installing $(basename "$wheel") (build ${KEY}) into $venv"
    "$venv/bin/python" -m pip install --quiet --no-deps --force-reinstall "$wheel" >&2
    cp "$(dirname "$wheel")/build.json" "$marker"
}

choose_flags
case "${1:---print-flags}" in
    --print-flags) print_flags ;;
    --print-version) echo "LLAMA_CPP_VERSION=${LLAMA_CPP_VERSION}" ;;
    --wheel) build_wheel "${2:-python3}" ;;
    --install) install_into "${2:?--install needs a venv folder}" ;;
    -h|--help) sed -n '2,25p' "$0" ;;
    *) die "unknown option $1 (see --help)" ;;
esac

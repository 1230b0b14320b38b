"""tools/install_service.sh into a temporary root, the unit file, and CUDA arch detection."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "install_service.sh"
JETSON = REPO / "tests" / "fixtures" / "jetson"


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )


def build_env(dt_model: str | None, release: str | None) -> dict[str, str]:
    env = {
        "EDGELLM_DT_MODEL_FILE": str(JETSON / dt_model) if dt_model else "/nonexistent",
        "EDGELLM_TEGRA_RELEASE_FILE": str(JETSON / release) if release else "/nonexistent",
        "PATH": "/usr/bin:/bin",
    }  # no nvidia-smi: only the Jetson files decide
    out = run("--print-build-env", env=env)
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


@pytest.mark.parametrize(
    "dt_model,release,arch",
    [
        ("dt_model_orin_nano", None, "87"),
        ("dt_model_agx_xavier", None, "72"),
        ("dt_model_nano", None, "53"),
        (None, "nv_tegra_release_r36", "87"),
        (None, "nv_tegra_release_r32_t210ref", "53"),
        (None, "nv_tegra_release_r35_t186ref", "62"),
    ],
)
def test_cuda_arch_detection(dt_model, release, arch):
    env = build_env(dt_model, release)
    assert env["DEVICE"] == "jetson" and env["CUDA_ARCH"] == arch
    assert env["CMAKE_ARGS"] == f"-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES={arch}"
    assert env["CUDACXX"].endswith("/bin/nvcc")


def test_cpu_build_elsewhere():
    env = build_env(None, None)
    assert env == {"DEVICE": "cpu", "CUDA_ARCH": "", "CMAKE_ARGS": "", "CUDACXX": ""}


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_install_twice_keeps_edits_then_uninstall(tmp_path):
    root = tmp_path / "root"
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF-fixture")
    first = run("--root", str(root), "--skip-install", "--model", str(model))
    assert first.returncode == 0, first.stderr
    unit = root / "etc/systemd/system/edgellm.service"
    assert "ExecStart=/opt/edgellm/venv/bin/edgellm serve --config /etc/edgellm/node.yaml" in unit.read_text()
    assert (root / "etc/edgellm/node.yaml").read_text() == (REPO / "configs/node.yaml").read_text()
    assert (root / "etc/edgellm/edgellm.env").exists()
    assert (root / "var/lib/edgellm/models/tiny.gguf").read_bytes() == b"GGUF-fixture"
    dropin = (root / "etc/systemd/system/edgellm.service.d/model.conf").read_text()
    assert "Environment=EDGELLM_MODEL_PATH=/var/lib/edgellm/models/tiny.gguf" in dropin

    before = digest(root)
    again = run("--root", str(root), "--skip-install", "--model", str(model))
    assert again.returncode == 0 and digest(root) == before  # idempotent

    edited = root / "etc/edgellm/node.yaml"
    edited.write_text(edited.read_text() + "port: 9999\n")
    third = run("--root", str(root), "--skip-install")
    assert third.returncode == 0
    assert edited.read_text().endswith("port: 9999\n")  # the edit survives
    assert (root / "etc/edgellm/node.yaml.dist").read_text() == (REPO / "configs/node.yaml").read_text()

    gone = run("--root", str(root), "--uninstall")
    assert gone.returncode == 0, gone.stderr
    assert not unit.exists() and not (root / "opt/edgellm").exists()
    assert not (root / "etc/systemd/system/edgellm.service.d").exists()
    assert edited.exists()  # settings and state are kept without --purge
    assert run("--root", str(root), "--uninstall", "--purge").returncode == 0
    assert not (root / "etc/edgellm").exists() and not (root / "var/lib/edgellm").exists()


def test_unknown_option_is_refused():
    out = run("--bogus")
    assert out.returncode == 2 and "unknown option --bogus" in out.stderr


def test_unit_file_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is required (make test installs Debian's systemd package when missing)"
    unit = tmp_path / "edgellm.service"
    # verify checks that ExecStart exists: point it at this checkout's console script
    exe = Path(sys.executable).with_name("edgellm")
    unit.write_text((REPO / "systemd/edgellm.service").read_text().replace("/opt/edgellm/venv/bin/edgellm", str(exe)))
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = unit.read_text()
    for line in (
        "Type=notify",
        "Restart=on-failure",
        "ProtectSystem=strict",
        "ReadWritePaths=/var/lib/edgellm",
        "ProtectHome=true",
        "NoNewPrivileges=true",
        "PrivateTmp=true",
        "EnvironmentFile=-/etc/edgellm/edgellm.env",
        "WatchdogSec=",
        "StartLimitBurst=",
    ):
        assert line in text

"""`edgellm doctor`: the build, the CPU features, the plan, and a real batched decode in a worker process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from edgellm.runtime.supervision.native_crash import CRASH_AT_ENV


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EDGELLM_")}
    return subprocess.run(
        [sys.executable, "-m", "edgellm", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**clean, **(env or {})},
    )


def test_doctor_passes_on_this_machine_and_says_what_it_ran():
    out = doctor("--n-slots", "4", "--n-ctx", "2048")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    text = out.stdout
    assert any(line.startswith("build:") and "llama-cpp-python 0.3.36" in line for line in lines), text
    assert any(line.startswith("llama.cpp sees:") and "CPU :" in line for line in lines), text
    assert "memory plan:" in text
    assert "KV pool of 2048 cells (f16) for 4 slots, up to 2048 a request" in text
    assert "offload decision: cpu" in text
    # The self-test reached the batched kernels: several sequences of >= 64 prompt tokens in one go.
    test = next(line for line in lines if line.startswith("self-test:"))
    assert "3 sequences x 64 prompt tokens, 3 of them prefilled in one batch, 12 tokens sampled" in test, text
    assert lines[-1].startswith("PASS: ")


AMX_MNEMONICS = ("ldtilecfg", "tileloadd", "tdpbssd", "tdpbusd", "tdpbf16ps", "tilestored")


def test_the_venv_build_has_no_amx_kernels_on_x86():
    """The engine `make setup` installed is tools/engine_wheel.sh's build: on x86 not one AMX instruction in
    llama.cpp's CPU backend (on a host without AMX, -march=native alone would not add any either: so
    the proof is the recorded flags plus, on an AMX host, the disassembly), and llama.cpp says no AMX."""
    import llama_cpp

    if os.uname().machine != "x86_64":
        return
    out = doctor("--n-slots", "1", "--n-ctx", "512")
    sees = next(line for line in out.stdout.splitlines() if line.startswith("llama.cpp sees:"))
    build = next(line for line in out.stdout.splitlines() if line.startswith("build:"))
    assert "AMX" not in sees and "-mno-amx-int8" in build and "not what is installed" not in build, out.stdout
    lib = next(Path(llama_cpp.__file__).parent.glob("lib/libggml-cpu.so*"))
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True)
    assert asm.returncode == 0 and len(asm.stdout) > 1_000_000, asm.stderr
    assert not [m for m in AMX_MNEMONICS if f"\t{m}" in asm.stdout]


def test_a_crash_in_the_self_test_is_a_fail_line_with_the_fix():
    out = doctor("--n-slots", "2", "--n-ctx", "1024", env={CRASH_AT_ENV: "warm-up"})
    assert out.returncode == 1, out.stdout + out.stderr
    fail = next(line for line in out.stdout.splitlines() if line.startswith("FAIL: "))
    assert "SIGSEGV" in fail and "warm-up" in fail
    assert "code None" not in out.stdout + out.stderr
    fix = next(line for line in out.stdout.splitlines() if line.startswith("fix: "))
    assert "make setup" in fix


def test_an_unloadable_model_is_named(tmp_path: Path):
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"this is not a GGUF file" * 100)
    out = doctor("--model-path", str(bogus))
    assert out.returncode == 2, out.stdout + out.stderr
    assert str(bogus) in out.stdout + out.stderr

"""`edgellm doctor`: is the engine on this machine built right, and does it run what `serve` would run?

It prints the llama-cpp-python build (its flags, from the record tools/engine_wheel.sh leaves in the
venv), the CPU features llama.cpp was compiled for, the host's, the memory plan and the GPU offload
decision, then starts the engine exactly as `edgellm serve` does: a worker process that loads the
model and runs the self-test (engine/self_test.py: several 64-token prompts decoded together and
sampled). The worker is a separate process, so a native crash there is a FAIL line with the fix, not a
segfault of doctor. Exit code: 0 pass, 1 fail (2: unusable settings, as for serve).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from edgellm import __version__
from edgellm.errors import EdgeLLMError
from edgellm.runtime.settings import Settings
from edgellm.runtime.supervision.native_crash import REBUILD_ADVICE

# tools/engine_wheel.sh --install writes this into the venv (sys.prefix) it installs the engine into.
BUILD_RECORD = "edgellm-engine-build.json"
AMX_ISSUE = "llama.cpp's AMX kernels crash on the first prompt (upstream issue 20824)"


def build_record(prefix: str = sys.prefix) -> dict[str, Any] | None:
    try:
        return json.loads((Path(prefix) / BUILD_RECORD).read_text())
    except (OSError, ValueError):
        return None


def installed_from() -> str:
    """Where pip installed this venv's llama-cpp-python from (its direct_url.json); '' when unknown."""
    from importlib import metadata

    try:
        return json.loads(metadata.distribution("llama_cpp_python").read_text("direct_url.json") or "{}").get("url", "")
    except (metadata.PackageNotFoundError, ValueError):
        return ""


def cpu_model_and_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model in ("", platform.machine()):
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, flags


def llama_system_info() -> tuple[str, bool]:
    """(llama.cpp's own line of the CPU features it was compiled for, whether it can offload to a GPU).

    Importing llama_cpp loads the library and runs no kernel: safe even for a build that crashes."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode(errors="replace").strip(), bool(
        llama_cpp.llama_supports_gpu_offload()
    )


def run_doctor(settings: Settings, out: TextIO = sys.stdout, *, ready_timeout_s: float = 600.0) -> int:
    from edgellm.runtime.server.node_config import worker_config
    from edgellm.runtime.supervision.supervisor import WorkerEngine

    def say(label: str, text: str) -> None:
        print(f"{label + ':':<18}{text}", file=out, flush=True)

    say("edgellm", f"{__version__} on Python {platform.python_version()} ({sys.executable})")
    cpu, flags = cpu_model_and_flags()
    host_amx = bool({"amx_int8", "amx_tile", "amx_bf16"} & flags)
    say("machine", f"{platform.machine()}, {cpu}, {os.cpu_count()} CPUs; AMX {'yes' if host_amx else 'no'}")
    record = build_record()
    source = installed_from()
    if record is not None and f"-{record.get('key')}/" not in source:
        # Replaced after engine_wheel.sh installed it (a --force-reinstall, a wheel from pip's cache).
        say("build", f"the recorded build {record.get('key')} is not what is installed (from {source or 'PyPI?'})")
        record = None
    if record is None:
        say("build", "llama-cpp-python was not installed by tools/engine_wheel.sh: its flags are unknown")
    else:
        say(
            "build",
            f"llama-cpp-python {record.get('version')} for {record.get('device')}, key {record.get('key')}, "
            f"CMAKE_ARGS={record.get('cmake_args') or '<llama.cpp default>'}",
        )
    system_info, gpu_build = llama_system_info()
    say("llama.cpp sees", system_info)
    build_amx = "AMX" in system_info
    plan = None
    try:
        # The worker's own log stays at warnings: doctor's report is what the user reads.
        # Its self-test always runs: an earlier pass is what doctor is asked to check again.
        config = replace(worker_config(settings), log_level="WARNING", start_record=None)
        plan = settings.memory_report()
    except EdgeLLMError as exc:
        say("model", exc.message)
        print(f"FAIL: the settings cannot run: {exc.message}", file=out, flush=True)
        return 2
    say("model", f"{config.model.path}")
    if plan is not None:
        kind, share = ("pool", "") if plan["kv_unified"] else ("cache", " (a slot's share)")
        say(
            "memory plan",
            f"KV {kind} of {plan['kv_cells']} cells ({plan['kv_type']}) for {plan['n_slots']} slots, up to "
            f"{plan['seq_ctx']} a request{share}; "
            f"weights {plan['weights_mib']} MiB + KV {plan['kv_mib']} + compute {plan['compute_mib']} + overhead "
            f"{plan['overhead_mib']} + embeddings {plan.get('embedding_mib', 0)} "
            f"+ draft model {plan.get('draft_mib', 0)} = {plan['total_mib']} MiB "
            f"of a {plan['budget_mib']} MiB budget",
        )
    else:
        say("memory plan", f"n_ctx {config.model.n_ctx}, {config.model.n_slots} slots (sizes not read from the GGUF)")
    layers = "auto" if config.model.n_gpu_layers < 0 else config.model.n_gpu_layers
    say("gpu offload", f"this build {'can' if gpu_build else 'cannot'} offload; n_gpu_layers {layers}")

    # One start attempt: doctor reports the first failure instead of retrying it.
    engine = WorkerEngine(config, lambda outputs: None, ready_timeout_s=ready_timeout_s, start_attempts=1)
    t0 = time.perf_counter()
    try:
        engine.start()
    except EdgeLLMError as exc:
        reason = engine.last_error or exc.message  # without the advice: the fix line below gives it
        fix = REBUILD_ADVICE
        if build_amx:
            fix = f"{AMX_ISSUE} and this build has them: {REBUILD_ADVICE}"
        elif record is None:
            fix = f"this llama-cpp-python was not built by tools/engine_wheel.sh (pip's cache?): {REBUILD_ADVICE}"
        print(f"FAIL: {reason}\nfix: {fix}", file=out, flush=True)
        return 1
    finally:
        engine.close()
    info = engine.info
    assert info is not None  # a started worker has reported it (READY carries it)
    offload = info.offload
    say(
        "offload decision",
        f"{offload.get('device')} (n_gpu_layers {offload.get('n_gpu_layers')} of {offload.get('n_layers')})"
        + (f"; {offload['fallback_reason']}" if offload.get("fallback_reason") else ""),
    )
    test = info.self_test or {}
    say(
        "self-test",
        f"{test.get('sequences')} sequences x {test.get('prompt_tokens')} prompt tokens, "
        f"{test.get('prefilled_together')} of them prefilled in one batch, {test.get('new_tokens')} tokens sampled, "
        f"{test.get('ms')} ms (engine up in {time.perf_counter() - t0:.1f} s)",
    )
    if build_amx:
        print(f"warning: {AMX_ISSUE}; this build has them and passed here, but may crash on other prompts", file=out)
    print("PASS: the engine loads the model, decodes batched prompts and samples on this machine", file=out, flush=True)
    return 0

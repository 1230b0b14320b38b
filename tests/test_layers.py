"""Issue 20's structure, kept: imports read top-down, and the engine is built and stepped in one place."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_imports_point_down_without_cycles_even_under_type_checking_and_none_by_string():
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_imports.py")], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 upward imports, 0 cycles (TYPE_CHECKING included), 0 imports by string" in run.stdout


def _product_sources() -> dict[str, str]:
    files = [*(ROOT / "edgellm").rglob("*.py"), *(ROOT / "extensions").rglob("*.py")]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def test_the_scheduler_is_built_and_stepped_only_by_the_engine_core():
    built = [name for name, text in _product_sources().items() if re.search(r"\bScheduler\(", text)]
    stepped = [name for name, text in _product_sources().items() if "scheduler.step()" in text]
    assert built == ["edgellm/engine/core.py"]
    assert stepped == ["edgellm/engine/core.py"]

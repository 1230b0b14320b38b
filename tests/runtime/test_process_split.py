"""The API process never imports llama.cpp: the engine worker alone pays for it (and crashes with it)."""

from __future__ import annotations

import subprocess
import sys


def test_the_api_process_does_not_import_llama_cpp():
    code = (
        "import sys; import edgellm.runtime.server.app, edgellm.cli, edgellm.api.service; "
        "print(sorted(m for m in sys.modules if m.startswith(('llama_cpp', 'edgellm.engine.model'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

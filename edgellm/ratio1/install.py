"""Adding edgellm's plugin to a stock Ratio1 edge node's app folder (`edgellm ratio1-install`).

naeural_core finds a business plugin by signature: the module `<snake_case signature>` in any folder
under `extensions/business/` (the walk of every subfolder), class `<CamelCase signature>Plugin`. So:

- EDGELLM_INFERENCE_API (ours) is `extensions/business/edgellm/edgellm_inference_api.py`, in a folder
  no upstream file shares: copying it into a stock node overwrites nothing, and upstream's
  LLM_INFERENCE_API (`extensions/business/edge_inference_api/llm_inference_api.py`) keeps working.
  The folder is not named like the module: the lookup also tries `extensions.business.<module>`, and
  a folder of that name is a namespace package it could take for the plugin module (where an
  interpreter gives namespace packages a loader).
- The alias that makes LLM_INFERENCE_API mean edgellm is opt-in (`take_over=True`). It has to sit at
  upstream's own path, replacing upstream's file: two `llm_inference_api` modules under
  extensions/business would be found in the order of a set of folder names, i.e. either one. So the
  alias is a small generated module (below), never a file of this checkout's extensions/ tree, and
  upstream's file is kept beside it as `llm_inference_api.py.upstream` (not importable) for undo.

The alias only subclasses our plugin: one plugin body, two names.
"""

from __future__ import annotations

import shutil
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # a source checkout: extensions/ sits beside edgellm/
PLUGIN_DIR = Path("extensions") / "business" / "edgellm"
ALIAS_PATH = Path("extensions") / "business" / "edge_inference_api" / "llm_inference_api.py"
UPSTREAM_BACKUP = ALIAS_PATH.with_name("llm_inference_api.py.upstream")
ALIAS_MARK = "# edgellm alias: LLM_INFERENCE_API -> EDGELLM_INFERENCE_API"
ALIAS_MODULE = f'''{ALIAS_MARK}
"""LLM_INFERENCE_API served by edgellm (written by `edgellm ratio1-install --take-over-llm-inference-api`).

The plugin is EDGELLM_INFERENCE_API's (extensions/business/edgellm/); this module only
gives it upstream's signature. Upstream's own module, if there was one, is llm_inference_api.py.upstream
beside this file: `edgellm ratio1-install` without the flag puts it back.
"""

from extensions.business.edgellm.edgellm_inference_api import (  # noqa: F401
    _CONFIG,
    __VER__,
    EdgellmInferenceApiPlugin,
)


class LlmInferenceApiPlugin(EdgellmInferenceApiPlugin):
    """edgellm's inference API under upstream's LLM_INFERENCE_API signature."""
'''


class InstallError(Exception):
    pass


def is_alias(path: Path) -> bool:
    try:
        return path.read_text(encoding="utf-8").startswith(ALIAS_MARK)
    except OSError:
        return False


def write_alias(app_dir: Path) -> Path:
    """The alias at upstream's path under `app_dir`; upstream's file (when present, not ours) moves aside."""
    alias = Path(app_dir) / ALIAS_PATH
    backup = Path(app_dir) / UPSTREAM_BACKUP
    alias.parent.mkdir(parents=True, exist_ok=True)
    if alias.exists() and not is_alias(alias):
        if backup.exists():
            raise InstallError(f"{alias} and {backup} both exist: move one away first")
        alias.rename(backup)
    alias.write_text(ALIAS_MODULE, encoding="utf-8")
    return alias


def remove_alias(app_dir: Path) -> bool:
    """Undo write_alias: upstream's file back in place. False when there was no alias."""
    alias = Path(app_dir) / ALIAS_PATH
    if not is_alias(alias):
        return False
    alias.unlink()
    backup = Path(app_dir) / UPSTREAM_BACKUP
    if backup.exists():
        backup.rename(alias)
    return True


def install(app_dir: Path, *, take_over: bool = False, source: Path = REPO_ROOT) -> list[str]:
    """Copy our plugin folder into a node's app folder (the one holding device.py and extensions/;
    /edge_node in the stock image); with `take_over`, add the LLM_INFERENCE_API alias, else remove
    an alias an earlier run wrote. Returns what was done, one line each."""
    app_dir = Path(app_dir)
    if not (app_dir / "extensions").is_dir():
        raise InstallError(f"{app_dir} has no extensions/ folder: pass the edge node's app folder (e.g. /edge_node)")
    src = Path(source) / PLUGIN_DIR
    if not (src / "edgellm_inference_api.py").is_file():
        raise InstallError(f"{src} is missing: install from a source checkout of edgellm")
    dst = app_dir / PLUGIN_DIR
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    done = [f"copied {src} -> {dst} (signature EDGELLM_INFERENCE_API)"]
    if take_over:
        done.append(f"wrote the LLM_INFERENCE_API alias {write_alias(app_dir)}")
    elif remove_alias(app_dir):
        done.append(f"removed the LLM_INFERENCE_API alias; upstream's plugin is back at {app_dir / ALIAS_PATH}")
    return done

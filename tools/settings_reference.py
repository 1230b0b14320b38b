"""The configuration reference table of docs/configuration.md, generated from the settings model.

    python tools/settings_reference.py           # rewrite the table between the markers
    python tools/settings_reference.py --check   # exit 1, saying so, when the file's table is stale

One row per field of `edgellm.runtime.settings.Settings`, in declaration order: its name, the environment
variable that sets it (EDGELLM_<NAME>, plus the upstream Ratio1 name where settings_sources.py reads one), its
default, what a running node does when it changes (`runtime/live_settings.py`: LIVE fields are taken at
once, REFUSED ones need the process restarted, every other one a drained rebuild of the app and its
engine), and one line of meaning: the field's `description`, else the comment on its line, else the
first sentence of the comment block above it (read from settings.py with `tokenize`). A field with none
of them, or with a computed default this file does not know how to name, stops the generator: say it
in settings.py, then run it again. tests/test_docs.py fails while the table is stale.
"""

from __future__ import annotations

import ast
import enum
import io
import re
import sys
import tokenize
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from edgellm.runtime import settings as settings_module  # noqa: E402
from edgellm.runtime.live_settings import LIVE, REFUSED  # noqa: E402
from edgellm.runtime.settings import Settings  # noqa: E402
from edgellm.runtime.settings_sources import UpstreamEnvSource  # noqa: E402

DOC = ROOT / "docs" / "configuration.md"
START = "<!-- settings-table:start -->"
END = "<!-- settings-table:end -->"
SOURCE = Path(settings_module.__file__)

# Defaults that are not a value but are decided where the node runs: the word the table shows.
COMPUTED_DEFAULTS = {
    "state_dir": "auto: `$XDG_STATE_HOME/edgellm`, else `~/.local/state/edgellm`",
    "node_alias": "auto: the host name",
}
# Defaults of None that stand for something the machine decides (the table names what).
NONE_MEANS = {
    "memory_budget": "auto: 75% of MemAvailable",
    "model_path": "none: the bundled SmolLM2-135M",
}


def _env_names() -> dict[str, list[str]]:
    """Each field's environment variables: the EDGELLM_ one, then the upstream twin settings_sources.py reads."""
    prefix = Settings.model_config.get("env_prefix", "")
    upstream = UpstreamEnvSource.NAMES  # INFERENCE_API_TOKEN, REQUEST_TTL_SECONDS
    return {
        name: [f"{prefix}{name}".upper(), *([upstream[name]] if name in upstream else [])]
        for name in Settings.model_fields
    }


def _env_format(name: str) -> str:
    """How a list or dict is written in the environment: JSON, or comma separated where the field is NoDecode."""
    field = Settings.model_fields[name]
    origin = getattr(field.annotation, "__origin__", None)
    if origin not in (list, dict):
        return ""
    if any(getattr(m, "__name__", "") == "NoDecode" for m in field.metadata):
        return " (comma separated)"
    return " (JSON)"


def _comments() -> dict[str, str]:
    """Each field's comment in settings.py: the one on its first line, else the block right above it."""
    source = SOURCE.read_text(encoding="utf-8")
    lines = source.splitlines()
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == Settings.__name__)
    found: dict[str, str] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if node.lineno in comments:
            found[node.target.id] = comments[node.lineno]
            continue
        block, line = [], node.lineno - 1
        while line in comments and lines[line - 1].lstrip().startswith("#"):
            block.insert(0, comments[line])
            line -= 1
        if block:
            found[node.target.id] = " ".join(block)
    return found


def _first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (not the one of "e.g." or "i.e.")."""
    return re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.!?])\s+(?=[A-Za-z`])", text.strip(), maxsplit=1)[0]


def _mib(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return ""


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, enum.Enum):
        return f"`{value.value}`"
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    if isinstance(value, (list, dict)):
        return f"`{value!r}`".replace("'", '"')
    return f"`{value}`"


def _default(name: str) -> str:
    field = Settings.model_fields[name]
    if field.default_factory is not None:
        if field.default_factory in (list, dict):
            return _show(field.default_factory())
        if name not in COMPUTED_DEFAULTS:
            raise SystemExit(
                f"settings_reference: {name}'s default is computed ({field.default_factory!r}): "
                "name it in COMPUTED_DEFAULTS of tools/settings_reference.py"
            )
        return COMPUTED_DEFAULTS[name]
    value = field.default
    if value is None:
        return NONE_MEANS.get(name, "none")
    shown = _show(value)
    if isinstance(value, int) and not isinstance(value, bool) and name.endswith("_bytes") and _mib(value):
        shown += f" ({_mib(value)})"
    return shown


def _change(name: str) -> str:
    if name in LIVE:
        return "live"
    if name in REFUSED:
        return "restart"
    return "rebuild"


def _cell(text: str) -> str:
    """Markdown-safe table cell: pipes escaped, and angle brackets outside code spans kept as text."""
    parts = re.split(r"(`[^`]*`)", text.replace("|", "\\|"))
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;").replace(">", "&gt;") for p in parts)


def render_table() -> str:
    """The table, as it belongs between the markers (markers excluded)."""
    comments = _comments()
    envs = _env_names()
    rows = [
        "| setting | environment | default | change | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, field in Settings.model_fields.items():
        meaning = field.description or comments.get(name)
        if not meaning:
            raise SystemExit(
                f"settings_reference: {name} has no description and no comment in {SOURCE.name}: "
                "say what it is there (a comment on its line is enough)"
            )
        env = ", ".join(f"`{e}`" for e in envs[name]) + _env_format(name)
        line = _first_sentence(meaning).rstrip(".")
        line = line[:1].upper() + line[1:]
        rows.append(f"| `{name}` | {env} | {_cell(_default(name))} | {_change(name)} | {_cell(line)} |")
    return "\n".join(rows) + "\n"


def table_in(text: str) -> str:
    """What the document holds between the markers (ValueError when they are missing)."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{DOC.relative_to(ROOT)}: the markers {START} ... {END} are missing")
    return text[start + len(START) : end].strip("\n") + "\n"


def with_table(text: str, table: str) -> str:
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{DOC.relative_to(ROOT)}: the markers {START} ... {END} are missing")
    return text[: start + len(START)] + "\n" + table + text[end:]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--check"]):
        print("usage: python tools/settings_reference.py [--check]", file=sys.stderr)
        return 2
    text = DOC.read_text(encoding="utf-8")
    table = render_table()
    if args == ["--check"]:
        if table_in(text) != table:
            print(
                f"{DOC.relative_to(ROOT)}: the settings table is stale (settings.py or live_settings.py changed); "
                "run: python tools/settings_reference.py",
                file=sys.stderr,
            )
            return 1
        print(f"{DOC.relative_to(ROOT)}: the settings table is current ({len(Settings.model_fields)} settings)")
        return 0
    updated = with_table(text, table)
    if updated != text:
        DOC.write_text(updated, encoding="utf-8")
        print(f"wrote the settings table into {DOC.relative_to(ROOT)} ({len(Settings.model_fields)} settings)")
    else:
        print(f"{DOC.relative_to(ROOT)}: the settings table was current")
    return 0


if __name__ == "__main__":
    sys.exit(main())

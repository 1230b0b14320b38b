"""The docs keep up with the code: the settings table is generated and current, the README stays short and
its links land. Quick (no model, no node); `make test` also builds the site with `mkdocs build --strict`,
which checks every link and anchor between the pages of docs/."""

from __future__ import annotations

import html
import re
from pathlib import Path

from tools import settings_reference

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_BYTES = 30_000  # what a new user reads; the rest lives in docs/ (issue 43)

# [text](target) and [text]: target, not inside code spans; images too.
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_REFERENCE_LINK = re.compile(r"(?m)^\s*\[[^\]]+\]:\s*(\S+)")


def _relative_targets(text: str) -> list[str]:
    text = re.sub(r"(?s)```.*?```", "", text)  # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)  # nor do code spans
    targets = _INLINE_LINK.findall(text) + _REFERENCE_LINK.findall(text)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_the_settings_table_is_generated_from_the_settings_model_and_current():
    page = settings_reference.DOC.read_text(encoding="utf-8")
    assert settings_reference.table_in(page) == settings_reference.render_table(), (
        "docs/configuration.md's settings table is stale: run python tools/settings_reference.py"
    )


def test_the_settings_table_has_a_row_per_setting():
    from edgellm.runtime.settings import Settings

    rows = [line for line in settings_reference.render_table().splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(Settings.model_fields)


def test_the_readme_stays_short():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES}): move detail to docs/"


def _heading_ids(markdown_text: str) -> set[str]:
    """The ids MkDocs gives a page's headings (Python-Markdown's toc slugs), for links into docs/ pages."""
    from markdown.extensions.toc import slugify  # Python-Markdown, which mkdocs brings

    text = re.sub(r"(?ms)^```.*?^```", "", markdown_text)
    ids = set()
    for heading in re.findall(r"(?m)^#{1,6}\s+(.*?)\s*#*\s*$", text):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
        ids.add(slugify(html.unescape(heading), "-"))
    return ids


def test_every_relative_link_in_the_readme_points_at_a_file():
    targets = _relative_targets(README.read_text(encoding="utf-8"))
    assert targets, "the README links to the docs pages"
    missing = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
    # A link to a section names a heading its page has (mkdocs checks the links between the pages).
    unknown = []
    for target in targets:
        path, _, anchor = target.partition("#")
        if anchor and path.endswith(".md") and anchor not in _heading_ids((ROOT / path).read_text(encoding="utf-8")):
            unknown.append(target)
    assert not unknown, f"README.md links to sections that do not exist: {unknown}"

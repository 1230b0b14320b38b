"""edgellm's renderer (engine/chat_template.py) against the reference's: every real template of
tests/fixtures/templates/ over the fixed conversations of tools/template_goldens.py (a text request, a
system message, tools with a description, with "" and without, a tool loop with earlier reasoning, with and
without the generation prompt, thinking off), compared byte for byte with transformers' renders of the same
(tests/fixtures/templates/golden/, written by that tool with the Ratio1 venv's transformers). Where
transformers refused a case (golden/_refused.json), edgellm refuses it too, with a 400.

The differences are llama-server's choices, each listed in KNOWN with its reason: for those cases the render
is compared with transformers' render of what llama-server gives the template instead. Pure Python: no model.
"""

from __future__ import annotations

import copy
import json

import pytest

from edgellm.api.dialects.openai_chat import parse_openai_request
from edgellm.engine import chat_template
from edgellm.engine.chat_template import ChatTemplate
from edgellm.errors import InvalidRequest
from tools.template_goldens import (
    BOS,
    CASES,
    EOS,
    GOLDEN,
    NOW,
    REFUSED,
    cases_for,
    golden_path,
    real_templates,
)

HERMES_TOOL_USE = ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use")
TOOLS_NONE = (
    "transformers passes `tools=None` when there are none, and these tool_use templates iterate it "
    "(TypeError: 'NoneType' object is not iterable); llama-server, as edgellm, leaves `tools` out of the "
    "context, where the template sees it undefined: compared with transformers' compiled template rendered "
    "without `tools`"
)
# (template stem, or "*" for every template; case) -> (the golden compared with instead, the reason).
KNOWN: dict[tuple[str, str], tuple[str, str]] = {
    ("*", "tools_no_description"): (
        "tools_empty_description",
        'a tool without a description gets "" after its name, as llama-server gives it '
        "(common_chat_tools_parse_oaicompat / _to_json_oaicompat; api/tool_rules.py): Hermes 2 Pro / 3, "
        "Functionary v3.1 and gpt-oss render it where transformers raises on the missing key, and templates "
        "that write the tool as JSON show the key",
    ),
    ("google-gemma-2-2b-it", "system"): (
        "system__system_merged",
        'Gemma 2 has no system role ("System role not supported"): llama-server, as edgellm, merges the system '
        'text into the first user turn, joined by "\\n"',
    ),
    **{
        (t, case): (f"{case}__tools_absent", TOOLS_NONE)
        for t in (*HERMES_TOOL_USE, "CohereForAI-c4ai-command-r-plus-tool_use")
        for case in ("text", "text_no_generation_prompt", "system")
    },
}
PAIRS = [(t, case) for t in real_templates() for case in cases_for(t.read_text(encoding="utf-8"))]


@pytest.fixture(autouse=True)
def fixed_date(monkeypatch):
    """The goldens' moment: `date_string`, `datetime` and `strftime_now` as transformers rendered them."""
    monkeypatch.setattr(chat_template, "clock", lambda: NOW)


def api_tools(tools):
    """The tools as the node gives them to the template: through the API's rules (api/tool_rules.py)."""
    if not tools:
        return None
    ask = [{"role": "user", "content": "x"}]
    request, _ = parse_openai_request({"model": "m", "messages": ask, "tools": copy.deepcopy(tools)}, "m")
    return request.tools


def edgellm_render(template, case: str) -> str | InvalidRequest:
    messages, tools, add_generation_prompt, thinking = CASES[case]
    t = ChatTemplate(template.read_text(encoding="utf-8"), bos_token=BOS, eos_token=EOS)
    try:
        return t.render(
            copy.deepcopy(messages),
            add_generation_prompt=add_generation_prompt,
            tools=api_tools(tools),
            template_kwargs=None if thinking else {"enable_thinking": False},
        ).text
    except InvalidRequest as exc:
        assert exc.http_status == 400 and exc.message
        return exc


def known(stem: str, case: str) -> tuple[str, str] | None:
    return KNOWN.get((stem, case)) or KNOWN.get(("*", case))


def golden_file(template, name: str):
    case, _, variant = name.partition("__")
    return golden_path(template, case, variant or None)


@pytest.mark.parametrize(("template", "case"), PAIRS, ids=[f"{t.stem}:{c}" for t, c in PAIRS])
def test_edgellm_renders_as_transformers(template, case):
    expected, reason = known(template.stem, case) or (case, None)
    golden = golden_file(template, expected)
    out = edgellm_render(template, case)
    if golden.exists():
        assert not isinstance(out, InvalidRequest), f"transformers renders {golden.name}, edgellm refuses: {out}"
        assert out == golden.read_text(encoding="utf-8"), f"{golden.name} ({reason or 'no known difference'})"
    else:
        refusal = json.loads(REFUSED.read_text(encoding="utf-8"))["refused"][template.stem][expected]
        assert isinstance(out, InvalidRequest), f"transformers refuses ({refusal}), edgellm renders"


def test_each_known_difference_is_real():
    """A listed difference that no longer differs is taken off the list (the base case's golden equals
    edgellm's render there); one template of a "*" entry has to differ at least."""
    for (stem, case), (_, reason) in KNOWN.items():
        templates = [t for t in real_templates() if stem in ("*", t.stem)]
        assert templates, (stem, case)
        differs = []
        for t in templates:
            base = golden_path(t, case)
            out = edgellm_render(t, case)
            differs.append(not base.exists() or isinstance(out, InvalidRequest) or out != base.read_text("utf-8"))
        assert (any if stem == "*" else all)(differs), (stem, case, reason)


def test_the_goldens_cover_every_real_template():
    refused = json.loads(REFUSED.read_text(encoding="utf-8"))["refused"]
    for t, case in PAIRS:
        assert golden_path(t, case).exists() or case in refused.get(t.stem, {}), (t.name, case)
    names = {p.name for p in GOLDEN.glob("*.txt")}
    stems = {t.stem for t in real_templates()}
    assert all(n.split("__")[0] in stems for n in names)  # no golden of a template gone

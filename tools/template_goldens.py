"""Golden renders of the real chat templates by the reference renderer, Hugging Face transformers.

Renders every real model's template in tests/fixtures/templates/ (not edgellm's own hermes.jinja,
mistral.jinja, thinking.jinja, raising.jinja) over the fixed conversations of CASES with transformers' own
renderer (transformers.utils.chat_template_utils.render_jinja_template, what `apply_chat_template` calls, its
messages normalised as that does: keys whose value is None dropped), and writes
tests/fixtures/templates/golden/<template stem>__<case>.txt for each render, and golden/_refused.json with
the exception of each one transformers refuses. tests/engine/test_template_goldens.py renders the same cases
through edgellm's renderer (engine/chat_template.py) and compares byte for byte.

The context is llama-server's, given explicitly as template kwargs, so that the goldens test the rendering
and not the context (which tests/engine/test_chat_template.py covers): `bos_token` "<s>", `eos_token` "</s>",
`enable_thinking` (true; false in the `thinking_off` case), `date_string` and `datetime` of the fixed
moment NOW, and `functions` (the tools as JSON text, "" without: what llama-server gives Firefunction v2).
transformers' `strftime_now` is replaced by one that reads NOW, so the goldens never change with the day.

transformers is not an edgellm dependency; the Ratio1 node venv has it (transformers 5.x). Run from the
repository root with that venv's python (this file imports nothing of edgellm, and transformers only in
main(): the test imports CASES from here):

    /root/.cache/edgellm/ratio1-venv-9217a80c77fe35c7/bin/python tools/template_goldens.py
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "tests" / "fixtures" / "templates"
GOLDEN = TEMPLATES / "golden"
REFUSED = GOLDEN / "_refused.json"
# edgellm's own test templates: no reference render to compare with.
OWN = ("hermes.jinja", "mistral.jinja", "thinking.jinja", "raising.jinja")
NOW = dt.datetime(2025, 1, 15, 9, 30, 0)  # the moment every golden is rendered at
BOS, EOS = "<s>", "</s>"

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SYSTEM = [{"role": "system", "content": "Answer in one word."}, *ASK]
LOOP = [
    *ASK,
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "The user wants the weather: call get_weather.",
        "tool_calls": [
            {"id": "a1B2c3D4e", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "18 C, sunny"},
]


def tool(description: str | None) -> dict[str, Any]:
    """get_weather as a client sends it: with a description, with "", or without the key."""
    fn: dict[str, Any] = {"name": "get_weather"}
    if description is not None:
        fn["description"] = description
    fn["parameters"] = WEATHER
    return {"type": "function", "function": fn}


# name -> (messages, tools or None, add_generation_prompt, enable_thinking). `thinking_off` only on the
# templates that read enable_thinking (thinking_templates()).
CASES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool, bool]] = {
    "text": (ASK, None, True, True),
    "text_no_generation_prompt": (ASK, None, False, True),
    "system": (SYSTEM, None, True, True),
    "tools": (ASK, [tool("The weather in a city.")], True, True),
    "tools_empty_description": (ASK, [tool("")], True, True),
    "tools_no_description": (ASK, [tool(None)], True, True),
    "tool_loop": (LOOP, [tool("The weather in a city.")], True, True),
    "thinking_off": (ASK, None, True, False),
}


def real_templates() -> list[Path]:
    return sorted(p for p in TEMPLATES.glob("*.jinja") if p.name not in OWN)


# What llama-server renders instead of a case transformers refuses, rendered by transformers too and written
# as <template>__<case>__<variant>.txt when the case is refused:
# - tools_absent: a case without tools, with no `tools` (and no `documents`) in the context at all, where
#   transformers passes `tools=None` (llama-server leaves the name out when there are none);
# - system_merged: the system text merged into the first user turn, joined by "\n" (llama-server's
#   fallback for a template without a system role).
VARIANTS = ("tools_absent", "system_merged")


def variant_applies(case: str, variant: str) -> bool:
    messages, tools, _, _ = CASES[case]
    if variant == "tools_absent":
        return tools is None
    return messages[0]["role"] == "system"


def merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    system, first, *rest = messages
    return [{**first, "content": system["content"] + "\n" + first["content"]}, *rest]


def thinking_template(source: str) -> bool:
    return "enable_thinking" in source


def cases_for(source: str) -> list[str]:
    return [c for c in CASES if c != "thinking_off" or thinking_template(source)]


def context(case: str) -> dict[str, Any]:
    """The template kwargs of a case: llama-server's context at NOW (bos/eos, enable_thinking, dates,
    functions)."""
    _, tools, _, thinking = CASES[case]
    return {
        "bos_token": BOS,
        "eos_token": EOS,
        "enable_thinking": thinking,
        "date_string": NOW.strftime("%d %b %Y"),
        "datetime": NOW.strftime("%b %d %Y"),
        "functions": json.dumps(tools, ensure_ascii=False, indent=2) if tools else "",
    }


def golden_path(template: Path, case: str, variant: str | None = None) -> Path:
    return GOLDEN / f"{template.stem}__{case}{'__' + variant if variant else ''}.txt"


def render(source: str, case: str, variant: str | None = None) -> str:
    """transformers' render of one case, or of its variant (its exceptions propagate)."""
    from transformers.utils import chat_template_utils as ctu

    compiled = ctu._compile_jinja_template(source)  # the cached template render_jinja_template renders with
    compiled.environment.globals["strftime_now"] = lambda fmt: NOW.strftime(fmt)
    messages, tools, add_generation_prompt, _ = CASES[case]
    if variant == "system_merged":
        messages = merged(messages)
    chat = ctu._normalize_chat_messages(copy.deepcopy(messages))  # as apply_chat_template does
    if variant == "tools_absent":  # the compiled template itself, as render_jinja_template calls it, less tools
        chat = ctu._alias_reasoning_fields(ctu._plain_template_data(chat))
        return compiled.render(messages=chat, add_generation_prompt=add_generation_prompt, **context(case))
    rendered, _ = ctu.render_jinja_template(
        conversations=[chat],
        tools=copy.deepcopy(tools),
        documents=None,
        chat_template=source,
        add_generation_prompt=add_generation_prompt,
        **context(case),
    )
    return rendered[0]


def main() -> int:
    import transformers

    GOLDEN.mkdir(parents=True, exist_ok=True)
    for old in GOLDEN.glob("*.txt"):
        old.unlink()
    refused: dict[str, dict[str, str]] = {}
    written = 0
    for template in real_templates():
        source = template.read_text(encoding="utf-8")
        for case in cases_for(source):
            for variant in (None, *VARIANTS):
                if variant and not (variant_applies(case, variant) and case in refused.get(template.stem, {})):
                    continue
                key = case + (f"__{variant}" if variant else "")
                try:
                    text = render(source, case, variant)
                except Exception as exc:  # noqa: BLE001 - a refusal is recorded, whatever it is
                    refused.setdefault(template.stem, {})[key] = f"{type(exc).__name__}: {exc}"[:300]
                    continue
                golden_path(template, case, variant).write_text(text, encoding="utf-8", newline="")
                written += 1
    REFUSED.write_text(
        json.dumps({"transformers": transformers.__version__, "refused": refused}, indent=1, sort_keys=True) + "\n",
        encoding="utf-8",
    )
    print(f"{written} goldens, {sum(map(len, refused.values()))} refusals in {GOLDEN.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The model names a request may send: the served ids, the names each also answers to (settings
`model_aliases`: `qwen2.5:1.5b`, `gpt-4o-mini`...), and what a name the node does not know gets (settings
`unknown_model`: `reject`, the 404 that lists the ids; `default`, the default model serves it).

Every route reads a body's `model` through `served_body` before its parser checks it, so an alias or a
foreign name is the served id from there on: the parsers, model_routes and the results see only ids.
Framework-agnostic and pure: the Service's config (api/submission.py) holds the table, `edgellm batch-run
--local` applies the same rules without a node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

UNKNOWN_MODEL_POLICIES = ("reject", "default")


@dataclass(frozen=True)
class ModelNames:
    """The names of a node's models. `ids`: the served ids, the default first; `aliases`: (name, id) pairs;
    `unknown`: "reject" or "default"."""

    ids: tuple[str, ...]
    aliases: tuple[tuple[str, str], ...] = ()
    unknown: str = "reject"

    def served_id(self, name: str) -> str | None:
        """The id `name` stands for: itself when served, its alias's id, the default's when unknown names
        go to the default; None when the node refuses it (the caller's 404 names the ids)."""
        if name in self.ids:
            return name
        for alias, target in self.aliases:
            if alias == name:
                return target
        return self.ids[0] if self.unknown == "default" else None

    def names_of(self, model_id: str) -> list[str]:
        """The aliases of `model_id`, in the order the settings list them."""
        return [alias for alias, target in self.aliases if target == model_id]


def served_body(body: Any, names: ModelNames) -> tuple[Any, str | None]:
    """(`body` with its `model` the served id it stands for, the name it sent when that was another name).

    A body that is not an object, has no string `model`, or names nothing the node serves (with `unknown`
    "reject") is returned as it is, for its route's parser to refuse the same way as before."""
    if not isinstance(body, dict):
        return body, None
    name = body.get("model")
    if not isinstance(name, str) or not name or name in names.ids:
        return body, None
    served = names.served_id(name)
    if served is None:
        return body, None
    return {**body, "model": served}, name

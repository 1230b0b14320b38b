"""Which of the node's models a request names (settings `models:`; runtime/supervision/model_switch.py runs them).

A request carries `model` = None for the default model (the first), else the id it named; so stored
rows, return_full and everything keyed on the request read as before for the default. The LoRA adapter
a model entry names (the base model plus a fine-tune, as its own id) rides on each of its requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgellm.api.chat_request import ChatRequest
from edgellm.api.dialects.openai_chat import ModelNotFound, unserved


@dataclass(frozen=True)
class ModelRoute:
    id: str
    lora_path: str | None = None
    lora_scale: float = 1.0


def route(request: ChatRequest, routes: tuple[ModelRoute, ...], *, strict: bool) -> ChatRequest:
    """`request` with its model resolved: None for the default, else a served id. An id the node does
    not serve is a 404 when it serves several models, or when `strict` (the OpenAI-style routes check
    it themselves); the seed routes of a one-model node accept and ignore it, as they always have."""
    name = request.model
    if name is None or name == routes[0].id:
        return request if name is None else request.model_copy(update={"model": None})
    if any(r.id == name for r in routes[1:]):
        return request
    if len(routes) == 1 and not strict:
        return request.model_copy(update={"model": None})
    raise ModelNotFound(f"The model {unserved(name, tuple(r.id for r in routes))}")


def lora_of(model: str | None, routes: tuple[ModelRoute, ...]) -> ModelRoute:
    """The route a request runs on (its LoRA adapter, if any)."""
    for r in routes:
        if r.id == (model or routes[0].id):
            return r
    return routes[0]

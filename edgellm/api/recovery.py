"""Restart recovery: the pending requests of earlier boots of this node, failed or sent again.

At start, before the engine admits anything, each pending row an earlier boot left is looked at once:
a synchronous one fails (its caller is gone), an async one is sent again from its record (its media
loaded from the stored sources, as at submission), unless the node no longer serves its model or its
media no longer loads. Rows of this boot are never touched, so requests that arrive meanwhile cannot
be failed or dispatched twice. Apart from the Service because it reads the registry by boot id, once,
and changes with what a restart keeps, not with how a live request is admitted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from edgellm.api.chat_request import ChatRequest
from edgellm.api.registry import Registry, RequestStatus
from edgellm.api.submission import ServiceConfig, load_media
from edgellm.errors import EdgeLLMError, ErrorType

log = logging.getLogger(__name__)


def recover(registry: Registry, config: ServiceConfig, send: Callable[[str, ChatRequest, int, float], None]) -> int:
    """Fail the synchronous pending rows of earlier boots and hand the async ones to `send(key, request,
    seed, created_at)` (the engine client sends them first once the worker is ready); how many were sent."""
    n = 0
    for rec in registry.pending_from_earlier_boots():
        if rec.mode != "async":
            registry.finish(
                rec.request_id,
                RequestStatus.FAILED,
                None,
                "the node restarted before this synchronous request finished",
                ErrorType.ENGINE_ERROR,
            )
            continue
        registry.bump_attempts(rec.request_id)
        request = ChatRequest.from_params(rec.params, rec.metadata)
        if request.model is not None and all(r.id != request.model for r in config.routes()):
            registry.finish(
                rec.request_id,
                RequestStatus.FAILED,
                None,
                f"the node no longer serves model {request.model!r}",
                ErrorType.MODEL_NOT_FOUND,
            )
            continue
        try:
            load_media(request, config, None)  # from the stored sources, as at submission
        except EdgeLLMError as exc:
            registry.finish(rec.request_id, RequestStatus.FAILED, None, exc.message, exc.error_type)
            continue
        send(rec.request_id, request, rec.seed, rec.created_at)
        n += 1
    if n:
        log.info("re-dispatching %d pending async request(s) from before the restart", n)
    return n

"""The work in flight when a worker becomes READY, after a start or a restart: each request's Delivery (in the
API's one RequestTable) is sent as a first run if no worker had it, sent again once if it was in a worker
that died, or given up, failed with an ErrorType, when that was its second loss or its deltas had already
reached the client (a stream cannot be replayed).

Separate from supervisor.py (when a worker starts, restarts or is given up): this is the rule for each
request across those events, the one place "a request lost twice fails" is decided.
"""

from __future__ import annotations

from edgellm.api.request_state import Delivery, RequestTable
from edgellm.engine.types import EngineOutput
from edgellm.errors import ErrorType

MAX_ATTEMPTS = 2  # the first run plus one retry after a worker crash


def plan_resend(requests: RequestTable, name: str) -> tuple[list[Delivery], list[Delivery], list[Delivery]]:
    """(to send, of which retries, given up) for the work in flight for worker `name`, in submission order.

    A request never delivered to a worker is a first run; one that was in a worker that died is
    retried once, unless its deltas already reached the client.
    """
    resend: list[Delivery] = []
    retried: list[Delivery] = []
    lost: list[Delivery] = []
    for entry in requests.deliveries(name):  # in submission order
        if not entry.sent:
            entry.sent = True
            resend.append(entry)
        elif entry.attempts >= MAX_ATTEMPTS or entry.streamed:
            requests.delivered(entry.request.request_id)
            lost.append(entry)
        else:
            requests.retried(entry)  # one attempt more, here and in the registry
            resend.append(entry)
            retried.append(entry)
    return resend, retried, lost


def lost_outputs(lost: list[Delivery]) -> list[EngineOutput]:
    """The final outputs of the requests plan_resend gave up, each saying why."""
    return [
        EngineOutput.failure(
            entry.request.request_id,
            "the engine worker crashed while streaming this request"
            if entry.streamed
            else "the engine worker crashed twice while running this request",
            ErrorType.ENGINE_ERROR,
        )
        for entry in lost
    ]

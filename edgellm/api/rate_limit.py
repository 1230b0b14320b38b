"""Per-caller request budget: N calls per calendar minute, then 429 with Retry-After.

The same rule as upstream edge_node's RATE_LIMIT_PER_MINUTE (base_inference_api.py at cdd016c): one
counter per subject for the current wall-clock minute (time // 60), reset when the minute turns; the
call that would exceed the budget is refused and not counted. The subject is what auth resolved: a
token's owner id (api/auth.py), or one shared "anonymous" subject on a node without tokens. Unlike
upstream the caller is told when to come back: Retry-After is the seconds left in the minute.

Framework-agnostic (no FastAPI): the HTTP routes call `hit()` once per work-making call, right where
auth has named the caller (runtime/server/http_common.py), so `edgellm serve` and the Ratio1 plugin apply it
alike.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from edgellm.errors import QueueFull

ANONYMOUS = "anonymous"


class RateLimited(QueueFull):
    """429 rate_limited with Retry-After: this caller's budget for the minute is spent."""


class RateLimiter:
    """`per_minute` calls per subject per calendar minute; 0 disables it (every hit passes).

    Memory stays bounded by the number of subjects seen in the current minute: a minute's counters are
    dropped as soon as another minute is counted (subjects are token owners, so few in practice).
    """

    def __init__(self, per_minute: int = 0, *, clock: Callable[[], float] = time.time):
        if per_minute < 0:
            raise ValueError("per_minute must be >= 0")
        self.per_minute = int(per_minute)
        self._clock = clock
        self._minute: int | None = None
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()  # the Ratio1 plugin and tests may call from several threads

    @property
    def enabled(self) -> bool:
        return self.per_minute > 0

    def hit(self, subject: str | None) -> None:
        """Count one call of `subject` (None = anonymous); RateLimited when its budget is spent."""
        if not self.enabled:
            return
        key = subject or ANONYMOUS
        now = self._clock()
        minute = int(now // 60)
        with self._lock:
            if minute != self._minute:  # a new minute: every budget is whole again
                self._minute, self._counts = minute, {}
            used = self._counts.get(key, 0)
            if used >= self.per_minute:
                # Seconds to the next minute, rounded up (1..60): a client that sleeps that long gets in.
                retry_after = max(1, math.ceil((minute + 1) * 60 - now))
                raise RateLimited(
                    f"rate limit exceeded: {self.per_minute} requests per minute for this caller; "
                    f"retry in {retry_after} s",
                    retry_after_s=retry_after,
                )
            self._counts[key] = used + 1

    def remaining(self, subject: str | None) -> int | None:
        """Calls left this minute for `subject` (None when no limit is set)."""
        if not self.enabled:
            return None
        with self._lock:
            if self._minute != int(self._clock() // 60):
                return self.per_minute
            return self.per_minute - self._counts.get(subject or ANONYMOUS, 0)

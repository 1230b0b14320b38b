"""systemd's notify protocol (sd_notify(3)): one datagram of KEY=VALUE lines to $NOTIFY_SOCKET.

Implemented from the documented socket message rather than a dependency: the PyPI wrappers are
unmaintained, and systemd-python needs libsystemd headers to build on a Jetson.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Mapping

log = logging.getLogger(__name__)


class Notifier:
    """Sends READY/STATUS/EXTEND_TIMEOUT_USEC/WATCHDOG/STOPPING when run under systemd (Type=notify); a
    no-op otherwise."""

    def __init__(self, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        self.address = address or None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() and (not pid or pid == str(os.getpid())) else None
        self._stop = threading.Event()

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: str | int) -> bool:
        if self.address is None:
            return False
        message = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message, self.address)
            return True
        except OSError as exc:
            log.warning("sd_notify to %r failed: %s", self.address, exc)
            return False

    def ready(self, status: str) -> None:
        self.notify(ready=1, status=status)

    def status(self, status: str) -> None:
        self.notify(status=status)

    def extend_start(self, seconds: float, status: str) -> None:
        """Before READY: systemd's start timeout (TimeoutStartSec) ends no sooner than `seconds` from now,
        so an engine start that is still retrying is not killed as "start operation timed out"."""
        self.notify(extend_timeout_usec=max(1, int(seconds * 1e6)), status=status)

    def stopping(self, status: str = "stopping: finishing in-flight requests") -> None:
        self._stop.set()
        self.notify(stopping=1, status=status)

    async def watchdog(self, healthy: Callable[[], Awaitable[bool]]) -> None:
        """Ping WATCHDOG=1 at half the configured interval, from the event loop, after `healthy()` passes.

        Running on the loop is the point: a wedged event loop (or a failing check) goes silent, and
        systemd restarts the node. A thread that only looked at the engine kept pinging for a dead API.
        """
        if self.address is None or self.watchdog_s is None:
            return
        interval = max(0.5, self.watchdog_s / 2)
        while not self._stop.is_set():
            await asyncio.sleep(interval)
            try:
                ok = await asyncio.wait_for(healthy(), timeout=interval)
            except Exception as exc:  # a check that raises or hangs is a failed check
                log.warning("watchdog health check failed: %r", exc)
                ok = False
            if ok and not self._stop.is_set():
                self.notify(watchdog=1)

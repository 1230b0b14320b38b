"""`edgellm serve`: the node in the foreground: the settings (file, EDGELLM_*, the flags of SERVE_FLAGS, which
`doctor` takes too), the engine worker prestarted before the API's imports, the app under uvicorn with the
header-timeout protocol, systemd told READY, STATUS, watchdog and stopping (runtime/server/sdnotify.py),
and the exit code: 0, 2 unusable settings or model file (cli.py), ENGINE_START_FAILED when the engine
could not start or come back.

The command layer (beside edgellm/cli.py, as cli_infer.py is): separate from the parser because how a
node is run as a service (signals, systemd, uvicorn's configuration) changes apart from the other commands.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any


def int_or_auto(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


SERVE_FLAGS: list[tuple[str, Any, str]] = [
    ("preset", str, "board preset: orin-nano, orin-nx-16gb, agx-orin-32gb, agx-orin-64gb, agx-thor (configs/models/)"),
    ("host", str, "address to bind (default 127.0.0.1)"),
    ("port", int, "port (default 8765)"),
    ("model-path", str, "GGUF file (default: the bundled SmolLM2-135M)"),
    ("model-name", str, "model id reported to clients"),
    ("mmproj-path", str, "multimodal projector GGUF for the model (images/audio in content arrays)"),
    ("n-ctx", int_or_auto, "total context (KV cells), split across slots; auto = sized to memory_budget"),
    ("n-slots", int_or_auto, "requests generated together; auto = 4, fewer when memory is short"),
    ("memory-budget", str, "memory the model, KV cache and buffers may use (e.g. 3GiB; default 75%% of MemAvailable)"),
    ("n-threads", int, "CPU threads for llama.cpp (0 = all free cores)"),
    ("n-gpu-layers", str, "'auto' or a number of layers to offload"),
    ("kv-cache-type", str, "f16 (default) or q8_0 (half the KV memory, ~5%% slower)"),
    ("response-format", str, "WRAPPED or RAW"),
    ("state-dir", str, "folder for the request registry"),
    ("request-timeout", float, "default per-request timeout (s)"),
    ("request-ttl", float, "seconds finished requests stay queryable"),
    ("max-queued", int, "in-flight requests before 429"),
    ("rate-limit-per-minute", int, "POST calls per caller (token) per minute before 429 (default 0: no limit)"),
    ("log-level", str, "debug, info, warning, error"),
]


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings SERVE_FLAGS gave on the command line (None: not given), by setting name."""
    return {flag.replace("-", "_"): getattr(args, flag.replace("-", "_")) for flag, _, _ in SERVE_FLAGS}


# `edgellm serve`'s exit code when the engine worker could not be started (2: unusable settings or model file).
ENGINE_START_FAILED = 3


def run_serve(args: argparse.Namespace) -> int:
    from edgellm.runtime.supervision import prestart

    # Before the API's imports (~1 s): the engine worker starts and imports llama.cpp meanwhile.
    prestart.prestart()
    try:
        return _serve_started(args)
    finally:
        prestart.discard()  # not taken: the settings were refused, or the engine never started


def _serve_started(args: argparse.Namespace) -> int:
    import uvicorn

    from edgellm.runtime.server.app import create_app
    from edgellm.runtime.server.http_guard import h11_protocol
    from edgellm.runtime.server.sdnotify import Notifier
    from edgellm.runtime.settings import load_settings

    settings = load_settings(args.config, **serve_overrides(args))
    settings.check_bind_safety()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    notifier = Notifier()
    ready: list[bool] = []  # READY=1 sent

    def on_ready(service) -> None:
        ready.append(True)
        info = service.engine_info()
        slots, cells = (info.n_slots, info.n_ctx) if info is not None else (None, None)
        offload = info.offload if info is not None else {}
        notifier.ready(
            f"serving {service.model_name} on {settings.host}:{settings.port}; {slots} slots over "
            f"a {cells}-cell KV pool; {offload.get('device')} (n_gpu_layers={offload.get('n_gpu_layers')})"
        )
        # Kept on the app so the task is not garbage-collected; cancelled with the loop at exit.
        app.state.watchdog = asyncio.get_running_loop().create_task(notifier.watchdog(service.live_check))

    failure: list[str] = []

    def on_failed(reason: str) -> None:
        # The engine will not start (its last attempt failed), or not come back after a crash (every
        # restart failed): a node answering 503 forever would look healthy to systemd. Stop serving
        # and exit non-zero, so Restart= and the journal see why. (Called from a worker thread.)
        failure.append(reason)
        server.should_exit = True

    def on_start_attempt(status: str, bound_s: float) -> None:
        # Each attempt may take the worker's ready timeout: systemd's TimeoutStartSec bounds the first,
        # this extends the start for the next, so serve itself gives up, exit 3 with its reason. After
        # READY=1 there is no start timeout to extend: the STATUS line alone.
        if ready:
            notifier.status(status)
        else:
            notifier.extend_start(bound_s, status)

    app = create_app(
        settings,
        on_ready=on_ready,
        on_stop=lambda service: notifier.stopping(),
        on_failed=on_failed,
        on_start_attempt=on_start_attempt,
    )

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGTERM/SIGINT: tell systemd and stop admitting at once
            app.state.service.draining = True
            app.state.drain.start(settings.shutdown_grace_s)  # then waiting requests get a JSON 503
            notifier.stopping()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        # h11 always (not httptools when installed): the header deadline lives in this protocol class.
        http=h11_protocol(settings.header_timeout_s),
        ws="none",
        h11_max_incomplete_event_size=16 * 1024,  # request line + headers
        # The Drain answers requests still waiting at shutdown_grace_s with a JSON 503; uvicorn's own
        # cancellation (a bare text 500) is only a backstop a little later.
        timeout_graceful_shutdown=settings.shutdown_grace_s + 2,
    )
    server = _Server(config)
    server.run()
    if failure:
        print(f"edgellm serve: {failure[0]}", file=sys.stderr)
        return ENGINE_START_FAILED
    return 0

"""The `edgellm` command: `serve` runs the node, `batch-run` sends a batch, `infer` runs a TensorRT-Edge-LLM
batch file in-process, `doctor` checks the engine on this machine, `ratio1-node` runs a Ratio1 node."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any

from edgellm.errors import EdgeLLMError


def _int_or_auto(value: str) -> int | str:
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
    ("n-ctx", _int_or_auto, "total context (KV cells), split across slots; auto = sized to memory_budget"),
    ("n-slots", _int_or_auto, "requests generated together; auto = 4, fewer when memory is short"),
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


# `edgellm serve`'s exit code when the engine worker could not be started (2: unusable settings or model file).
ENGINE_START_FAILED = 3


def _serve(args: argparse.Namespace) -> int:
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

    overrides = {flag.replace("-", "_"): getattr(args, flag.replace("-", "_")) for flag, _, _ in SERVE_FLAGS}
    settings = load_settings(args.config, **overrides)
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


# batch-run options that only mean something to the HTTP transport: refused with --local.
HTTP_ONLY_BATCH_FLAGS = ("endpoint", "concurrency", "timeout", "retries", "api_key")


def _batch_run(args: argparse.Namespace) -> int:
    import traceback

    from edgellm.batch.runner import BatchInputError, BatchOptions, load_requests, run_batch

    def refuse(message: str) -> int:
        print(f"edgellm batch-run: {message}", file=sys.stderr)
        return 2

    if args.local:
        given = [f"--{name.replace('_', '-')}" for name in HTTP_ONLY_BATCH_FLAGS if getattr(args, name) is not None]
        if given:
            return refuse(
                f"{', '.join(given)}: HTTP options, not used with --local (the in-process engine batches the "
                "requests itself; its settings come from --config and EDGELLM_*, as for `edgellm serve`)"
            )
    else:
        if args.config is not None:
            return refuse("--config is for --local (the in-process engine's settings)")
        if args.endpoint is None:
            return refuse("--endpoint URL is required (or --local to run on the in-process engine)")
        args.concurrency = 4 if args.concurrency is None else args.concurrency
        args.retries = 2 if args.retries is None else args.retries
        args.timeout = 600.0 if args.timeout is None else args.timeout
        if args.concurrency < 1 or args.retries < 0 or args.timeout <= 0:
            return refuse("--concurrency >= 1, --retries >= 0 and --timeout > 0 are required")
    src, out = Path(args.requests), Path(args.output)
    try:
        batch = load_requests(src)
        if out.exists() and src.exists() and out.samefile(src):
            raise BatchInputError(f"{out}: the results file would overwrite the requests file")
    except BatchInputError as exc:
        return refuse(exc.message)
    transport = phase = None
    if args.local:
        from edgellm.runtime.settings import load_settings
        from edgellm.runtime.supervision import crash_guard

        try:  # before the journal is touched: a bad config or model path is unusable input
            settings = load_settings(args.config, model_path=args.model)
            settings.resolved_model_path()
        except EdgeLLMError as exc:
            return refuse(exc.message)
        phase = crash_guard.child_recorder()
        if phase is None and crash_guard.available() and getattr(args, "argv", None):
            # The engine runs in a child: a native crash there ends with one line and the results kept.
            # The requests are read again only then: a large file is not held twice meanwhile.
            del batch
            return crash_guard.supervise("batch-run", args.argv, lambda crash: _batch_after_crash(src, out))
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)

        def transport():  # made by run_batch once the journal is checked, only if something is left to run
            from edgellm.batch.local import LocalTransport
            from edgellm.runtime.server.app import service_config

            try:
                return LocalTransport(
                    settings.model(),
                    service_config(settings),
                    settings.body_limit(),
                    override_model=args.model is not None,
                    on_phase=phase,
                    total=len(batch),
                )
            except EdgeLLMError as exc:
                raise BatchInputError(f"the local engine did not start: {exc.message}") from None

    opts = BatchOptions(
        endpoint=args.endpoint or "",
        concurrency=args.concurrency or 1,
        timeout_s=args.timeout or 600.0,
        retries=args.retries or 0,
        api_key=None if args.local else (args.api_key or os.environ.get("OPENAI_API_KEY")),
        model=None if args.local else args.model,
        progress=not args.quiet,
        resume=args.resume,
        overwrite=args.overwrite,
    )
    try:
        code = run_batch(batch, out, opts, transport)
    except BatchInputError as exc:  # the journal or the results file: nothing was sent
        print(f"edgellm batch-run: {exc.message}", file=sys.stderr)
        code = 2
    except OSError as exc:  # disk full, permissions: run_batch kept the journal and said so
        print(f"edgellm batch-run: {exc}", file=sys.stderr)
        code = -1
    except Exception:  # a bug: show it; the journal is kept (run_batch said so)
        traceback.print_exc()
        code = -1
    if code in (130, -1):
        # Ctrl-C or an error: the results are written; do not wait for requests still in flight
        # (the pool's threads would hold the exit for up to --timeout each).
        sys.stderr.flush()
        os._exit(1 if code == -1 else code)
    if phase is not None:  # the guarded child: a crash from here on (the engine's teardown at exit) is not the run's
        phase.finished(code, f"{out} was written" if code in (0, 1) else "")
    return code


def _batch_after_crash(src: Path, out: Path) -> str:
    """batch-run --local's salvage, in the guard's parent: `out` from the journal, as Ctrl-C writes it."""
    from edgellm.batch.runner import journal_path, load_requests, write_after_crash

    batch = load_requests(src)  # it was read before the child started; an error now is one in the crash line
    written = write_after_crash(batch, out)
    if written is None:
        return "no request had finished; nothing was written"
    journal = journal_path(out)
    return f"{written} of {len(batch)} results were written to {out}; {journal} is kept: --resume runs the rest"


def _synth(args: argparse.Namespace) -> int:
    """Exit 0 when OUTPUT holds COUNT valid records, 1 when fewer, 2 for unusable input, 130 on Ctrl-C."""
    from edgellm.synth.cli import run_synth_command

    return run_synth_command(args)


def _doctor(args: argparse.Namespace) -> int:
    """Exit 0 when the engine loads and passes its self-test here, 1 when it does not, 2 for bad settings."""
    from edgellm.runtime.doctor import run_doctor
    from edgellm.runtime.settings import load_settings

    overrides = {flag.replace("-", "_"): getattr(args, flag.replace("-", "_")) for flag, _, _ in SERVE_FLAGS}
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_doctor(load_settings(args.config, **overrides))


def _ratio1_node(args: argparse.Namespace) -> int:
    from edgellm.ratio1.launcher import run

    return run(args.venv, args.port, args.workdir, args.mqtt_port, args.pipelines)


def _ratio1_install(args: argparse.Namespace) -> int:
    from edgellm.ratio1.install import InstallError, install

    try:
        for line in install(args.app_dir, take_over=args.take_over_llm_inference_api):
            print(line)
    except InstallError as exc:
        print(f"edgellm ratio1-install: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgellm", description="LLM inference node for edge devices")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the node (HTTP API + engine worker)")
    serve.add_argument("--config", help="YAML settings file (e.g. configs/node.yaml)")
    for flag, typ, help_text in SERVE_FLAGS:
        serve.add_argument(f"--{flag}", type=typ, help=help_text)
    serve.set_defaults(func=_serve)

    batch = sub.add_parser(
        "batch-run",
        help="send requests.json to an OpenAI-compatible endpoint (or run it in-process: --local) -> results.jsonl",
    )
    batch.add_argument("requests", help='JSON file: {"requests": [{"id": ..., "messages": [...], ...}]}')
    batch.add_argument("-o", "--output", required=True, help="results file (JSON Lines, input order)")
    batch.add_argument(
        "--endpoint", help="e.g. http://127.0.0.1:8765/v1 (or the full chat URL); required without --local"
    )
    batch.add_argument(
        "--local",
        action="store_true",
        help="no server: run the requests on the in-process engine, answered as the node's /v1/chat/completions "
        "would answer them (same lines, journal, --resume and exit codes; and 3 when the engine crashed: one "
        "line says where, the finished lines are kept for --resume)",
    )
    batch.add_argument(
        "--config", help="with --local: YAML settings file, as for `edgellm serve` (model, slots, threads, limits)"
    )
    batch.add_argument("--concurrency", type=int, help="requests in flight (default 4; not with --local)")
    batch.add_argument(
        "--timeout",
        type=float,
        help="seconds per HTTP attempt (default 600); a request, retries and waits included, never takes "
        "longer than TIMEOUT x (RETRIES + 1) (not with --local: a request's own `timeout` field applies)",
    )
    batch.add_argument(
        "--retries",
        type=int,
        help="retries when the request never reached the server (connect error/timeout) or it answered "
        "429/502/503/504; Retry-After is honoured up to 60 s; a read timeout is not retried (default 2; "
        "not with --local)",
    )
    batch.add_argument("--api-key", help="Bearer token (default $OPENAI_API_KEY; not with --local)")
    batch.add_argument(
        "--model",
        help="override the model of every request; with --local: the GGUF file to load (default: model_path of "
        "the settings), every request then runs on it",
    )
    batch.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    journal = batch.add_mutually_exclusive_group()
    journal.add_argument(
        "--resume",
        action="store_true",
        help="keep the results of an earlier run of this output (OUTPUT.partial, or OUTPUT if that run finished) "
        "and send only the rest: ok lines and 4xx errors (except 408/429) are kept, the others sent again",
    )
    journal.add_argument(
        "--overwrite",
        action="store_true",
        help="discard the results in OUTPUT.partial and start over (without --resume or --overwrite, "
        "a run refuses to start when OUTPUT.partial holds results)",
    )
    batch.set_defaults(func=_batch_run)

    doctor = sub.add_parser(
        "doctor",
        help="check the engine on this machine: build flags, CPU features, memory plan, offload, and a real "
        "batched decode (the settings and flags of `serve`)",
    )
    doctor.add_argument("--config", help="YAML settings file, as for `edgellm serve`")
    for flag, typ, help_text in SERVE_FLAGS:
        doctor.add_argument(f"--{flag}", type=typ, help=help_text)
    doctor.set_defaults(func=_doctor)

    node = sub.add_parser(
        "ratio1-node",
        help="run an offline Ratio1 edge node (naeural-core + local mosquitto) serving this repo's plugins",
    )
    node.add_argument(
        "--venv", help="the node's venv (tools/ratio1_venv.sh; default $EDGELLM_RATIO1_PYTHON or this one)"
    )
    node.add_argument("--port", type=int, help="HTTP port of the first EDGELLM_INFERENCE_API instance (default 15080)")
    node.add_argument(
        "--workdir", help="the node's folder: configs, logs, identity key (default ~/.local/state/edgellm/ratio1-node)"
    )
    node.add_argument("--mqtt-port", type=int, help="local broker port (default 1883, or a free one if taken)")
    node.add_argument("--pipelines", help="folder of pipeline JSON files (default configs/ratio1/pipelines)")
    node.set_defaults(func=_ratio1_node)

    inst = sub.add_parser(
        "ratio1-install",
        help="add EDGELLM_INFERENCE_API to a stock edge node's app folder (beside upstream's LLM_INFERENCE_API)",
    )
    inst.add_argument("app_dir", help="the node's app folder: device.py and extensions/ (/edge_node in the image)")
    inst.add_argument(
        "--take-over-llm-inference-api",
        action="store_true",
        help="also make LLM_INFERENCE_API mean edgellm (upstream's file is kept as llm_inference_api.py.upstream); "
        "without it, an alias an earlier run wrote is removed",
    )
    inst.set_defaults(func=_ratio1_install)

    infer = sub.add_parser(
        "infer", help="run a TensorRT-Edge-LLM input JSON on the local engine (no server) -> output JSON"
    )
    from edgellm.cli_infer import add_infer_arguments, run_infer_command

    add_infer_arguments(infer)
    infer.set_defaults(func=run_infer_command)

    pull = sub.add_parser(
        "pull", help="download a model (a preset's, a URL, hf://ORG/NAME/FILE): resumable, sha256-checked"
    )
    from edgellm.pull.cli import add_pull_arguments, run_pull

    add_pull_arguments(pull)
    pull.set_defaults(func=run_pull)

    synth = sub.add_parser("synth", help="generate schema-valid synthetic JSON records through a node -> JSONL")
    from edgellm.synth.cli import add_synth_arguments

    add_synth_arguments(synth)
    synth.set_defaults(func=_synth)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # what a crash-guarded command (infer, batch-run --local) runs again in its child
    try:
        return args.func(args)
    except EdgeLLMError as exc:
        print(f"edgellm: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

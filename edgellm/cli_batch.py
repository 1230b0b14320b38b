"""`edgellm batch-run`: its arguments, their checks (HTTP options refused with --local, --config only with
it), and the run: requests.json over HTTP (batch/http_client.py) or on the in-process engine (--local:
the node's settings, batch/local.py, in a crash-guarded child whose native crash ends in one line and
results kept for --resume).

The command layer (beside edgellm/cli.py, as cli_infer.py is): it reads the node's settings and runs the
crash guard, both of the runtime, and hands batch/ only what they give; batch/ itself knows neither.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from edgellm.errors import EdgeLLMError


def add_batch_arguments(batch: argparse.ArgumentParser) -> None:
    """batch-run's arguments on its subparser (cli.py's build_parser)."""
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
    batch.add_argument(
        "--strict-model",
        action="store_true",
        help="with --local: a request naming a model the engine does not serve (nor an alias of it, "
        "model_aliases) fails with the node's 404 instead of running on the served model",
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


# batch-run options that only mean something to the HTTP transport: refused with --local.
HTTP_ONLY_BATCH_FLAGS = ("endpoint", "concurrency", "timeout", "retries", "api_key")


def run_batch_command(args: argparse.Namespace) -> int:
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
        if getattr(args, "strict_model", False):
            return refuse("--strict-model is for --local (against a node, the node's unknown_model setting decides)")
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
            from edgellm.runtime.server.node_config import service_config

            try:
                return LocalTransport(
                    settings.model(),
                    service_config(settings),
                    settings.body_limit(),
                    override_model=args.model is not None,
                    strict_model=args.strict_model,
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

"""`edgellm infer`: arguments, progress bar, files and exit codes over infer.runner.

The command layer (beside edgellm/cli.py, not in edgellm/infer/): it reads the node's settings and
runs the crash guard, both of the runtime, and hands infer.runner only the InferOptions they give.

Exit codes: 0 every request ok, 1 some request failed (the output file is complete), 2 unusable
input (nothing run, no output written), 3 the engine crashed (a native fault, e.g. SIGSEGV: one line
says where and what to do; the requests that finished are in the output, the others failed with the
crash; a crash at exit, after the output was written, only warns: the exit code is the run's), 130
interrupted.

The run happens in a child process (edgellm/runtime/supervision/crash_guard.py): a crash in llama.cpp kills that
process by a signal, and this one survives it to write what finished and say why.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily at run time: the guard's parent process stays light
    from edgellm.infer.contract import InferJob
    from edgellm.runtime.supervision.crash_guard import Crash, PhaseRecorder


def add_infer_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "exit codes: 0 every request ok, 1 some failed (the output is complete), 2 unusable input (no output), "
        "3 the engine crashed (one line says where and what to do; what finished is in the output, the rest "
        "failed), 130 interrupted (what finished is in the output, the rest cancelled)"
    )
    p.add_argument("--input", required=True, help="TensorRT-Edge-LLM input JSON (current or older format)")
    p.add_argument("--output", required=True, help="output JSON: {input_file, responses: [...]} in input order")
    p.add_argument("--model", help="GGUF file (default: model_path of the settings, else the bundled SmolLM2)")
    p.add_argument("--config", help="YAML settings file, as for `edgellm serve` (threads, GPU layers, KV type)")
    p.add_argument("--profile", help="write timings, tokens/s, reused prefix tokens and peak memory here (JSON)")
    p.add_argument("--batch-size", type=int, help="replaces the file's batch_size")
    p.add_argument("--max-generate-length", type=int, help="replaces the file's max_generate_length")
    p.add_argument("--num-logprobs", type=int, help="replaces the file's top-level num_logprobs (0-50)")
    p.add_argument("--warmup", type=int, default=0, help="untimed runs of the first request before the file")
    p.add_argument("--max-seq-len", type=int, default=2048, help="tokens per request, prompt + output (default 2048)")
    p.add_argument(
        "--lora-dir",
        action="append",
        default=[],
        help="folder LoRA adapters may be read from (repeatable; the input file's folder always is)",
    )
    p.add_argument(
        "--media-dir",
        action="append",
        default=[],
        help="folder image/audio files may be read from (repeatable; the input file's folder always is)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _fail(message: str) -> int:
    print(f"edgellm infer: {message}", file=sys.stderr)
    return 2


def _unwritable(path: str) -> str | None:
    """Why `path` cannot take the output, found before the run rather than after it."""
    target = Path(path)
    if target.is_dir():
        return f"{path} is a directory; give a file name"
    folder = target.parent
    while not folder.exists():  # write_json creates the missing folders
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write {path}: {folder} is not a writable folder"
    if target.exists() and not os.access(target, os.W_OK):
        return f"cannot write {path}: permission denied"
    return None


def write_json(path: str, document: dict[str, Any]) -> None:
    """Whole or not at all: a temp file in the same folder, then rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(document, f, ensure_ascii=False, indent=2)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_job(args: argparse.Namespace) -> InferJob:
    from edgellm.infer.contract import load_job

    return load_job(
        Path(args.input),
        batch_size=args.batch_size,
        max_generate_length=args.max_generate_length,
        num_logprobs=args.num_logprobs,
    )


def _after_crash(args: argparse.Namespace, crash: Crash) -> str:
    """In the parent, once the child crashed: the output document from its journal, as Ctrl-C writes it."""
    from edgellm.infer.journal import document_after_crash, journal_path, read_journal

    journal = journal_path(args.output)
    finished = read_journal(journal)
    if not finished:
        journal.unlink(missing_ok=True)
        return "no request had finished; no output written"
    # If this fails (the disk is full, the input file changed meanwhile) the journal stays: it is all there is.
    document = document_after_crash(_load_job(args), finished, f"not finished: {crash.describe()}")
    write_json(args.output, document)
    journal.unlink(missing_ok=True)
    done, rest = len(finished), len(document["responses"]) - len(finished)
    what = "1 finished request was" if done == 1 else f"{done} finished requests were"
    return f"{what} written to {args.output}" + (f" (the other {rest} are marked failed)" if rest else "")


def run_infer_command(args: argparse.Namespace) -> int:
    from edgellm.runtime.supervision import crash_guard

    phase = crash_guard.child_recorder()
    if phase is None and crash_guard.available() and getattr(args, "argv", None):
        from edgellm.infer.journal import journal_path

        journal = journal_path(args.output)

        def discard() -> None:
            try:
                journal.unlink(missing_ok=True)
            except OSError:  # not ours to remove (a folder, no permission): the child's checks will say why
                pass

        discard()  # an earlier run's, left by a process killed outright: never this run's responses
        return crash_guard.supervise("infer", args.argv, lambda crash: _after_crash(args, crash), discard=discard)
    return _run(args, phase)


def _run(args: argparse.Namespace, phase: PhaseRecorder | None) -> int:
    """The command itself; `phase`: the guarded child's PhaseRecorder (None when run unguarded)."""
    from tqdm import tqdm

    from edgellm.errors import EdgeLLMError
    from edgellm.infer.journal import ResponseJournal
    from edgellm.infer.runner import InferOptions, run_job
    from edgellm.runtime.settings import load_settings

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    if args.warmup < 0:
        return _fail("--warmup must be >= 0")
    if not 64 <= args.max_seq_len <= 1 << 20:
        return _fail("--max-seq-len must be in [64, 1048576]")
    try:
        job = _load_job(args)
        settings = load_settings(args.config, model_path=args.model)
        options = InferOptions(
            model=settings.model(),
            max_seq_len=args.max_seq_len,
            warmup=args.warmup,
            lora_dirs=tuple(args.lora_dir),
            media_dirs=(*settings.media_dirs, *args.media_dir),
            media_limits=settings.media_limits(),
        )
    except EdgeLLMError as exc:
        return _fail(exc.message)
    problem = _unwritable(args.output) or (args.profile and _unwritable(args.profile))
    if problem:
        return _fail(problem)
    bar = tqdm(
        total=len(job.items), unit="req", desc="infer", file=sys.stderr, disable=args.quiet or not sys.stderr.isatty()
    )
    # Guarded: each final response goes to the journal too, for the parent to write if this process dies.
    journal = ResponseJournal(args.output) if phase is not None else None
    try:
        try:
            result = run_job(
                job,
                options,
                on_request_done=lambda: bar.update(1),
                on_phase=phase,
                on_response=journal.append if journal is not None else None,
            )
        except KeyboardInterrupt:  # before the engine ran (loading the model)
            print("edgellm infer: interrupted; no output written", file=sys.stderr)
            return 130
        except EdgeLLMError as exc:  # the model could not be loaded, ...
            return _fail(exc.message)
        finally:
            bar.close()
        try:
            write_json(args.output, result.document)
            if args.profile:
                write_json(args.profile, result.profile)
        except OSError as exc:  # checked before the run, but the disk can fill up meanwhile
            print(f"edgellm infer: cannot write the output: {exc}", file=sys.stderr)
            return 1
    finally:
        if journal is not None:  # this process ends normally: nobody will read it
            journal.remove()
    code = 0
    if result.interrupted:
        print(f"edgellm infer: interrupted; unfinished requests are `cancelled` in {args.output}", file=sys.stderr)
        code = 130
    elif result.failed:
        print(f"edgellm infer: {result.failed} of {len(job.items)} requests failed; see {args.output}", file=sys.stderr)
        code = 1
    if phase is not None:  # the guarded child: a crash from here on (the engine's teardown at exit) is not the run's
        phase.finished(code, f"{args.output} was written")
    return code

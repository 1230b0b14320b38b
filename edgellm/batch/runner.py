"""`edgellm batch-run`: requests.json -> results.jsonl against any OpenAI-compatible chat endpoint,
or (`--local`, batch/local.py) on the in-process engine, answered as the node's OpenAI route would.

Everything but the sending is shared: a `Transport` (HTTP: `HttpTransport`; local: `LocalTransport`)
turns pending requests into result lines, and run_batch journals, orders, resumes and exits alike.

This module is the run; its pieces are inputs.py (the requests file, the options), http_client.py
(one POST with its retries), transport.py (the Transport protocol, the HTTP one) and journal.py.

Each finished request is appended to the journal `<out>.partial` at once (a crash loses nothing
already done); at the end, and on Ctrl-C, `<out>` is written in input order with what finished.
The journal is removed only after a run that finished every request has written `<out>` in full;
after Ctrl-C, a crash or an error it stays, and `--resume` sends only what it does not hold as
finished. A plain rerun refuses to touch a non-empty journal (`--overwrite` discards it).

Exit codes: 0 all ok, 1 some failed (the file is still complete) or the run stopped on an error
(the journal is kept), 2 unusable input, 3 the engine crashed (--local: a native fault such as
SIGSEGV; `<out>` is written from the journal by the surviving parent, write_after_crash, and the
journal is kept for --resume), 130 interrupted.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

# The pieces, re-exported: callers and tests name them as `runner.X` (one place to import from).
from edgellm.batch.http_client import (  # noqa: F401
    BACKOFF_BASE_S,
    BACKOFF_MAX_S,
    MAX_RETRY_AFTER_S,
    RETRY_AFTER_STATUSES,
    RETRY_STATUSES,
    Sender,
    answer_outcome,
    chat_url,
    error_message,
    never_sent,
    retry_after_s,
    wire_body,
)
from edgellm.batch.http_client import backoff_s as _backoff_s  # noqa: F401
from edgellm.batch.inputs import BatchInputError, BatchOptions, load_requests  # noqa: F401
from edgellm.batch.journal import Journal, dumps, encoded, is_finished, journal_path, write_after_crash, write_lines  # noqa: F401
from edgellm.batch.journal import id_key as _id_key
from edgellm.batch.transport import Deliver, HttpTransport, Transport  # noqa: F401

_Sender = Sender  # the name tests patch (the same class object)


def run_batch(
    batch: list[dict[str, Any]],
    out: Path,
    opts: BatchOptions,
    transport: Callable[[], Transport] | None = None,
) -> int:
    """Run `batch` into `out` (see the module doc); `transport` makes the sender (default: HTTP to
    opts.endpoint). It is made only after the journal is checked, and only when something is left
    to send: a refused rerun or a resume with nothing to do never loads a model."""
    out = Path(out)
    journal = Journal(out, opts)  # BatchInputError before anything is sent
    texts: dict[int, str] = {}
    failed: set[int] = set()
    for i, req in enumerate(batch):
        line = journal.earlier.get(_id_key(req["id"]))
        if opts.resume and line is not None and is_finished(line):
            texts[i] = dumps(line)
            if line["status"] != "ok":
                failed.add(i)
    kept = len(texts)
    todo = [(i, req) for i, req in enumerate(batch) if i not in texts]
    try:
        sender = (transport or (lambda: HttpTransport(opts)))() if todo else None
    except KeyboardInterrupt:  # e.g. while the local engine loads: nothing was sent, nothing changed
        journal.close(discard_if_empty=True)
        print("edgellm batch-run: interrupted before anything was sent", file=sys.stderr)
        return 130
    except BaseException:
        journal.close(discard_if_empty=True)  # nothing was sent: leave no empty journal behind
        raise
    bar = tqdm(
        total=len(batch),
        initial=kept,
        file=sys.stderr,
        unit="req",
        disable=not opts.progress or not sys.stderr.isatty(),
        dynamic_ncols=True,
    )

    def deliver(i: int, result: dict[str, Any]) -> None:
        line, text = encoded(result)
        journal.append(text)  # first: a crash right after still has this result
        texts[i] = text
        bar.update(1)
        if line["status"] != "ok":
            failed.add(i)
            bar.set_postfix(failed=len(failed))

    interrupted = False
    try:
        if sender is not None:
            sender.run(todo, deliver)
    except KeyboardInterrupt:
        interrupted = True
    except BaseException:
        # Anything else is a bug or the disk failing: keep the journal (it is the record of what was
        # paid for), write what finished, say how to continue, and let the error through.
        if sender is not None:
            sender.close(abandon=True)
        bar.close()
        journal.close()
        try:
            write_lines(out, [texts[i] for i in sorted(texts)])
        except OSError:
            pass
        print(
            f"edgellm batch-run: stopped by an error; {len(texts)} of {len(batch)} written to {out}; "
            f"the journal {journal.path} is kept: rerun with --resume to send the rest",
            file=sys.stderr,
        )
        raise
    bar.close()
    if interrupted:
        if sender is not None:
            sender.close(abandon=True)
        journal.close()
        write_lines(out, [texts[i] for i in sorted(texts)])
        print(
            f"edgellm batch-run: interrupted; {len(texts)} of {len(batch)} written to {out}; "
            "rerun with --resume to send the rest",
            file=sys.stderr,
        )
        return 130
    if sender is not None:
        sender.close(abandon=False)
    try:
        write_lines(out, [texts[i] for i in range(len(batch))])
    except BaseException:
        journal.close()
        raise
    journal.remove()  # only now: every result is safely in <out>
    note = f" ({kept} kept from the earlier run)" if kept else ""
    print(f"edgellm batch-run: {len(batch) - len(failed)} ok, {len(failed)} failed -> {out}{note}", file=sys.stderr)
    return 1 if failed else 0

"""`edgellm infer`'s journal: each final response, one JSON line, as it ends, in `<output>.partial`.

infer writes its output document once, at the end; a native crash of the engine (see
edgellm/runtime/supervision/crash_guard.py) would lose every response that finished before it. So the guarded
child appends each final response here (flushed per line: a dying process loses no completed write),
and the parent, which survives the crash, builds the document from it as Ctrl-C would: the finished
responses kept, the others failed with the crash as their error. The journal is removed once the
document is written, by the child after a normal end and by the parent after a crash.

Nothing here loads llama.cpp: the parent imports it (the runner imports failed_response from here).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import IO, Any

from edgellm.infer.contract import InferItem, InferJob

log = logging.getLogger(__name__)


def journal_path(output: str | Path) -> Path:
    out = Path(output)
    return out.with_name(out.name + ".partial")


class ResponseJournal:
    """The guarded child's writer. The file is made at the first response (with the output's folders,
    which write_json would make): no response, no journal, and the parent writes nothing. infer has no
    --resume, so an earlier run's journal is never read: the parent removes it before the child starts.
    A write that fails (disk full) turns the journal off with one warning; the run goes on."""

    def __init__(self, output: str | Path):
        self.path = journal_path(output)
        self._f: IO[str] | None = None
        self._off = False  # a write failed: no more journaling (see append)

    def append(self, response: dict[str, Any]) -> None:
        if self._off:
            return
        try:
            if self._f is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._f = open(self.path, "w", encoding="utf-8")
            # ASCII escapes: any text the model produced (a lone surrogate included) can be written.
            self._f.write(json.dumps(response) + "\n")
            self._f.flush()  # to the kernel: a process that dies now loses nothing written
        except OSError as exc:
            # The disk is full, the folder went away: the run goes on, its output written at the end is
            # what matters. What the journal holds is still read after a crash (a torn line is skipped).
            self._off = True
            self._close()
            log.warning(
                "cannot write the journal %s (%s): the run goes on, but a crash of the engine would now lose "
                "the responses that finish from here on",
                self.path,
                exc.strerror or exc,
            )

    def _close(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()  # flushes what a failed write left in the buffer: that can fail again
            except OSError:
                pass

    def remove(self) -> None:
        self._close()
        try:
            self.path.unlink(missing_ok=True)
        except OSError:  # its folder is gone or not one: nothing to remove, and no reason to fail the run
            pass


def read_journal(path: Path) -> dict[int, dict[str, Any]]:
    """The responses a journal holds, by request_idx; a torn last line (the writer died in it) is skipped."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return {}
    found: dict[int, dict[str, Any]] = {}
    for line in text.splitlines():
        try:
            response = json.loads(line)
        except ValueError:
            continue
        if isinstance(response, dict) and isinstance(response.get("request_idx"), int):
            found[response["request_idx"]] = response
    return found


def failed_response(item: InferItem, error: str, *, reason: str = "error", formatted: str = "") -> dict[str, Any]:
    """The response of a request that did not run to its end; `formatted`: its prompt after the chat
    template ("" when it has none, or when whoever writes it has no model to render it with)."""
    return {
        "output_text": "",
        "request_idx": item.request_idx,
        "batch_idx": item.batch_idx,
        "messages": item.messages,
        "formatted_complete_request": formatted,
        "finish_reason": reason,
        "error": error,
    }


def document_after_crash(job: InferJob, finished: dict[int, dict[str, Any]], error: str) -> dict[str, Any]:
    """The output document of a run that crashed: what finished, and the rest failed with `error`.

    formatted_complete_request of the failed ones is "": the chat template is in the model, and the
    process writing this never loads one (that is why it survived).
    """
    responses = [finished.get(item.request_idx) or failed_response(item, error) for item in job.items]
    return {"input_file": job.input_file, "responses": responses}

"""The guide checker's child process: compiles and checks guides for the API process.

A schema, regex or grammar is a client's program: llguidance's compile of a hostile one can take
minutes and gigabytes (320 patternProperties: 11 s; an anyOf of 80 counted strings: 1.6 GB), and native
code cannot be interrupted from a Python thread. So the API process never compiles one itself: it sends
the guide here and kills this process when the job spends its CPU or memory budget
(edgellm/api/guide_pool.py). Nothing here is shared with the engine worker.

Protocol: one JSON line in per job, one JSON line out.
- `{"check": [[label, kind, spec, strict], ...]}` -> `{"ok": true}` or `{"error": message, "label": label}`: what
  `grammar_for` says of each guide, in order, stopping at the first refusal.
- `{"satisfies": [kind, spec, text]}` -> `{"satisfies": bool}` or `{"error": message}`.

    python -m edgellm.engine.guide_sandbox
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time

from edgellm.engine.guide_llguidance import grammar_for, text_satisfies
from edgellm.engine.types import GuideKind, GuideSpec
from edgellm.errors import GuideError

# A child recycles itself (exits between jobs, the parent starts another) once it has used this much
# CPU; RLIMIT_CPU is set a little above, so that a child whose parent died mid-job cannot spin forever,
# while a job of a living parent (killed by it at its budget) never reaches the limit.
RECYCLE_CPU_S = 300
CPU_LIMIT_S = RECYCLE_CPU_S + 120


def _spec(kind: str, spec: object) -> GuideSpec:
    return GuideSpec(GuideKind(kind), spec)


def answer(job: dict) -> dict:
    """One job's answer (see the module doc)."""
    try:
        if "satisfies" in job:
            kind, spec, text = job["satisfies"]
            return {"satisfies": text_satisfies(_spec(kind, spec), text)}
        for label, kind, spec, strict in job["check"]:
            try:
                grammar_for(_spec(kind, spec), strict=bool(strict))
            except GuideError as exc:
                return {"error": exc.message, "label": label}
        return {"ok": True}
    except GuideError as exc:
        return {"error": exc.message}
    except Exception as exc:  # a bug or an llguidance surprise: this job's failure, said in words
        return {"error": f"the guide could not be checked ({type(exc).__name__}: {str(exc)[:200]})"}


def _watch_parent(parent: int) -> None:
    """Exit when the API process is gone (its pipe closing is seen only between jobs)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def _limit_memory(budget_bytes: int) -> None:
    """Address space: what is mapped now (the interpreter, llguidance) plus the budget. An allocation past
    it fails inside llguidance, which aborts: the parent reads the death as the budget spent."""
    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = mapped + budget_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (OSError, ValueError):
        pass  # not Linux, or the limit is already lower: the parent's RSS watch still applies


def main() -> None:
    budget = int(os.environ.get("EDGELLM_GUIDE_MEMORY_BYTES", str(1 << 30)))
    parent = int(os.environ.get("EDGELLM_GUIDE_PARENT", str(os.getppid())))
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="parent-watch").start()
    try:
        resource.setrlimit(resource.RLIMIT_CPU, (CPU_LIMIT_S, resource.RLIM_INFINITY))
    except (OSError, ValueError):
        pass
    _limit_memory(budget)
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            job = json.loads(line)
        except ValueError:
            reply = {"error": "the guide checker was sent a line that is not JSON"}
        else:
            reply = answer(job)
        out.write(json.dumps(reply) + "\n")
        out.flush()
        if time.process_time() > RECYCLE_CPU_S:
            return  # see RECYCLE_CPU_S: the parent starts a fresh child for the next job


if __name__ == "__main__":
    main()

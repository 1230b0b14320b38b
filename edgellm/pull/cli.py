"""`edgellm pull PRESET | URL | hf://ORG/NAME/FILE [--sha256 HEX] [--dest DIR]`: the one command that
downloads (`serve` never does). Exit 0 when every file is in place and verified where a hash is
known, 1 when a download or a check failed (what was fetched so far stays as a .part to resume), 2 for
a spec it cannot use."""

from __future__ import annotations

import argparse
import sys

import httpx

from edgellm.errors import PullError
from edgellm.pull.fetch import fetch
from edgellm.pull.sources import plan


def add_pull_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="a board preset (orin-nano, ...), an http(s) URL, or hf://ORG/NAME/FILE")
    parser.add_argument("--sha256", help="the expected sha256 of the file (the first part of a split GGUF)")
    parser.add_argument(
        "--dest",
        help="the folder to put it in (default: the preset's model folder, else ~/.local/share/edgellm/models)",
    )
    parser.add_argument("--revision", default="main", help="the Hugging Face revision: branch, tag or commit")
    parser.add_argument("--retries", type=int, default=8, help="retries of a dropped transfer in this run")


def run_pull(args: argparse.Namespace) -> int:
    try:
        target = plan(args.spec, dest=args.dest, sha256=args.sha256, revision=args.revision)
    except PullError as exc:
        print(f"edgellm pull: {exc.message}", file=sys.stderr)
        return 2
    timeout = httpx.Timeout(30.0, read=60.0)
    try:
        with httpx.Client(follow_redirects=True, timeout=timeout, headers={"User-Agent": "edgellm-pull"}) as client:
            for remote in target.files:
                done = fetch(remote, target.dest, client=client, retries=max(0, args.retries))
                check = (
                    f"sha256 {done.sha256} checked against {done.verified_by}"
                    if done.verified_by
                    else (
                        f"sha256 {done.sha256} (nothing to check it against: pass --sha256)"
                        if done.sha256
                        else "not checked (no sha256 known: pass --sha256)"
                    )
                )
                print(f"{done.path}: {done.how}, {done.size} bytes; {check}")
    except PullError as exc:
        print(f"edgellm pull: {exc.message}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:  # one not retried (e.g. a malformed URL the client refuses)
        print(f"edgellm pull: {args.spec}: {exc}", file=sys.stderr)
        return 1
    print(f"model_path: {target.model_path}")
    return 0

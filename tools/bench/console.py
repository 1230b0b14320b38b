#!/usr/bin/env python
"""What the console page costs: bytes to load it, bytes per refresh, and the added CPU of an open
console on an idle node (API process + engine worker + the browser, same run, same machine).

Starts a node (bundled model), measures the node's CPU over --seconds with no page open (baseline),
then again with the console open in headless Chromium on the Status tab (it refreshes once a second).

    python tools/bench/console.py [--seconds 30]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.servers import EdgellmNode, run_main  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its waited-for children, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / TICK


def node_cpu(node: EdgellmNode) -> float:
    pids = [node.proc.pid]
    worker = node.engine().get("worker_pid")
    if worker:
        pids.append(worker)
    return sum(cpu_seconds(p) for p in pids)


def measure(node: EdgellmNode, seconds: float, wait=time.sleep) -> float:
    """The node's CPU (% of one core) over `seconds`; `wait` sleeps (a page's, so its events are handled)."""
    start, t0 = node_cpu(node), time.monotonic()
    wait(seconds)
    return 100 * (node_cpu(node) - start) / (time.monotonic() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0)
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as state:
        node = EdgellmNode(Path(state)).start()
        try:
            time.sleep(3)  # the warm-up request and first pings settle
            idle = measure(node, args.seconds)
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
                page = browser.new_page()
                loaded: dict[str, int] = {}
                traffic = [0]

                def record(response) -> None:
                    try:
                        size = len(response.body()) if response.ok else 0
                    except Exception:  # the page closed under it
                        return
                    loaded[response.url] = size
                    traffic[0] += size

                page.on("response", record)
                page.goto(node.base + "/")
                page.wait_for_function("() => document.getElementById('s-model').textContent !== '-'")
                time.sleep(2)
                first_load = {u: n for u, n in loaded.items() if u.endswith(("/", ".js", ".css"))}
                traffic[0] = 0
                browser_start = time.monotonic()
                with_page = measure(node, args.seconds, lambda s: page.wait_for_timeout(1000 * s))
                per_second = traffic[0] / (time.monotonic() - browser_start)
                browser.close()
        finally:
            node.stop()
    total = sum(first_load.values())
    print(
        f"page load: {total / 1024:.1f} KiB in {len(first_load)} files ("
        + ", ".join(f"{Path(u).name or 'index'} {n / 1024:.1f}" for u, n in first_load.items())
        + ")"
    )
    print(f"refresh traffic: {per_second / 1024:.1f} KiB/s (/status + /metrics once a second)")
    print(
        f"node CPU idle: {idle:.2f}% of one core; with the console open: {with_page:.2f}% "
        f"(+{with_page - idle:.2f} points, {with_page / max(idle, 0.01):.1f}x)"
    )
    return 0


if __name__ == "__main__":
    run_main(main)

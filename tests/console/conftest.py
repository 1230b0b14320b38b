"""Headless Chromium (the Debian package, driven by Playwright for Python) against a real node."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.nodeproc import NodeProcess
from tests.process_hygiene import release, watch_descendants

ARTIFACTS = Path(os.environ.get("EDGELLM_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
TOKEN = "console-test-token"


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.fail("no Chromium on this machine: `make system-deps` installs the Debian package chromium")


# Module scope: Playwright's sync API keeps an event loop running in this thread while it is open, and
# later tests that call asyncio.run() must not find it there.
@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # The system's Chromium, not a downloaded one: tests never reach the network.
        instance = pw.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        # Playwright's driver and the browser's process group die with the test run, even a SIGKILLed one.
        watched = watch_descendants()
        yield instance
        instance.close()
    for ident in watched:
        release(ident)


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    yield page
    context.close()


@pytest.fixture(scope="module")
def open_node(tmp_path_factory):
    node = NodeProcess(tmp_path_factory.mktemp("console-node")).start()
    yield node
    node.stop()


@pytest.fixture(scope="module")
def token_node(tmp_path_factory):
    node = NodeProcess(tmp_path_factory.mktemp("console-token-node"), env={"EDGELLM_TOKENS": TOKEN}).start()
    yield node
    node.stop()


def screenshot(page, name: str) -> Path:
    """Saved as a test artifact (test-artifacts/console/, or $EDGELLM_TEST_ARTIFACTS/console/)."""
    path = ARTIFACTS / "console" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
    return path

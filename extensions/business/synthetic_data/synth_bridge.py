"""The logic of the SYNTHETIC_DATA_GENERATOR plugin (plugins/business/synthetic_data/), kept out of it.

User plugins under `plugins.*` are code-safety checked by the node: they may import only modules named
like `naeural_core.business` / `extensions.business`, and may not use open(), getattr(), `.log`, ...
So the plugin is a thin class and everything it does lives here: config checking, the generator run
on a background thread (edgellm.synth.generator, the same core as `edgellm synth`), and the progress
fields the plugin sends in its payloads. Nothing here imports naeural_core: it is unit-tested without it.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import requests

from edgellm import jsonsafe
from edgellm.synth.generator import SynthOptions, SynthProgress, SynthSummary, generate
from edgellm.synth.schema import SynthInputError, check_schema

PLUGIN_DEFAULTS: dict[str, Any] = {
    "SCHEMA": None,  # the JSON schema (an object, or a JSON string of one): required
    "PROMPT_TEMPLATE": None,  # {index}, {fields}, {schema} placeholders; None: the generator's default
    "COUNT": 100,  # valid, unique records wanted in the output file
    "TEMPERATURE": 0.9,
    "SEED": 0,  # per-record seeds derive from it
    "MAX_TOKENS": 512,
    "CONCURRENCY": 4,
    "API_HOST": "127.0.0.1",
    "API_PORT": 15080,  # the EDGELLM_INFERENCE_API instance's PORT on this node
    "TOKEN": None,  # bearer token, when the API instance requires one
    "OUTPUT_FILE": None,  # relative to <output folder>/synthetic_data/; None: <plugin id>.jsonl
    "REQUEST_TIMEOUT": 600,  # seconds per request
    "MAX_ATTEMPTS": None,  # None: 3 x COUNT
    "PROGRESS_INTERVAL": 5,  # seconds between progress payloads while running
    "API_WAIT": 600,  # seconds to wait for the API's GET /health to answer 200 (it starts after the plugins)
}
SUBFOLDER = "synthetic_data"


def options_from_config(config: dict[str, Any]) -> tuple[dict[str, Any], SynthOptions]:
    """(schema, options) from the plugin config; SynthInputError with the key named for a bad value."""
    cfg = {**PLUGIN_DEFAULTS, **{str(k).upper(): v for k, v in config.items()}}
    schema = cfg["SCHEMA"]
    if schema is None:
        raise SynthInputError("SCHEMA is required (a JSON schema object)")
    if isinstance(schema, str):
        try:
            schema = jsonsafe.loads(schema)
        except jsonsafe.JSONProblem as exc:
            where = jsonsafe.json_path(exc.parts, relative=True)
            raise SynthInputError(f"SCHEMA is a string but not JSON: SCHEMA{where} {exc.problem}") from None
    check_schema(schema, where="SCHEMA")
    port = cfg["API_PORT"]
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise SynthInputError(f"API_PORT must be a port number, got {port!r}")
    host = str(cfg["API_HOST"] or "127.0.0.1")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    opts = SynthOptions(
        count=cfg["COUNT"],
        endpoint=f"http://{host}:{port}",
        prompt_template=cfg["PROMPT_TEMPLATE"],
        temperature=cfg["TEMPERATURE"],
        seed=cfg["SEED"],
        max_tokens=cfg["MAX_TOKENS"],
        concurrency=cfg["CONCURRENCY"],
        token=cfg["TOKEN"] or None,
        timeout_s=float(cfg["REQUEST_TIMEOUT"]),
        max_attempts=cfg["MAX_ATTEMPTS"],
    )
    try:
        opts.check()
    except SynthInputError as exc:  # name the config key, not the option
        key = exc.message.split(" ", 1)[0].upper()
        raise SynthInputError(f"{key}: {exc.message}") from None
    return schema, opts


def output_path(output_folder: str | Path, plugin_id: str, output_file: str | None = None) -> Path:
    """<output folder>/synthetic_data/<OUTPUT_FILE or plugin id>.jsonl, never outside that folder."""
    base = Path(output_folder) / SUBFOLDER
    name = output_file or re.sub(r"[^A-Za-z0-9_.-]", "_", plugin_id) + ".jsonl"
    path = (base / name).resolve()
    if base.resolve() not in path.parents:
        raise SynthInputError(f"OUTPUT_FILE {output_file!r} must stay inside {base}")
    return path


class SynthJob:
    """One generator run on a daemon thread; `poll()` says what to report, `stop()` ends it."""

    def __init__(self, config: dict[str, Any], output_folder: str | Path, plugin_id: str):
        self.state = "starting"
        self.error: str | None = None
        self.progress: SynthProgress | None = None
        self.summary: SynthSummary | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last_sent: tuple | None = None
        self._last_sent_at = 0.0
        cfg = {str(k).upper(): v for k, v in config.items()}
        self.interval = float(cfg.get("PROGRESS_INTERVAL") or PLUGIN_DEFAULTS["PROGRESS_INTERVAL"])
        wait_s = cfg.get("API_WAIT")
        self.api_wait_s = float(PLUGIN_DEFAULTS["API_WAIT"] if wait_s is None else wait_s)
        self.path: Path | None = None
        try:
            self.schema, self.opts = options_from_config(cfg)
            self.path = output_path(output_folder, plugin_id, cfg.get("OUTPUT_FILE"))
        except SynthInputError as exc:
            self.state, self.error = "config_error", exc.message

    def start(self) -> SynthJob:
        if self.state == "starting":
            self.state = "waiting_for_api"
            self._thread = threading.Thread(target=self._run, name="synth-job", daemon=True)
            self._thread.start()
        return self

    def _on_progress(self, progress: SynthProgress) -> None:
        with self._lock:
            self.progress = progress

    def _wait_for_api(self) -> bool:
        """True once GET /health answers 200: on a node the API plugin comes up well after this one."""
        deadline = time.monotonic() + self.api_wait_s
        headers = {"Authorization": f"Bearer {self.opts.token}"} if self.opts.token else {}
        while True:
            try:
                if requests.get(self.opts.endpoint + "/health", headers=headers, timeout=5).status_code == 200:
                    return True
            except requests.RequestException:
                pass
            if time.monotonic() >= deadline or self._stop.wait(1.0):
                return False

    def _run(self) -> None:
        if not self._wait_for_api():
            if not self._stop.is_set():
                self.state = "failed"
                self.error = f"{self.opts.endpoint}/health did not answer 200 within {self.api_wait_s:g} s"
            else:
                self.state = "stopped"
            return
        self.state = "running"
        try:
            summary = generate(self.schema, self.path, self.opts, on_progress=self._on_progress, stop=self._stop)
        except SynthInputError as exc:
            self.state, self.error = "config_error", exc.message
            return
        except Exception as exc:  # noqa: BLE001 - the node must see the reason in a payload, not a dead thread
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            return
        with self._lock:
            self.summary = summary
            self.progress = summary
        self.error = summary.error
        if summary.complete:
            self.state = "done"
        elif summary.interrupted:
            self.state = "stopped"
        else:
            self.state = "failed"

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed", "stopped", "config_error")

    def fields(self) -> dict[str, Any]:
        """The payload fields (upper-case, as the node's payloads carry them)."""
        with self._lock:
            p = self.progress
        out: dict[str, Any] = {
            "SYNTH_STATUS": self.state,
            "SYNTH_COUNT": self.opts.count if self.state != "config_error" else None,
            "SYNTH_OUTPUT_FILE": str(self.path) if self.path else None,
            "SYNTH_ERROR": self.error,
        }
        if p is not None:
            out.update(
                SYNTH_VALID=p.valid,
                SYNTH_NEW_VALID=p.new_valid,
                SYNTH_INVALID=p.invalid,
                SYNTH_DUPLICATES=p.duplicates,
                SYNTH_FAILED=p.failed,
                SYNTH_ATTEMPTS=p.attempts,
                SYNTH_RETRIED=p.retried,
                SYNTH_ELAPSED_S=round(p.elapsed_s, 2),
                SYNTH_RECORDS_PER_MIN=round(p.records_per_min, 2),
            )
        return out

    def poll(self, now: float | None = None) -> dict[str, Any] | None:
        """The fields to send now, or None: on a state change at once, else on new progress every `interval` s."""
        now = time.monotonic() if now is None else now
        fields = self.fields()
        key = (fields["SYNTH_STATUS"], fields.get("SYNTH_VALID"), fields.get("SYNTH_ATTEMPTS"))
        if key == self._last_sent:
            return None
        state_changed = self._last_sent is None or key[0] != self._last_sent[0]
        if not state_changed and now - self._last_sent_at < self.interval:
            return None
        self._last_sent, self._last_sent_at = key, now
        return fields

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

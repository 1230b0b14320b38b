"""EDGELLM_INFERENCE_API: edgellm's inference API, served from inside a Ratio1 (naeural-core) edge node.

naeural_core finds a business plugin by its signature: the module `<snake_case signature>.py` in any
folder under extensions/business/, class `<CamelCase signature>Plugin`. Upstream edge_node ships its own
LLM_INFERENCE_API at extensions/business/edge_inference_api/llm_inference_api.py; this module has its
own name and folder (extensions/business/edgellm/), so dropping this folder into a stock node overwrites
nothing and both plugins run side by side. A pipeline that wants edgellm under the upstream name
installs the opt-in alias (`edgellm ratio1-install --take-over-llm-inference-api`, see
edgellm/ratio1/install.py).

The node's uvicorn runs a generated main.py (edgellm_main.py.j2) with one catch-all route that forwards
every request verbatim to `handle_http`. This plugin runs edgellm's own FastAPI app (`create_app`,
with its lifespan: the engine worker process, the durable request registry) on an event loop thread
it owns, feeds it each request and returns the reply as a postponed request polled by the plugin
loop. So every route and rule is edgellm's: /predict, /predict_async, /create_chat_completion,
/create_chat_completion_async, /request_status, /health, /status, /metrics, /v1/chat/completions,
/v1/models, validation, auth, the registry, RAW/WRAPPED bodies and the error statuses. WRAPPED bodies
carry this node's identity (get_additional_fastapi_data()).

Config: the upstream plugin's keys and defaults (RESPONSE_FORMAT, REQUEST_TIMEOUT, REQUEST_TTL_SECONDS,
AUTH_TOKEN_ENV, PREDEFINED_AUTH_TOKENS, ALLOW_ANONYMOUS_ACCESS, TEMPERATURE_MIN/MAX,
MIN/MAX_COMPLETION_TOKENS, AI_ENGINE, PORT, TUNNEL_ENGINE_ENABLED) plus edgellm's engine settings
(MODEL_PATH, N_CTX, N_SLOTS, N_GPU_LAYERS, KV_CACHE_TYPE, STATE_DIR, HOST, MAX_QUEUED, ...); see
plugin_config.py and docs/ratio1.md ("Ratio1 edge node").
"""

import json
import logging
import os
import shlex
import sys
import threading
import time

from naeural_core.business.default.web_app.fast_api_web_app import FastApiWebAppPlugin as BasePlugin

from edgellm.runtime.live_settings import classify
from extensions.business.edgellm.asgi_bridge import (
    REPLY_MARK,
    AsgiAppRunner,
    HttpRequest,
    edgellm_error_reply,
)
from extensions.business.edgellm.chainstore_link import NodeSigner, PluginChainStore
from extensions.business.edgellm.held_requests import HeldRequests
from extensions.business.edgellm.plugin_config import (
    PLUGIN_DEFAULTS,
    balancing_from_config,
    node_identity,
    semaphore_env,
    settings_from_config,
)

__VER__ = "1.0.0"

_CONFIG = {
    **BasePlugin.CONFIG,
    **PLUGIN_DEFAULTS,
    "ALLOW_EMPTY_INPUTS": True,
    "IS_LOOPBACK_PLUGIN": True,
    "PROCESS_DELAY": 0,
    "TEMPLATE": None,  # the stock main.py is replaced by edgellm_main.py.j2
    "API_TITLE": "edgellm LLM inference API",
    # Every waiting request is polled on every plugin loop: no per-loop caps on a node that serves LLM calls.
    "PROCESS_BUDGET_MS": 0,
    "MAX_INCOMING_PER_LOOP": 0,
    "MAX_POSTPONED_PER_LOOP": 0,
    "VALIDATION_RULES": {
        **BasePlugin.CONFIG["VALIDATION_RULES"],
    },
}

_HERE = os.path.dirname(os.path.abspath(__file__))
_MAIN_TEMPLATE = "edgellm_main.py.j2"
_IPC_GRACE_S = 60  # the node's IPC waits this much past the longest request timeout edgellm allows


def _log_edgellm_to_stderr(level):
    """edgellm logs through `logging`; the node does not configure it, so add one stderr handler (once)."""
    logger = logging.getLogger("edgellm")
    if not any(getattr(h, "_edgellm_plugin", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s edgellm %(levelname)s %(name)s: %(message)s"))
        handler._edgellm_plugin = True
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(str(level).upper())


class EdgellmInferenceApiPlugin(BasePlugin):
    """edgellm LLM inference API (continuous batching, guided decoding, durable request registry)."""

    CONFIG = _CONFIG

    # -- lifecycle ---------------------------------------------------------------------------
    def on_init(self):
        self._runner = None
        self._settings = None
        self._settings_error = None
        self._node = None
        self._held = None  # HeldRequests while a pipeline update rebuilds the app
        self._config_again = False  # an update came during that rebuild: read the config once more after it
        self._config_lock = threading.Lock()
        self._closing = False
        self._rebuild_thread = None
        self._balancing = balancing_from_config({})  # off until the config says otherwise
        self._settings, self._settings_error = self._settings_now()
        if self._settings_error is not None:  # SettingsError: every request is answered 503 with this message
            self.P(f"{self._signature} config refused: {self._describe(self._settings_error)}", color="r")
        super().on_init()
        self._node = node_identity(self.get_additional_fastapi_data(), version=str(self.ee_ver))
        if self._settings is not None:
            _log_edgellm_to_stderr(self._settings.log_level)
            self._runner = self._start_runner(self._settings)
        return

    def _settings_now(self):
        """(Settings, None) from the instance's current config, or (None, the error)."""
        config = {key: getattr(self, "cfg_" + key.lower()) for key in PLUGIN_DEFAULTS}
        # What the pipeline itself set, too: an upstream param we cannot honour must be seen to be refused.
        given = {str(k).upper(): v for k, v in (self.get_upstream_config() or {}).items()}
        config = {**given, **config}
        instance_key = f"{self.get_stream_id()}__{self.get_instance_id()}"
        try:
            settings = settings_from_config(config, data_folder=self.get_data_folder(), instance_key=instance_key)
            self._balancing = balancing_from_config(config)  # read with the settings; taken at the app's start
            return settings, None
        except Exception as exc:
            return None, exc

    @staticmethod
    def _describe(exc):
        return getattr(exc, "message", None) or str(exc)

    def _start_runner(self, settings):
        runner = AsgiAppRunner(
            lambda: self._create_app(settings),
            server=(settings.host, int(self.port or 0)),
            error_reply=self._error_reply,
            name=f"edgellm-{self.get_instance_id()}",
        )
        runner.start()
        self.P(
            f"edgellm app starting: {settings.n_slots} slots x {settings.n_ctx} ctx, {settings.response_format.value} "
            f"on {settings.host}:{self.port}, state {settings.state_dir}"
        )
        return runner

    # -- pipeline updates (deeploy, UPDATE_CONFIG): naeural_core calls on_config on its manager thread --
    def on_config(self):
        super().on_config()  # the web app's own part (a changed tunnel engine)
        self._apply_config()

    def _apply_config(self):
        new, error = self._settings_now()
        if error is None:
            error = self._cannot_start(new)
        if error is not None:
            self.P(f"config update refused, the running config stays: {self._describe(error)}", color="r")
            return
        with self._config_lock:  # one decision at a time: the manager thread and a rebuild's end
            if self._closing:
                return
            if self._held is not None:  # a rebuild is under way: it reads the config again when it is done
                self._config_again = True
                return
            if self._runner is None:  # the config was refused at start; now it is good
                self._settings, self._settings_error = new, None
                _log_edgellm_to_stderr(new.log_level)
                self._runner = self._start_runner(new)
                return
            change = classify(self._settings, new)
            if change.empty:
                return
            if change.refused:
                self.P(
                    f"config update refused, the running config stays: {', '.join(change.refused)} cannot change "
                    "while the instance runs (the node's web server holds them from its start); restart the "
                    "instance for it",
                    color="r",
                )
                return
            if change.restart:
                self._rebuild(new, change)
                return
            # Request rules only: taken at once on the app's loop, without blocking this thread.
            self._settings = new
            applied = self._runner.call(lambda app: app.state.apply_settings(new))
        applied.add_done_callback(
            lambda f: self.P(
                f"config updated live: {', '.join(change.live)}"
                if f.exception() is None
                else f"config update failed: {f.exception()!r}",
                color="g" if f.exception() is None else "r",
            )
        )

    @staticmethod
    def _cannot_start(settings):
        """A model file the new app could not load (missing, not a GGUF), found before the running app is
        drained for it; None if none. The memory plan is not judged here: the running engine's memory is
        still taken, so only the new app, once the old one is gone, can tell."""
        try:
            for _, served in settings.served_models():
                served.check_model_files()
        except Exception as exc:
            return exc
        return None

    def _rebuild(self, new, change):
        """A drained restart of the app and its engine (under _config_lock): requests that arrive meanwhile
        are held (not refused); the old app stops admitting and finishes what it has, for up to
        shutdown_grace_s (then its waiting sync callers get its JSON 503; async work still pending stays
        in the durable registry, which the new app recovers); the new app starts, and once its engine is
        ready (or has failed: they then get its reason) the held requests go to it in arrival order."""
        old_runner, old = self._runner, self._settings
        held = self._held = HeldRequests()
        self.P(f"config update: {', '.join(change.restart)} changed: restarting the engine (drained)", color="y")
        grace = float(old.shutdown_grace_s)

        def drain(app):
            app.state.service.draining = True
            app.state.drain.start(grace)

        def run():
            started = time.monotonic()
            runner = None
            try:
                try:
                    old_runner.call(drain).result(5)
                    deadline = started + grace + 2.0  # the drain's own 503s go out at `grace`
                    while time.monotonic() < deadline:
                        if not old_runner.call(lambda app: app.state.service.in_flight()).result(5):
                            break
                        time.sleep(0.1)
                except Exception:  # the old app is not answering: nothing more to wait for
                    pass
                old_runner.stop(timeout_s=grace + 10.0)
                with self._config_lock:
                    if self._closing:
                        return
                    self._settings = new
                    _log_edgellm_to_stderr(new.log_level)
                    self._runner = runner = self._start_runner(new)
                self._wait_ready(runner)
            finally:
                with self._config_lock:
                    self._held = None
                    again, self._config_again = self._config_again, False
                    # Whatever happened above, no request stays held: the new app, or an error reply.
                    n = held.release(runner) if runner is not None else held.refuse(self._error_reply)
                self.P(
                    f"engine restart for the new config ended in {time.monotonic() - started:.1f} s; "
                    f"{n} request(s) held meanwhile sent on"
                )
            if again:
                self._apply_config()

        self._rebuild_thread = threading.Thread(target=run, name=f"edgellm-rebuild-{self.get_instance_id()}")
        self._rebuild_thread.daemon = True
        self._rebuild_thread.start()

    @staticmethod
    def _wait_ready(runner, timeout_s=600.0):
        """Until the app's engine is ready or has failed to start (its app answers 503 meanwhile)."""
        ready_by = time.monotonic() + timeout_s
        while time.monotonic() < ready_by:
            try:
                ready, body = runner.call(lambda app: app.state.service.health()).result(30)
            except Exception:  # the app could not start: its error reply says why
                return
            if ready or body.get("engine", {}).get("state") == "failed":
                return
            time.sleep(0.1)

    def _create_app(self, settings):
        from edgellm.runtime.server.app import create_app  # in the runner's thread: the engine starts from its lifespan

        return create_app(settings, node=self._node, fleet=self._balancer if self._balancing.active else None)

    def _balancer(self, service):
        """Request balancing with the group's other nodes (edgellm/fleet/balancer.py), on this node's
        ChainStore; started by the app once its recovery ran."""
        from edgellm.fleet.balancer import Balancer
        from edgellm.fleet.protocol import Member

        config = self._balancing
        member = Member(
            addr=self.ee_addr,
            alias=str(self.eeid),
            pipeline=self.get_stream_id(),
            signature=self.get_signature(),
            instance_id=self.get_instance_id(),
        )
        store = PluginChainStore(self, config.cstore_timeout_s, config.cstore_max_retries)
        self.P(f"request balancing on: group {config.group_name!r} as {member.key}")
        return Balancer(service, config, member, store, NodeSigner(self))

    def _error_reply(self, exc, request=None):
        mode = self._settings.response_format if self._settings is not None else PLUGIN_DEFAULTS["RESPONSE_FORMAT"]
        return edgellm_error_reply(exc, request.path if request is not None else "/", mode, self._node)

    def on_close(self):
        with self._config_lock:
            self._closing = True  # a rebuild under way starts no new app
        grace = float(self._settings.shutdown_grace_s) if self._settings is not None else 20.0
        if self._rebuild_thread is not None:
            self._rebuild_thread.join(timeout=grace + 30.0)
        if self._runner is not None:
            self.P("stopping the edgellm app (engine worker, registry)...")
            self._runner.stop(timeout_s=grace + 10.0)
            self._runner = None
        super().on_close()
        return

    def process(self):
        return

    # -- SEMAPHORE pairing: the consumers get an address this instance listens on ----------------
    def _setup_semaphore_env(self):
        super()._setup_semaphore_env()  # the framework's keys (API_IDENTIFIER, ...); its API_URL is replaced
        host = self._settings.host if self._settings is not None else "127.0.0.1"
        try:
            lan_ip = self.log.get_localhost_ip()
        except Exception:  # no route out: loopback is all there is
            lan_ip = None
        env = semaphore_env(host, self.port, lan_ip)
        for key, value in env.items():
            self.semaphore_set_env(key, value)
        # One line in the node log: what the paired consumers were told (the pairing is otherwise silent).
        note = ""
        if self._settings is not None and self._settings.is_loopback():
            note = " (HOST is loopback: a consumer in another network namespace needs HOST 0.0.0.0 and a token)"
        self.P(f"SEMAPHORE {getattr(self, 'cfg_semaphore', None)}: exported API_URL={env.get('API_URL')}{note}")
        return

    # -- the node's uvicorn: our main.py, bound where the config says ------------------------
    def initialize_assets(self, src_dir, dst_dir, jinja_args):
        super().initialize_assets(src_dir, dst_dir, jinja_args)
        from jinja2 import Environment, FileSystemLoader

        settings = self._settings
        args = {
            "manager_port": self.manager_port,
            "manager_auth": self.manager_auth,
            "ipc_timeout_s": (settings.max_request_timeout if settings else 3600.0) + _IPC_GRACE_S,
            "max_body_bytes": settings.max_body_bytes if settings else 1_048_576,
            "response_format": (
                settings.response_format.value if settings else str(PLUGIN_DEFAULTS["RESPONSE_FORMAT"])
            ),
            "node_identity_json": json.dumps(self._node_dict()),
            "reply_mark": REPLY_MARK,
        }
        template = Environment(loader=FileSystemLoader(_HERE), autoescape=False).get_template(_MAIN_TEMPLATE)
        with open(os.path.join(dst_dir, "main.py"), "w") as f:
            f.write(template.render(args))
        return

    def _node_dict(self):
        node = self._node or node_identity(self.get_additional_fastapi_data(), version=str(self.ee_ver))
        return dict(node.__dict__)

    def get_start_commands(self):
        host = self._settings.host if self._settings is not None else "127.0.0.1"
        app_dir = shlex.quote(self.get_web_server_path())
        cmd = (
            f"{shlex.quote(sys.executable)} -m uvicorn --app-dir {app_dir} main:app "
            f"--host {shlex.quote(host)} --port {int(self.port)} --no-access-log"
        )
        return [cmd] + list(self.cfg_start_commands or [])

    # -- requests ----------------------------------------------------------------------------
    @BasePlugin.endpoint(method="post")
    def handle_http(self, method: str, path: str, query: str, headers: list, body: str, client: list = None):
        """The one endpoint main.py calls: a whole HTTP request in, a whole HTTP reply out."""
        request = HttpRequest.from_wire(method, path, query, headers, body, client)
        held = self._held
        if held is not None:  # a pipeline update is rebuilding the app: the request waits for the new one
            return self._poll(held.hold(request))
        if self._runner is None:
            return self._error_reply(
                self._settings_error or RuntimeError("the plugin is not started"), request
            ).to_wire()
        return self._poll(self._runner.submit(request))

    def _poll(self, future):
        if not future.done():
            return self.create_postponed_request(solver_method=self._poll, method_kwargs={"future": future})
        return future.result().to_wire()

    def on_response(self, method, response):
        # The framework wraps every endpoint value in its own envelope (RESPONSE_FORMAT is also its key);
        # edgellm already built the whole reply, envelope included, so unwrap it here.
        value = response.get("value")
        if isinstance(value, dict) and isinstance(value.get("result"), dict) and value["result"].get(REPLY_MARK):
            response["value"] = value["result"]
        return

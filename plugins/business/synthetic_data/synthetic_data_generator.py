"""SYNTHETIC_DATA_GENERATOR: schema-valid synthetic JSON records through this node's EDGELLM_INFERENCE_API.

A user plugin (plugins.business): the node checks its code, so it only wires the node to the bridge
(extensions/business/synthetic_data/synth_bridge.py), where the work is done: the same generator as
`edgellm synth`, on a background thread, writing JSONL to <node output folder>/synthetic_data/ and
resuming it after a restart. Each change of state, and the progress every PROGRESS_INTERVAL s, goes
out in a payload (SYNTH_STATUS, SYNTH_VALID, SYNTH_INVALID, SYNTH_DUPLICATES, SYNTH_FAILED, ...).

Config: SCHEMA (required), PROMPT_TEMPLATE, COUNT, TEMPERATURE, SEED, MAX_TOKENS, CONCURRENCY,
API_HOST, API_PORT (the EDGELLM_INFERENCE_API instance's PORT), TOKEN, OUTPUT_FILE, REQUEST_TIMEOUT,
MAX_ATTEMPTS, PROGRESS_INTERVAL, API_WAIT (s to wait for the API's /health). Run it in a "Void" pipeline.
"""

from naeural_core.business.base import BasePluginExecutor as BasePlugin

from extensions.business.synthetic_data.synth_bridge import PLUGIN_DEFAULTS, SynthJob

__VER__ = "1.0.0"

_CONFIG = {
    **BasePlugin.CONFIG,
    **PLUGIN_DEFAULTS,
    "ALLOW_EMPTY_INPUTS": True,  # no data stream: process() runs on its own
    "PROCESS_DELAY": 1,
    "VALIDATION_RULES": {
        **BasePlugin.CONFIG["VALIDATION_RULES"],
    },
}


class SyntheticDataGeneratorPlugin(BasePlugin):
    CONFIG = _CONFIG

    def on_init(self):
        config = {
            "SCHEMA": self.cfg_schema,
            "PROMPT_TEMPLATE": self.cfg_prompt_template,
            "COUNT": self.cfg_count,
            "TEMPERATURE": self.cfg_temperature,
            "SEED": self.cfg_seed,
            "MAX_TOKENS": self.cfg_max_tokens,
            "CONCURRENCY": self.cfg_concurrency,
            "API_HOST": self.cfg_api_host,
            "API_PORT": self.cfg_api_port,
            "TOKEN": self.cfg_token,
            "OUTPUT_FILE": self.cfg_output_file,
            "REQUEST_TIMEOUT": self.cfg_request_timeout,
            "MAX_ATTEMPTS": self.cfg_max_attempts,
            "PROGRESS_INTERVAL": self.cfg_progress_interval,
            "API_WAIT": self.cfg_api_wait,
        }
        self.job = SynthJob(config, self.get_output_folder(), self.plugin_id).start()
        self.P(f"synthetic data: {self.job.state}, output {self.job.path}, error {self.job.error}")

    def process(self):
        fields = self.job.poll()
        if fields is not None:
            self.P(f"synthetic data: {fields}")
            self.add_payload_by_fields(**fields)
        return None

    def on_close(self):
        self.job.stop()

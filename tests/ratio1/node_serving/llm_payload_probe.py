"""LLM_PAYLOAD_PROBE: a test-only business plugin that plays upstream's LLM_INFERENCE_API dispatch.

It puts its PROBE_PAYLOADS on its Loopback pipeline's queue exactly as upstream does
(`add_payload_by_fields(JEEVES_CONTENT=..., signature=...)`), reads back every inference of its
AI_ENGINE (all of them: `dataapi_struct_data_inferences()` returns only the first input's) and writes
them to PROBE_OUT as JSON, so a test sees what the serving answered through a real node.
"""

import json
import os

from naeural_core.business.base import BasePluginExecutor as BasePlugin

__VER__ = "0.1.0"

_CONFIG = {
    **BasePlugin.CONFIG,
    "ALLOW_EMPTY_INPUTS": True,
    "IS_LOOPBACK_PLUGIN": True,
    "PROCESS_DELAY": 0.2,
    "PROBE_PAYLOADS": [],  # JEEVES_CONTENT dicts, sent together on the first loop
    "PROBE_OUT": None,  # where the answers are written (JSON list, rewritten as they arrive)
    "VALIDATION_RULES": {**BasePlugin.CONFIG["VALIDATION_RULES"]},
}


class LlmPayloadProbePlugin(BasePlugin):
    CONFIG = _CONFIG

    def on_init(self):
        self._sent = False
        self._answers = []
        self._batches = []
        return

    def process(self):
        if not self._sent:
            for content in self.cfg_probe_payloads:
                self.add_payload_by_fields(JEEVES_CONTENT=dict(content), signature=self.get_signature())
            self._sent = True
            self.P(f"probe: sent {len(self.cfg_probe_payloads)} payload(s)")
            return
        by_model = self.dataapi_struct_datas_inferences() or {}
        got = [inf for lst in by_model.values() for inf in (lst or []) if isinstance(inf, dict)]
        if got:
            self._answers.extend(got)
            self._batches.append(len(got))
            out = {"answers": self._answers, "batches": self._batches, "engines": list(by_model)}
            tmp = self.cfg_probe_out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(out, f, default=str)
            os.replace(tmp, self.cfg_probe_out)
            self.P(f"probe: {len(got)} answer(s) in this loop, {len(self._answers)} in all")
        return

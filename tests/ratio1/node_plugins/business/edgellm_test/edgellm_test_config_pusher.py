"""EDGELLM_TEST_CONFIG_PUSHER: a test-only plugin that sends UPDATE_CONFIG commands from inside the node.

The test node is offline: no deeploy, no SDK session to send a pipeline update from. This plugin sends
the same command deeploy does (naeural_core's `cmdapi_start_pipeline`, an UPDATE_CONFIG for a pipeline
that exists), through the node's own command path (comm -> config manager -> the instance's
maybe_update_instance_config -> on_config): for each `*.json` pipeline a test drops into INBOX, once.
Not shipped: tests/ratio1/test_node_integration.py puts it in the node's plugins/ folder.
"""

import json
import os

from naeural_core.business.base import BasePluginExecutor as BasePlugin

__VER__ = "0.1.0"

_CONFIG = {
    **BasePlugin.CONFIG,
    "ALLOW_EMPTY_INPUTS": True,
    "PROCESS_DELAY": 0.5,
    "INBOX": None,
    "VALIDATION_RULES": {**BasePlugin.CONFIG["VALIDATION_RULES"]},
}


class EdgellmTestConfigPusherPlugin(BasePlugin):
    CONFIG = _CONFIG

    def process(self):
        inbox = self.cfg_inbox
        if not inbox or not os.path.isdir(inbox):
            return
        for name in sorted(os.listdir(inbox)):
            if not name.endswith(".json"):
                continue
            path = os.path.join(inbox, name)
            with open(path) as f:
                pipeline = json.load(f)
            self.cmdapi_start_pipeline(config=pipeline)
            os.rename(path, path + ".sent")
            self.P("UPDATE_CONFIG sent for pipeline {} ({})".format(pipeline.get("NAME"), name))
        return

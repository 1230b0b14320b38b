"""EDGELLM_TEST_CHAINSTORE_PROBE: a test-only plugin that shows what this node's ChainStore replicates.

Every INTERVAL seconds it writes its own record into the hash namespace HKEY, under its node's address
(`chainstore_hset` with the default peers: the node's whitelist, see NodeOptions.peers), reads the whole
namespace back (`chainstore_hgetall`) and writes what it saw to
<output folder>/edgellm_test_chainstore_probe/<INSTANCE_ID>.json (replaced atomically), for the test to read.

The ChainStore calls run on a thread the plugin owns, not in process(): chainstore_hset blocks until the
peers confirm (up to `timeout` per try), and both calls wait, without a timeout, until CHAIN_STORE_BASE is
up. Not shipped: tests/ratio1/test_node_integration.py's node_plugins() puts it in the node's plugins/ folder.
"""

import json
import os
import threading
import time

from naeural_core.business.base import BasePluginExecutor as BasePlugin

__VER__ = "0.1.0"

_CONFIG = {
    **BasePlugin.CONFIG,
    "ALLOW_EMPTY_INPUTS": True,
    "PROCESS_DELAY": 1,
    "HKEY": "edgellm_test:probe",
    "INTERVAL": 2,
    "VALIDATION_RULES": {**BasePlugin.CONFIG["VALIDATION_RULES"]},
}

SUBFOLDER = "edgellm_test_chainstore_probe"


class EdgellmTestChainstoreProbePlugin(BasePlugin):
    CONFIG = _CONFIG

    def on_init(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="edgellm-chainstore-probe", daemon=True)
        self._thread.start()
        return

    def process(self):
        return  # all the work is on the probe's thread

    def on_close(self):
        self._stop.set()
        self._thread.join(timeout=5)  # daemon: one stuck in a ChainStore wait does not hold the shutdown
        return

    def _run(self):
        folder = os.path.join(self.get_output_folder(), SUBFOLDER)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{self.cfg_instance_id}.json")
        me = self.ee_addr
        n = 0
        while not self._stop.is_set():
            n += 1
            t0 = time.time()
            try:
                ok = self.chainstore_hset(
                    hkey=self.cfg_hkey,
                    key=me,
                    value={"n": n, "alias": self.eeid, "t": t0},
                    timeout=2,
                    max_retries=0,
                )
                error = None
            except Exception as exc:  # a test plugin: report, keep probing
                ok, error = False, repr(exc)
            hset_s = time.time() - t0
            try:
                seen = self.chainstore_hgetall(self.cfg_hkey) or {}
            except Exception as exc:
                seen, error = {}, repr(exc)
            peers = {}  # why a write has no target peers: the whitelist, as the node's netmon rates it
            try:
                for peer in self.bc.get_whitelist(with_prefix=True):
                    peers[peer] = {
                        "online_for_control": bool(self.netmon.network_node_is_online_for_control(peer)),
                        "status": self.netmon.network_node_simple_status(peer),
                    }
            except Exception as exc:
                peers = {"error": repr(exc)}
            state = {
                "address": me,
                "alias": self.eeid,
                "n": n,
                "hset_ok": bool(ok),
                "hset_s": round(hset_s, 3),
                "error": error,
                "t": time.time(),
                "seen": seen,
                "peers": peers,
            }
            with open(path + ".tmp", "w") as f:
                json.dump(state, f, default=str, indent=1)
            os.replace(path + ".tmp", path)
            self._stop.wait(self.cfg_interval)
        return

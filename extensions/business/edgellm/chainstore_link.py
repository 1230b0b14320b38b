"""edgellm/fleet's ChainStore and Signer over a naeural_core plugin's own API (chainstore_hset /
chainstore_hgetall, the node's blockchain engine `bc`), for request balancing between nodes.

Upstream's balancing protocol sends envelopes unsigned, and ChainStore accepts a write from any node
whose payload signature verifies without binding the record to that node. So edgellm signs each
envelope with the node's key (`bc.sign`, the fields upstream ignores: EE_SIGN, EE_SENDER, EE_HASH...)
and checks on receipt that it verifies and that its signer is the node the envelope names.
"""

from edgellm.fleet.store_link import BadSignature

_CHAIN_STORE_READY = "__chain_storage_set"  # set in the plugins' shared memory by CHAIN_STORE_BASE


class PluginChainStore:
    """Broadcast writes (capacity records) go to the node's chain peers (its whitelist, online) and the
    instance's CHAINSTORE_PEERS; a mailbox write goes to its one addressee only, as upstream's do."""

    def __init__(self, plugin, timeout_s: float, max_retries: int):
        self._plugin, self._timeout, self._retries = plugin, timeout_s, max_retries

    def ready(self) -> bool:
        # naeural's chainstore_* wait for this with no timeout: never call them before it is there.
        return bool(self._plugin.plugins_shmem.get(_CHAIN_STORE_READY))

    def hset(self, hkey, key, value, *, to=None) -> bool:
        targeted = (
            {}
            if to is None
            else {
                "extra_peers": [to],
                "include_default_peers": False,
                "include_configured_peers": False,
            }
        )
        return bool(
            self._plugin.chainstore_hset(hkey, key, value, timeout=self._timeout, max_retries=self._retries, **targeted)
        )

    def hgetall(self, hkey) -> dict:
        return self._plugin.chainstore_hgetall(hkey) or {}


class NodeSigner:
    """Signs with the node's key; a sender is known when the node whitelists it (authorized_addrs) or
    the instance names it in CHAINSTORE_PEERS."""

    def __init__(self, plugin):
        self._plugin = plugin

    def sign(self, envelope: dict) -> dict:
        signed = dict(envelope)
        self._plugin.bc.sign(signed, add_data=True)  # adds EE_SIGN, EE_SENDER, EE_HASH, SIGN_CANON_V
        return signed

    def sender(self, envelope: dict):
        if "EE_SIGN" not in envelope and "EE_SENDER" not in envelope:
            return None
        verified = self._plugin.bc.verify(dict(envelope), log_hash_sign_fails=False)
        if not verified.valid:
            raise BadSignature(verified.message or "invalid signature")
        return self._plugin.bc.maybe_add_prefix(str(envelope.get("EE_SENDER")))

    def known(self, addr: str) -> bool:
        bc = self._plugin.bc
        # The plugin's BCWrapper re-reads the node's authorized_addrs on each call.
        peers = set(bc.get_whitelist(with_prefix=True) or []) | set(
            getattr(self._plugin, "cfg_chainstore_peers", None) or []
        )
        return bc.maybe_add_prefix(addr) in {bc.maybe_add_prefix(a) for a in peers}

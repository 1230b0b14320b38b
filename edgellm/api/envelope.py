"""WRAPPED (node envelope) and RAW response bodies."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from edgellm.compat import StrEnum


class ResponseMode(StrEnum):
    WRAPPED = "WRAPPED"
    RAW = "RAW"


@dataclass(frozen=True)
class NodeIdentity:
    server_node_addr: str
    evm_network: str
    ee_node_alias: str
    ee_node_address: str
    ee_node_eth_address: str
    ee_node_network: str
    ee_node_ver: str


def envelope(value: Any, mode: ResponseMode, node: NodeIdentity) -> Any:
    """RAW is the value alone: no node keys leak into it (upstream's RAW does leak them)."""
    if mode is ResponseMode.RAW:
        return value
    return {"result": value, **asdict(node)}

"""The two transports the peer-plane tests run against (as Flower runs one suite against its
in-memory and its SQL state): real gRPC over loopback sockets, and the in-process switchboard."""

from __future__ import annotations

from typing import Any

from coterie.node.config import NodeConfig
from coterie.node.daemon import Node
from coterie.node.transport.inproc import InProcNetwork

TRANSPORTS = ["grpc", "inproc"]


class NodeMaker:
    """Builds the nodes of one test network on ``kind``'s transport."""

    def __init__(self, kind: str):
        if kind not in TRANSPORTS:
            raise ValueError(kind)
        self.kind = kind
        self.switchboard = InProcNetwork() if kind == "inproc" else None

    def __call__(self, cfg: NodeConfig, **kw: Any) -> Node:
        if self.switchboard is None:
            return Node(cfg, **kw)
        return Node(cfg, transport=self.switchboard.transport_for(cfg), admin=False, **kw)

"""A PS client's connections: one DEALER socket per shard, in a zmq context of their own. No requests."""

from __future__ import annotations

import os

import zmq

from hetpipe.core.protocol import wire
from hetpipe.core.protocol.keys import ClientKeys

__all__ = ["ShardSockets", "routing_id"]


def routing_id(run: str, vw: int, stage: int) -> bytes:
    """`<run>/vw<i>/s<j>/<pid>/<random>`: the identity every socket of one client connects with."""
    return f"{run}/vw{vw}/s{stage}/{os.getpid()}/{os.urandom(4).hex()}".encode()


class ShardSockets:
    """One DEALER per shard endpoint, configured as every PS socket is (docs/ps-protocol.md#sockets), all with
    one routing id; with `curve` keys each is a CurveZMQ client."""

    def __init__(self, endpoints: list[str], identity: bytes, curve: ClientKeys | None) -> None:
        self.context = zmq.Context()
        self.sockets: list[zmq.Socket] = []
        for endpoint in endpoints:
            sock = self.context.socket(zmq.DEALER)
            wire.configure_socket(sock, router=False)
            sock.setsockopt(zmq.ROUTING_ID, identity)
            if curve is not None:
                sock.curve_serverkey = curve.server_public
                sock.curve_publickey = curve.public
                sock.curve_secretkey = curve.secret
            sock.connect(endpoint)
            self.sockets.append(sock)

    def close(self) -> None:
        """Close every socket without waiting for unsent messages, then the context."""
        for sock in self.sockets:
            sock.close(linger=0)
        self.context.term()

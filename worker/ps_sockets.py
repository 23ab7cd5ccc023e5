"""A PS client's connections: one DEALER socket per shard, in a zmq context of their own, and a status probe
over a fresh connection. No other requests."""

from __future__ import annotations

import os
from collections.abc import Container
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from hetpipe.core.protocol import wire
from hetpipe.core.protocol.keys import ClientKeys

__all__ = ["MONITORED", "ShardSocketList", "ShardSockets", "routing_id"]

MONITORED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED  # what a DEALER's monitor reports


def routing_id(run: str, vw: int, stage: int) -> bytes:
    """`<run>/vw<i>/s<j>/<pid>/<random>`: the identity every socket of one client connects with."""
    return f"{run}/vw{vw}/s{stage}/{os.getpid()}/{os.urandom(4).hex()}".encode()


class ShardSocketList(list):
    """The DEALERs, one per shard, each with a monitor of its connection (`monitors`, for `reconnected`), and
    how to reach each shard on a fresh connection (`probe`)."""

    def __init__(self, context: zmq.Context, endpoints: list[str], curve: ClientKeys | None) -> None:
        super().__init__()
        self.context, self.endpoints, self.curve = context, endpoints, curve
        self.monitors: list[zmq.Socket] = []
        self._dropped: set[int] = set()  # shards whose connection dropped and has not come back yet

    def reconnected(self, ready: Container[zmq.Socket]) -> list[int]:
        """The shards whose connection dropped, or came back after a drop (its handshake), from the events of
        the monitors in `ready`: whatever was in flight on the old connection is lost, so the caller sends
        its open requests to them again (queued in order while the DEALER reconnects, and once more when it
        has)."""
        out: list[int] = []
        for shard, monitor in enumerate(self.monitors):
            while monitor in ready:
                try:
                    event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)["event"]
                except zmq.Again:
                    break
                if event == zmq.EVENT_DISCONNECTED:
                    self._dropped.add(shard)
                    out.append(shard)
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and shard in self._dropped:
                    self._dropped.discard(shard)
                    out.append(shard)
        return out

    def probe(self, shard: int, run: str, timeout_s: float) -> dict[str, Any] | None:
        """The shard's status asked over a new connection of its own, so that it does not queue behind the
        bytes of a large reply on the client's connection; None when no answer comes within timeout_s."""
        sock = self.context.socket(zmq.DEALER)
        try:
            wire.configure_socket(sock, router=False)
            if self.curve is not None:
                sock.curve_serverkey = self.curve.server_public
                sock.curve_publickey = self.curve.public
                sock.curve_secretkey = self.curve.secret
            sock.connect(self.endpoints[shard])
            sock.send_multipart(wire.encode("status", {"id": 1, "run": run}), flags=zmq.NOBLOCK)
            if not sock.poll(int(timeout_s * 1000)):
                return None
            reply = wire.decode(sock.recv_multipart(copy=False))
        except (zmq.ZMQError, wire.WireError):
            return None
        finally:
            sock.close(linger=0)
        return reply.fields["info"] if reply.type == "status_reply" else {}


class ShardSockets:
    """One DEALER per shard endpoint, configured as every PS socket is (docs/ps-protocol.md#sockets), all with
    one routing id; with `curve` keys each is a CurveZMQ client."""

    def __init__(self, endpoints: list[str], identity: bytes, curve: ClientKeys | None) -> None:
        self.context = zmq.Context()
        self.sockets = ShardSocketList(self.context, endpoints, curve)
        for endpoint in endpoints:
            sock = self.context.socket(zmq.DEALER)
            wire.configure_socket(sock, router=False)
            sock.setsockopt(zmq.ROUTING_ID, identity)
            if curve is not None:
                sock.curve_serverkey = curve.server_public
                sock.curve_publickey = curve.public
                sock.curve_secretkey = curve.secret
            self.sockets.monitors.append(sock.get_monitor_socket(MONITORED))
            sock.connect(endpoint)
            self.sockets.append(sock)

    def close(self) -> None:
        """Close every socket and its monitor without waiting for unsent messages, then the context."""
        for sock in self.sockets:
            sock.disable_monitor()
            sock.close(linger=0)
        for monitor in self.sockets.monitors:
            monitor.close(linger=0)
        self.context.term()

"""The shard's CurveZMQ gate: a ZAP handler answered by the shard's own loop.

No thread: the ZAP socket (bound in the shard's ZeroMQ context before the ROUTER listens) is polled with the
ROUTER, so a handshake waits at most one loop turn. Decisions are hetpipe.core.protocol.access's; refused
clients are logged and counted against their address by hetpipe.server.doors (which also reports the
handshakes that fail before the ZAP handler is asked).
"""

from __future__ import annotations

import zmq

from hetpipe.core.protocol.access import ZAP_DOMAIN, ZAP_ENDPOINT, zap_decide
from hetpipe.core.protocol.keys import ServerKeys
from hetpipe.server.doors import Doors

__all__ = ["CurveGate"]


class CurveGate:
    """Makes a ROUTER a CURVE server that admits only `keys.clients`; refusals go to the shard's doors."""

    def __init__(self, ctx: zmq.Context, keys: ServerKeys) -> None:
        self.keys = keys
        self.zap = ctx.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)  # before the ROUTER listens: no handshake may skip the handler
        self.doors: Doors | None = None
        self.admitted = 0
        self.refused = 0

    def secure(self, router: zmq.Socket) -> None:
        """Turn `router` into a CURVE server checked by this gate; call before it binds."""
        router.curve_server = True
        router.curve_secretkey = self.keys.secret
        router.curve_publickey = self.keys.public
        router.zap_domain = ZAP_DOMAIN

    def handle(self) -> None:
        """Answer every ZAP request waiting."""
        while True:
            try:
                frames = self.zap.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_zap(frames)

    def _on_zap(self, frames: list[bytes]) -> None:
        decision = zap_decide(frames, self.keys.clients)
        self.zap.send_multipart(decision.reply)
        if decision.user is not None:
            self.admitted += 1
            return
        self.refused += 1
        key = f" with key {decision.key}" if decision.key else ""
        if self.doors is not None:
            self.doors.handshake_refused(
                decision.address, f"refused {decision.reason} from {decision.address}{key}"
            )

    def close(self) -> None:
        self.zap.close(linger=0)

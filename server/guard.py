"""The shard's CurveZMQ gate: a ZAP handler and a handshake monitor, answered by the shard's own loop.

No thread: the ZAP socket (bound in the shard's ZeroMQ context before the ROUTER listens) and the monitor are
polled with the ROUTER, so a handshake waits at most one loop turn. Decisions are
hetpipe.core.protocol.access's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from hetpipe.core.protocol.access import ZAP_DOMAIN, ZAP_ENDPOINT, RefusalLog, zap_decide
from hetpipe.core.protocol.keys import ServerKeys

__all__ = ["CurveGate"]

_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_PROTOCOL_WHY = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: 'a client without CURVE keys (auth = "none" on its side?)',
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "a CURVE handshake that does not verify: the client holds another "
    "server public key, or a secret key that does not match its public key",
}


class CurveGate:
    """Makes a ROUTER a CURVE server that admits only `keys.clients`, and logs every refused client."""

    def __init__(
        self, ctx: zmq.Context, keys: ServerKeys, log: Callable[[str], None], refusals: RefusalLog, label: str
    ) -> None:
        self.keys, self.log, self.refusals, self.label = keys, log, refusals, label
        self.zap = ctx.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)  # before the ROUTER listens: no handshake may skip the handler
        self.monitor: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self.admitted = 0
        self.refused = 0

    def secure(self, router: zmq.Socket) -> None:
        """Turn `router` into a CURVE server checked by this gate; call before it binds."""
        router.curve_server = True
        router.curve_secretkey = self.keys.secret
        router.curve_publickey = self.keys.public
        router.zap_domain = ZAP_DOMAIN
        self.monitor = router.get_monitor_socket(_FAILED)
        self._router = router

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [self.zap] + ([self.monitor] if self.monitor is not None else [])

    def handle(self, sock: zmq.Socket) -> None:
        """Answer what is waiting on one of `sockets`."""
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if sock is self.zap:
                self._on_zap(frames)
            else:
                self._on_handshake_failed(frames)

    def _on_zap(self, frames: list[bytes]) -> None:
        decision = zap_decide(frames, self.keys.clients)
        self.zap.send_multipart(decision.reply)
        if decision.user is not None:
            self.admitted += 1
            return
        self.refused += 1
        key = f" with key {decision.key}" if decision.key else ""
        self._refused(f"refused {decision.reason} from {decision.address}{key}")

    def _on_handshake_failed(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        self.refused += 1
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            why = _PROTOCOL_WHY.get(
                event["value"], f"a client breaking the handshake protocol ({event['value']})"
            )
        else:
            why = "a client whose handshake failed (libzmq gives no detail)"
        endpoint = event["endpoint"].decode("utf-8", "replace")
        self._refused(f"refused {why} on {endpoint}")

    def _refused(self, line: str) -> None:
        for text in self.refusals.note(line, time.monotonic()):
            self.log(f"{self.label} {text}")

    def close(self) -> None:
        if self.monitor is not None and self._router is not None:
            self._router.disable_monitor()
            self.monitor.close(linger=0)
        self.zap.close(linger=0)

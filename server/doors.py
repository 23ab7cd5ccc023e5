"""The shard's doors: how many connections it keeps (per peer address and in all), failed handshakes per
address, and the file descriptors left for its checkpoints. No requests; the shard's loop polls `Doors`.

ZeroMQ has no per-peer limit: ZMQ_MAX_SOCKETS counts a context's sockets, not the TCP connections one ROUTER
accepts, and each of those holds a file descriptor. So the ROUTER's monitor reports every accepted connection
with its descriptor; the shard reads the peer's address from it (getpeername on that very descriptor) and
shuts down a connection over its limits (libzmq then sees it closed and frees the descriptor). The ZAP
handler cannot do this: it is asked only once a handshake has run, and an idle connection never handshakes.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from hetpipe.core.protocol.access import HandshakeLimit, RefusalLog

__all__ = [
    "FD_RESERVE",
    "MAX_CONNECTIONS",
    "MAX_PER_PEER",
    "ConnectionTable",
    "Doors",
    "connection_cap",
    "open_files",
    "raise_fd_limit",
]

FD_RESERVE = 64  # descriptors never given to connections: checkpoints (temp file, directory), logs, libzmq
MAX_CONNECTIONS = 2048  # connections one shard keeps open at most (one per stage and client; the rest wait)
MAX_PER_PEER = 256  # from one address (a node's stages and agents, the launcher's clients)
_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_PROTOCOL_WHY = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: 'a client without CURVE keys (auth = "none" on its side?)',
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "a CURVE handshake that does not verify: the client holds another "
    "server public key, or a secret key that does not match its public key",
}


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit; returns (soft, hard) now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft, hard


def open_files() -> int:
    """Descriptors this process holds now (0 where /proc is not there to say)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def connection_cap(soft_limit: int, open_now: int) -> int:
    """Connections a shard may keep: MAX_CONNECTIONS, or fewer when the open-file limit leaves less room
    after what is open now and FD_RESERVE (at least 8: a shard must still serve a small run)."""
    return max(8, min(MAX_CONNECTIONS, soft_limit - open_now - FD_RESERVE))


@dataclass
class ConnectionTable:
    """The ROUTER's open connections by descriptor, with their peer address."""

    cap: int
    per_peer: int = MAX_PER_PEER
    peers: dict[int, str] = field(default_factory=dict)  # fd -> peer address
    _per_address: dict[str, int] = field(default_factory=dict)

    def refusal(self, address: str) -> str | None:
        """Why a new connection from `address` is refused; None when it may stay."""
        if len(self.peers) >= self.cap:
            return (
                f"the shard holds {len(self.peers)} connections, its limit (open-file limit less a reserve)"
            )
        if self._per_address.get(address, 0) >= self.per_peer:
            return f"{address} holds {self.per_peer} connections, the limit per address"
        return None

    def opened(self, fd: int, address: str) -> None:
        self.closed(fd)  # a descriptor number reused before its close was reported
        self.peers[fd] = address
        self._per_address[address] = self._per_address.get(address, 0) + 1

    def closed(self, fd: int) -> None:
        address = self.peers.pop(fd, None)
        if address is None:
            return
        left = self._per_address[address] - 1
        if left:
            self._per_address[address] = left
        else:
            del self._per_address[address]


def peer_address(fd: int) -> str | None:
    """The peer IP of connected socket `fd` (None: closed meanwhile, or not a TCP socket any more)."""
    try:
        peer = _borrowed(fd, socket.socket.getpeername)
    except OSError:
        return None
    return peer[0] if isinstance(peer, tuple) else None


def shut(fd: int) -> None:
    """Shut connection `fd` down (its owner, libzmq, closes the descriptor when it sees that)."""
    with contextlib.suppress(OSError):
        _borrowed(fd, lambda sock: sock.shutdown(socket.SHUT_RDWR))


def _borrowed(fd: int, use: Callable[[socket.socket], Any]) -> Any:
    """`use` applied to libzmq's descriptor `fd` as a Python socket, given back unclosed. Not a duplicate: a
    burst of connections can take every descriptor before the monitor's events are read, and a dup then fails
    (EMFILE), which left such connections open and uncounted."""
    sock = socket.socket(fileno=fd)
    try:
        return use(sock)
    finally:
        sock.detach()


class Doors:
    """Watches a ROUTER's connections through its monitor and closes those over the limits; logs refusals
    through `refusals` (rate-limited) and, every loop turn (`tick`), the counts of a window that ended."""

    def __init__(
        self, router: zmq.Socket, cap: int, refusals: RefusalLog, say: Callable[[str], None]
    ) -> None:
        self.table = ConnectionTable(cap)
        self.limit = HandshakeLimit()
        self.refusals, self.say = refusals, say
        self.notices = RefusalLog()  # the doors' own lines: a flood of distinct refusals does not hide them
        self.monitor = router.get_monitor_socket(_EVENTS)
        self._router = router

    def handle(self) -> None:
        """Take every event waiting on the monitor."""
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                return
            kind, fd = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
            elif kind & _FAILED:
                self._handshake_failed(kind, fd, event["endpoint"])
            else:
                self.table.closed(fd)

    def handshake_refused(self, address: str, line: str) -> None:
        """The ZAP handler refused a client: count it against its address, log `line`."""
        self.refused(line)
        self._count_failure(address)

    def refused(self, line: str, log: RefusalLog | None = None) -> None:
        for text in (log or self.refusals).note(line, time.monotonic()):
            self.say(text)

    def tick(self, now: float) -> None:
        """Log the counts of a refusal window that ended (a flood's summary, once it is over)."""
        for text in [*self.refusals.flush(now), *self.notices.flush(now)]:
            self.say(text)

    def close(self) -> None:
        self._router.disable_monitor()
        self.monitor.close(linger=0)

    def _accepted(self, fd: int) -> None:
        address = peer_address(fd)
        if address is None:
            return
        why = self.table.refusal(address)
        if self.limit.blocked(address, time.monotonic()):
            why = "too many failed handshakes from there just now"
        if why is None:
            self.table.opened(fd, address)
            return
        shut(fd)
        self.refused(f"closed a new connection from {address}: {why}", self.notices)

    def _handshake_failed(self, kind: int, value: int, endpoint: bytes) -> None:
        """libzmq's event names no peer (its value is the protocol error), so this is logged, not counted
        against an address; the connection caps still bound such clients."""
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            why = _PROTOCOL_WHY.get(value, f"a client breaking the handshake protocol ({value})")
        else:
            why = "a client whose handshake failed (libzmq gives no detail)"
        self.refused(f"refused {why} on {endpoint.decode('utf-8', 'replace')}")

    def _count_failure(self, address: str) -> None:
        line = self.limit.failed(address, time.monotonic())
        if line is not None:
            self.refused(line, self.notices)

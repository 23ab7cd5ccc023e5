"""A connection flood against one PS shard, for chaos.py --fault flood: idle TCP connections held open and
CurveZMQ handshakes with keys the run does not know, on loopback only, for a bounded time."""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time
from dataclasses import dataclass, field

import zmq


@dataclass
class Flood:
    """Holds `idle` idle TCP connections to `host:port` and opens `per_s` CURVE clients with unknown keys a
    second (each closed after `handshake_s`), until `stop()` or `seconds` have passed."""

    host: str
    port: int
    server_key: bytes  # the shard's public key (Z85): the bad clients get as far as the ZAP handler
    source: str = "127.0.0.2"  # the flood's own address: the run's stages (127.0.0.1) are not it
    idle: int = 1100
    per_s: float = 700.0
    seconds: float = 30.0
    handshake_s: float = 0.5
    opened_idle: int = 0
    handshakes: int = 0
    started: float = 0.0
    ended: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        for address in (self.host, self.source):
            if not address.startswith("127."):
                raise ValueError(f"a flood stays on loopback (127.0.0.0/8), not {address}")
        _raise_open_files(self.idle + 2 * int(self.per_s * self.handshake_s) + 256)
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def _run(self) -> None:
        self.started = time.monotonic()
        sockets: list[socket.socket] = []
        ctx = zmq.Context()
        clients: list[tuple[float, zmq.Socket]] = []
        try:
            for _ in range(self.idle):
                sock = socket.socket()
                sock.bind((self.source, 0))
                sock.setblocking(False)
                sock.connect_ex((self.host, self.port))
                sockets.append(sock)
            self.opened_idle = len(sockets)
            endpoint = f"tcp://{self.source}:0;{self.host}:{self.port}"
            tick = 0.05
            while not self._stop.is_set() and time.monotonic() - self.started < self.seconds:
                now = time.monotonic()
                for _ in range(max(1, int(self.per_s * tick))):
                    client = ctx.socket(zmq.DEALER)
                    client.setsockopt(zmq.LINGER, 0)
                    client.curve_serverkey = self.server_key
                    client.curve_publickey, client.curve_secretkey = zmq.curve_keypair()
                    client.connect(endpoint)
                    clients.append((now, client))
                    self.handshakes += 1
                while clients and now - clients[0][0] > self.handshake_s:
                    clients.pop(0)[1].close(linger=0)
                self._stop.wait(tick)
        finally:
            for _, client in clients:
                client.close(linger=0)
            ctx.destroy(linger=0)
            for sock in sockets:
                with contextlib.suppress(OSError):
                    sock.close()
            self.ended = time.monotonic()

    def report(self) -> dict:
        return {
            "flood_idle_connections": self.opened_idle,
            "flood_handshakes": self.handshakes,
            "flood_s": round(self.ended - self.started, 1) if self.ended else None,
        }


def _raise_open_files(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))


def limit_open_files(count: int) -> None:
    """Give this process (a child, before exec) `count` open files, soft and hard: it cannot raise them."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (count, count))

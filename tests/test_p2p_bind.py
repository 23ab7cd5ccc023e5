"""The VW's rendezvous store listens on the VW's configured address only, not on every interface."""

from __future__ import annotations

import datetime
import socket
from pathlib import Path

import pytest
import torch.distributed as dist

from hetpipe.worker.p2p import P2P


def listening_addresses(port: int) -> set[str]:
    """The local addresses a socket listens on at `port` (from /proc/net/tcp and tcp6; state 0A: LISTEN)."""
    found = set()
    for name in ("tcp", "tcp6"):
        table = Path(f"/proc/net/{name}")
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                packed = bytes.fromhex(address)
                if name == "tcp":
                    found.add(socket.inet_ntop(socket.AF_INET, packed[::-1]))
                else:
                    words = b"".join(packed[i : i + 4][::-1] for i in range(0, 16, 4))
                    found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


def test_the_rendezvous_store_listens_on_the_vws_host_only() -> None:
    # it listened on every interface ([::]): a curve run's P2P rendezvous took set/get from anyone
    store = P2P.rendezvous_store(0, 2, "127.0.0.1", 0, timeout_s=5)
    port = store.port
    assert listening_addresses(port) == {"127.0.0.1"}
    with pytest.raises(ConnectionRefusedError):  # 127.0.0.2 reaches this machine's loopback too
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
    peer = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=5))
    peer.set("k", "v")
    assert store.get("k") == b"v"

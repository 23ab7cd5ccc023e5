"""P2P between two stage processes over gloo: tensors arrive intact and sent tensors are released."""

from __future__ import annotations

import pytest
import torch

from hetpipe.core.runs.procs import free_port
from hetpipe.worker.p2p import P2P

pytestmark = pytest.mark.slow  # two processes meet over gloo

MESSAGES = 40
MAX_IN_FLIGHT = 3


def _sender(port: int, results) -> None:
    p2p = P2P.connect(0, 2, "127.0.0.1", port, torch.device("cpu"), timeout_s=60, max_in_flight=MAX_IN_FLIGHT)
    most = 0
    for i in range(MESSAGES):
        p2p.send(torch.full((64, 1000), float(i)), 1)
        most = max(most, p2p.outstanding)
    results.put(("sender", most))
    p2p.close()


def _receiver(port: int, results) -> None:
    p2p = P2P.connect(1, 2, "127.0.0.1", port, torch.device("cpu"), timeout_s=60)
    ok = all(torch.equal(p2p.recv(0), torch.full((64, 1000), float(i))) for i in range(MESSAGES))
    results.put(("receiver", ok))
    p2p.close()


def test_sends_arrive_in_order_and_old_sends_are_released(children) -> None:
    # gloo's Work.is_completed() stays False until wait(): a sender that only dropped completed sends kept
    # every tensor it ever sent (a stage grew by ~40 MB/s and paid a page fault per fresh 4 KiB).
    port = free_port()
    results = children.ctx.Queue()
    children.start("sender", _sender, port, results)
    children.start("receiver", _receiver, port, results)
    children.wait()
    got = dict(results.get(timeout=10) for _ in range(2))
    assert got["receiver"] is True
    assert got["sender"] <= 2 * MAX_IN_FLIGHT  # header + data per tensor, at most max_in_flight tensors held


def test_a_rendezvous_port_in_use_names_the_port_and_the_remedy() -> None:
    import socket

    from hetpipe.core.errors import HetpipeError

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(
            HetpipeError, match=rf"rendezvous on 127\.0\.0\.1:{port}: the port is in use.*ps\.port \+ 100"
        ):
            P2P.rendezvous_store(0, 2, "127.0.0.1", port, timeout_s=5)

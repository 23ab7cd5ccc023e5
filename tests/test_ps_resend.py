"""A PS request without an answer goes again under its id, each resend waiting twice as long as the one
before (up to 8 x the first wait): on a link slower than the client was told, every resend of a push or a
pull sends its whole payload again behind the first."""

from __future__ import annotations

from typing import Any

import numpy as np

from hetpipe.worker.ps_calls import BACKOFF_DOUBLINGS, ShardCalls


class Socket:
    """Records when each request went out (the time the test says it is)."""

    def __init__(self) -> None:
        self.sent: list[float] = []
        self.now = 0.0

    def send_multipart(self, frames: list[Any], copy: bool = True, flags: int = 0) -> None:
        self.sent.append(self.now)


PUSH = {"run": "r", "vw": 0, "stage": 0, "wave": 0}


class Watcher:
    def holds_back(self, shard: int, rid: int) -> bool:
        return False


def calls_on(sock: Socket, retry_s: float) -> ShardCalls:
    """Calls over `sock` that never time out in these tests, resent after `retry_s` and on."""
    return ShardCalls([sock], 1e6, retry_s, None, Watcher(), lambda what, waited, gate: what)  # type: ignore[list-item, arg-type]


def resend_times(retry_s: float, until: float) -> list[float]:
    sock = Socket()
    calls = calls_on(sock, retry_s)
    call = calls.send([("push", PUSH, {"k": np.zeros(4, np.float32)})], "push")
    start = call.sent_at[0]
    sock.sent = [0.0]
    for tick in range(1, int(until * 10) + 1):
        sock.now = tick / 10
        calls.send_due(start + sock.now)
    return sock.sent


def test_each_resend_waits_twice_as_long_up_to_eight_times_the_first() -> None:
    assert BACKOFF_DOUBLINGS == 3
    assert resend_times(1.0, 40.0) == [0.0, 1.0, 3.0, 7.0, 15.0, 23.0, 31.0, 39.0]


def test_a_request_to_a_restarted_shard_goes_again_at_once() -> None:
    sock = Socket()
    calls = calls_on(sock, 1.0)
    call = calls.send([("push", PUSH, {"k": np.zeros(4, np.float32)})], "push")
    start = call.sent_at[0]
    for now in (1.0, 3.0, 7.0):
        calls.send_due(start + now)
    calls.resend_to(0)  # worker/ps_recovery.py, once the shard is back
    calls.send_due(start + 7.5)
    assert len(sock.sent) == 5

"""A PS request without an answer goes again under its id, each resend waiting twice as long as the one
before (up to 8 x the first wait): on a link slower than the client was told, every resend of a push or a
pull sends its whole payload again behind the first."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import zmq

from hetpipe.core.protocol import wire
from hetpipe.worker.ps_calls import BACKOFF_DOUBLINGS, BULK_BYTES, ShardCalls
from hetpipe.worker.ps_sockets import ShardSockets


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


def test_a_bulk_request_goes_again_when_its_connection_comes_back_and_not_on_a_timer() -> None:
    """Over real sockets: a push of more than BULK_BYTES reaches the shard once and is not resent while the
    connection stays up (20 x retry_s without an answer); when the shard's socket is replaced (a restart at
    the same address) the client's monitor reports the drop and the handshake, and the push goes again under
    the same id."""
    context = zmq.Context()
    shard = context.socket(zmq.ROUTER)
    port = shard.bind_to_random_port("tcp://127.0.0.1")
    client = ShardSockets([f"tcp://127.0.0.1:{port}"], b"client", None)
    try:
        calls = ShardCalls(client.sockets, 1e6, 0.05, None, Watcher(), lambda what, waited, gate: what)  # type: ignore[arg-type]
        calls.send([("push", PUSH, {"k": np.zeros(BULK_BYTES // 4 + 1, np.float32)})], "push")

        def received(sock: zmq.Socket, seconds: float) -> list[int]:
            """The request ids `sock` took in while the client polled for `seconds`."""
            ids: list[int] = []
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                calls.poll(10)
                while sock.poll(0):
                    frames = sock.recv_multipart()
                    ids.append(wire.decode(frames[1:]).fields["id"])
            return ids

        first = received(shard, 1.0)
        assert len(first) == 1 and calls.watched  # a timer would have resent it about 20 times
        shard.close(linger=0)
        shard = context.socket(zmq.ROUTER)
        for _ in range(100):  # the old socket lets its port go in the background
            try:
                shard.bind(f"tcp://127.0.0.1:{port}")
                break
            except zmq.ZMQError:
                time.sleep(0.05)
        again = received(shard, 3.0)  # sent when the drop is seen, and again after the handshake
        assert again and set(again) == set(first) and len(again) <= 2
    finally:
        shard.close(linger=0)
        client.close()
        context.term()


def test_a_push_that_overtook_an_earlier_one_after_a_drop_waits_for_it() -> None:
    """Pushes of waves 8 and 9 open to one shard; the shard refuses 9 as out of order (8 was lost with the
    connection): 9's call stays open, 8 goes again at once and 9 after retry_s."""
    sock = Socket()
    calls = calls_on(sock, 1.0)
    eight = calls.send([("push", {**PUSH, "wave": 8}, {"k": np.zeros(4, np.float32)})], "push", wave=8)
    nine = calls.send([("push", {**PUSH, "wave": 9}, {"k": np.zeros(4, np.float32)})], "push", wave=9)
    now = nine.sent_at[0]
    refusal = wire.Message("error", {"id": nine.ids[0], "code": "out_of_order", "message": "9 before 8"}, {})
    assert calls._behind(0, nine, refusal) and not nine.done
    sock.sent, sock.now = [], 0.0
    calls.send_due(now + 0.1)
    assert sock.sent == [0.0] and eight.sends[0] == 2 and nine.sends[0] == 1  # 8 again, not 9 yet
    calls.send_due(now + 1.2)
    assert nine.sends[0] == 2
    other = wire.Message("error", {"id": eight.ids[0], "code": "out_of_order", "message": "8 before 7"}, {})
    assert not calls._behind(0, eight, other)  # nothing earlier is open: a real refusal

"""A PS behind a slow link: a reply still crossing it is waited for (timeout_s plus its bytes at the link's
rate), and a timeout says whether the PS is alive (it answers status on a fresh connection) or silent."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from hetpipe.core.protocol import wire
from hetpipe.worker.ps_client import PSClient, PSTimeout

pytestmark = pytest.mark.slow  # a stand-in shard in a thread, waits of seconds

SIZE = 100_000  # float32 values: 400 kB each way, as a register with W_0 moves
RATE = 400_000  # bytes/s of the link the client is told of: 0.8 MB take 2 s on top of timeout_s


class SlowShard:
    """Answers `status` at once, but a register only after `delay_s` (None: never), and nothing else on the
    connection whose register reply is still on its way (on a real link it queues behind those bytes)."""

    def __init__(self, delay_s: float | None) -> None:
        self.delay_s = delay_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        pending: dict[bytes, tuple[float, wire.Message]] = {}  # identity -> (answer at, its register)
        while not self.stopping:
            if self.sock.poll(20):
                identity, *body = self.sock.recv_multipart(copy=False)
                msg = wire.decode(body)
                identity = identity.bytes
                if msg.type == "register" and identity not in pending:
                    delay = float("inf") if self.delay_s is None else self.delay_s
                    pending[identity] = (time.monotonic() + delay, msg)
                elif msg.type == "status" and identity not in pending:
                    info = {"c_global": 0, "c_local": [0], "staleness": 0, "slowest_vw": None}
                    self.sock.send_multipart(
                        [identity, *wire.encode("status_reply", {"id": msg.fields["id"], "info": info})]
                    )
            for identity, (at, msg) in list(pending.items()):
                if time.monotonic() >= at:
                    fields = {
                        "id": msg.fields["id"],
                        "c_global": 0,
                        "pushed": 0,
                        "keep_from": 0,
                        "ckpt_from": 0,
                    }
                    tensors = {k: v.to_array() for k, v in msg.tensors.items()}
                    self.sock.send_multipart([identity, *wire.encode("registered", fields, tensors)])
                    pending[identity] = (float("inf"), msg)

    def close(self) -> None:
        self.stopping = True
        self.thread.join(5)
        self.sock.close(linger=0)
        self.ctx.term()


def register_through_slow_link(delay_s: float | None) -> float:
    shard = SlowShard(delay_s)
    try:
        with PSClient(
            [f"tcp://127.0.0.1:{shard.port}"], "slow", 0, 0, 1, 1, {"k": 0}, timeout_s=1, retry_s=0.5
        ) as ps:
            ps.calls.link_bytes_per_s = RATE
            started = time.monotonic()
            ps.register({"k": np.zeros(SIZE, np.float32)})
            return time.monotonic() - started
    finally:
        shard.close()


def test_a_reply_still_crossing_a_slow_link_is_waited_for() -> None:
    # stages' first pulls of a 3.95 MB model over 2.3 Mbit/s links failed: "the PS does not answer either: is
    # it running?" (its status reply queued behind the bytes of the very reply the client waited for)
    assert register_through_slow_link(delay_s=2.0) > 1.5


def test_a_timeout_says_the_ps_is_alive_when_it_answers_a_fresh_connection() -> None:
    with pytest.raises(PSTimeout) as err:
        register_through_slow_link(delay_s=None)
    text = str(err.value)
    assert "register by vw 0 stage 0 got no complete answer in 3 s" in text
    assert "answers status on a fresh connection" in text and "is it running?" not in text
    assert "0.80 MB" in text and "raise [ps] timeout_s" in text

"""Fuzz a live PS shard with 10,000 mutated, truncated and oversized messages: it must not crash, its
weights and clocks must not change, and a good client must still work afterwards."""

from __future__ import annotations

import random

import numpy as np
import pytest
import zmq

from hetpipe.core import wire
from hetpipe.server.shard import ShardSettings
from hetpipe.worker.ps_client import PSClient

from conftest import start_shard

pytestmark = pytest.mark.slow

RUN = "fuzz"


def corpus() -> list[list[bytes]]:
    """Valid messages of every type; pushes and pulls name stages that are registered by another peer."""
    small = {"k": np.arange(6, dtype=np.float32).reshape(2, 3)}
    big = {"k": np.zeros(300_000, np.float32)}  # 1.2 MB: two data frames
    base = {"run": RUN, "vw": 0, "stage": 0}
    plain = {"num_waves": 0, "buffers": [], "ledgers": []}
    msgs = [
        wire.encode("register", {"id": 1, **base, "num_vws": 1, "num_stages": 1, "want_weights": True, **plain}, small),
        wire.encode("register", {"id": 2, "run": RUN, "vw": 0, "stage": 1, "num_vws": 1, "num_stages": 2,
                                 "want_weights": False, **plain}, big),
        wire.encode("push", {"id": 3, **base, "wave": 0}, small),
        wire.encode("push", {"id": 4, **base, "wave": 3}, small),
        wire.encode("pull", {"id": 5, **base, "wave": 4}),
        wire.encode("status", {"id": 6, "run": RUN}),
        wire.encode("read", {"id": 7, "run": RUN}),
        wire.encode("ack", {"id": 8, "wave": 0, "applied": True, "c_global": 0}),
    ]
    return [[bytes(f) for f in m] for m in msgs]


def mutate(frames: list[bytes], rng: random.Random) -> list[bytes]:
    frames = [bytearray(f) for f in frames]
    op = rng.random()
    if op < 0.45:  # flip bytes in the header or a data frame
        f = frames[0] if rng.random() < 0.8 or len(frames) == 1 else rng.choice(frames[1:])
        for _ in range(rng.randint(1, 4)):
            if f:
                f[rng.randrange(len(f))] = rng.randrange(256)
    elif op < 0.6:  # truncate a frame
        i = rng.randrange(len(frames))
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    elif op < 0.7:  # drop or duplicate a frame
        i = rng.randrange(len(frames))
        if rng.random() < 0.5 and len(frames) > 1:
            del frames[i]
        else:
            frames.insert(i, frames[i])
    elif op < 0.8:  # append garbage frames
        frames += [bytearray(rng.randbytes(rng.randint(0, 64))) for _ in range(rng.randint(1, 3))]
    elif op < 0.9:  # replace the header with random bytes
        frames[0] = bytearray(rng.randbytes(rng.randint(0, 200)))
    elif op < 0.99:  # splice a header field value from another message type
        frames[0] = bytearray(frames[0][: len(frames[0]) // 2] + rng.randbytes(8))
    else:  # oversized frame: libzmq drops the connection (MAXMSGSIZE), the DEALER reconnects
        frames.append(bytearray(wire.MAX_FRAME_BYTES + 70_000))
    return [bytes(f) for f in frames]


def test_fuzz_10000_messages(children):
    endpoint, server = start_shard(children, ShardSettings(RUN, 0, "tcp://127.0.0.1:0", 0))
    good = PSClient([endpoint], RUN, 0, 0, 1, 1, {"k": 0}, timeout_s=10, retry_s=1)
    good.register({"k": np.zeros((2, 3), np.float32)})
    for wave in range(3):
        good.push(wave, {"k": np.full((2, 3), wave + 1, np.float32)})
    before_weights, before_status = good.read(), good.status()

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 10)
    sock.connect(endpoint)
    rng = random.Random(1234)
    seeds = corpus()
    probe = wire.encode("status", {"id": 99, "run": RUN})
    unanswered = oversized = 0
    seen_codes: dict[str, int] = {}

    def answer(timeout_ms: int) -> wire.Message | None:
        return wire.decode(sock.recv_multipart()) if sock.poll(timeout_ms) else None

    try:
        for i in range(10_000):
            frames = mutate(rng.choice(seeds), rng)
            sock.send_multipart(frames)
            if max(len(f) for f in frames) > wire.MAX_FRAME_BYTES:
                oversized += 1  # the server drops the connection; wait until a probe gets through again
                while answer(0) is not None:
                    pass
                while True:
                    sock.send_multipart(probe)
                    if answer(200) is not None:
                        break
                continue
            reply = answer(2000)
            if reply is None:
                unanswered += 1
            elif reply.type == "error":
                seen_codes[reply.fields["code"]] = seen_codes.get(reply.fields["code"], 0) + 1
            if i % 500 == 0:
                assert server.process.is_alive(), server.log.read_text()
    finally:
        sock.close()
        ctx.term()

    assert server.process.is_alive(), server.log.read_text()
    assert unanswered == 0, f"{unanswered} of {10_000 - oversized} requests got no reply"
    assert oversized > 50
    assert "internal" not in seen_codes, server.log.read_text()
    assert {"bad_message", "not_registered", "run_mismatch"} <= set(seen_codes), seen_codes
    after_weights, after_status = good.read(), good.status()
    np.testing.assert_array_equal(after_weights["k"], before_weights["k"])
    for key in ("c_global", "c_local", "version", "registered"):
        assert after_status[0][key] == before_status[0][key]
    good.push(3, {"k": np.ones((2, 3), np.float32)})  # the good client still works
    np.testing.assert_array_equal(good.pull(5).tensors["k"], np.full((2, 3), 7.0))
    good.close()

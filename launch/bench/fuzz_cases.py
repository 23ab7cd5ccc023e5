"""Bad input for a PS shard, and what it must answer: a seeded generator of fuzz cases (shared by
launch/bench/fuzz.py and tests/test_ps_fuzz.py; the tests add hypothesis-driven cases of their own).

The shard under fuzz serves run RUN with two VWs of one stage each, both registered with MODEL's keys and
both past waves 0..2 (c_global 3, D = 0, exact pulls). Cases come from two connections:
  stranger - never registered: mutated, truncated, oversized, mistyped and replayed messages; what each must
             get back is decided by decoding it here (`oracle`): the same WireError code, or the refusal the
             shard gives an unregistered connection;
  member   - registered as vw 1: well-formed requests that the WSP rules must refuse or answer without a
             change: wrong shapes and dtypes, missing and extra keys, NaN and inf payloads, out-of-order and
             replayed pushes, stale and parked pulls, pulls and pushes claiming vw 0.
No case may change the weights or the clocks.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import msgpack
import numpy as np

from hetpipe.core.protocol import wire

__all__ = [
    "MEMBER_VW",
    "MODEL",
    "RUN",
    "WAVES_DONE",
    "Case",
    "CaseGenerator",
    "Expect",
    "errors",
    "model",
    "oracle",
    "replies",
]

RUN = "fuzz"
MODEL = {"k": (2, 3), "big": (300_000,)}  # "big" is 1.2 MB: two data frames
MEMBER_VW = 1
WAVES_DONE = 3  # both VWs pushed waves 0..2 before the fuzz starts
REQUESTS = ("register", "push", "pull", "status", "read", "heartbeat", "evict", "rejoin")
REGISTER = {
    "num_vws": 2,
    "num_stages": 1,
    "num_waves": 0,
    "buffers": [],
    "ledgers": [],
    "start_wave": 0,
    "vw_weights": [],
    "members": [],
    "vw_spans": [],
}  # a registration's fields
MAXMSGSIZE = wire.MAX_FRAME_BYTES + (
    64 << 10
)  # wire.configure_socket's limit: a bigger frame drops the connection


def model(value: float = 0.0, dtype: str = "float32") -> dict[str, np.ndarray]:
    return {key: np.full(shape, value, dtype) for key, shape in MODEL.items()}


@dataclass(frozen=True)
class Expect:
    """What the shard must do with one case."""

    codes: frozenset[str] = frozenset()  # an error reply with one of these codes
    replies: frozenset[str] = (
        frozenset()
    )  # or a reply of one of these types ("ack" only with applied = false)
    dropped: bool = False  # no reply: a frame over MAXMSGSIZE costs the message and the connection
    parked: bool = False  # no reply yet: a pull whose gate is closed waits (and is answered when replaced)

    def allows(self, reply: wire.Message) -> bool:
        if reply.type == "error":
            return reply.fields["code"] in self.codes
        if reply.type == "ack" and reply.fields["applied"]:
            return False  # an applied push would change the weights
        return reply.type in self.replies


def errors(*codes: str) -> Expect:
    return Expect(codes=frozenset(codes))


def replies(*types: str) -> Expect:
    return Expect(replies=frozenset(types))


@dataclass(frozen=True)
class Case:
    kind: str
    sender: str  # "stranger" | "member"
    frames: list[bytes]
    expect: Expect
    request_id: int | None = None  # the id the reply must carry, when the case knows it


def oracle(frames: list[bytes]) -> Expect:
    """What the shard must answer a stranger (an unregistered connection) sending `frames`."""
    if any(len(f) > MAXMSGSIZE for f in frames):
        return Expect(dropped=True)
    try:
        msg = wire.decode(frames)
    except wire.WireError as err:
        return errors(err.code)
    if msg.type not in REQUESTS:
        return errors("bad_message")
    if msg.fields["run"] != RUN:
        return errors("run_mismatch")
    if msg.type == "status":
        return replies("status_reply")
    if msg.type == "read":
        return replies("snapshot")
    if msg.type == "register":  # every (vw, stage) of the run is taken, and nothing else fits it
        return errors("conflict", "bad_message", "non_finite")
    if msg.type in ("evict", "rejoin"):  # the shard under fuzz stops on a VW failure: it evicts nobody
        return errors("conflict")
    return errors("not_registered")


def _bytes(frames: list) -> list[bytes]:
    return [bytes(f) for f in frames]


# Values of the wrong type (or range) for any header field.
_WRONG = [
    None,
    True,
    -1,
    2**31,
    2**63,
    -(2**63),
    1.5,
    math.nan,
    math.inf,
    "",
    "x" * 300,
    b"\x00\xff",
    [],
    [1, 2],
    {},
    {"a": 1},
    "push",
    0,
]


class CaseGenerator:
    """An endless, reproducible stream of fuzz cases from one seed."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self._ids = iter(range(10_000, 2**62))
        self._big = np.zeros(MODEL["big"], np.float32)
        self.sent: deque[list[bytes]] = deque(maxlen=64)  # for replays
        self.corpus = self._corpus()
        kinds = [
            (self.mutated, 30),
            (self.truncated, 10),
            (self.oversized, 1),
            (self.wrong_types, 10),
            (self.tensor_spec, 6),
            (self.replayed, 5),
            (self.wrong_shape, 6),
            (self.wrong_dtype, 6),
            (self.wrong_keys, 4),
            (self.non_finite, 8),
            (self.replayed_push, 4),
            (self.replayed_register, 2),
            (self.out_of_order, 4),
            (self.pull, 3),
            (self.parked_pull, 1),
            (self.impersonation, 2),
        ]
        self._makers = [maker for maker, _ in kinds]
        self._weights = [weight for _, weight in kinds]

    @property
    def kinds(self) -> list[str]:
        """The names of every kind of case this generator makes."""
        return [maker.__name__ for maker in self._makers]

    def __iter__(self) -> Iterator[Case]:
        return self

    def __next__(self) -> Case:
        case = self.rng.choices(self._makers, self._weights)[0]()
        self.sent.append(case.frames)
        return case

    # ---- helpers --------------------------------------------------------------------------------------
    def _id(self) -> int:
        return next(self._ids)

    def _member(self, kind: str, msg_type: str, fields: dict, tensors: dict | None, expect: Expect) -> Case:
        rid = self._id()
        frames = _bytes(wire.encode(msg_type, {"id": rid, "run": RUN, **fields}, tensors))
        return Case(kind, "member", frames, expect, rid)

    def _push(self, wave: int, **tensors: np.ndarray) -> dict:
        return {"k": tensors.get("k", np.ones(MODEL["k"], np.float32)), "big": tensors.get("big", self._big)}

    def _stranger(self, kind: str, frames: list[bytes]) -> Case:
        return Case(kind, "stranger", frames, oracle(frames))

    def _corpus(self) -> list[list[bytes]]:
        """Valid messages of every type, as a stranger would send them."""
        small = {"k": np.arange(6, dtype=np.float32).reshape(2, 3)}
        base = {"run": RUN, "vw": 0, "stage": 0}
        return [
            _bytes(m)
            for m in (
                wire.encode("register", {"id": 1, **base, **REGISTER, "want_weights": True}, small),
                wire.encode(
                    "register",
                    {"id": 2, "run": RUN, "vw": 1, "stage": 0, **REGISTER, "want_weights": False},
                    model(),
                ),
                wire.encode("push", {"id": 3, **base, "wave": 0}, small),
                wire.encode("push", {"id": 4, **base, "wave": 3}, model(1.0)),
                wire.encode("pull", {"id": 5, **base, "wave": 4}),
                wire.encode("status", {"id": 6, "run": RUN}),
                wire.encode("read", {"id": 7, "run": RUN}),
                wire.encode(
                    "ack",
                    {"id": 8, "wave": 0, "applied": True, "c_global": 0, "keep_from": 0, "ckpt_from": 0},
                ),
                wire.encode("heartbeat", {"id": 10, **base, "progress": 3}),
                wire.encode("evict", {"id": 11, "run": RUN, "vw": 1}),
                wire.encode("rejoin", {"id": 12, "run": RUN, "vw": 1, "start_wave": 9}),
                wire.encode("error", {"id": 9, "code": "stale", "message": "x"}),
            )
        ]

    # ---- stranger: malformed bytes ------------------------------------------------------------------------
    def mutated(self) -> Case:
        frames = [bytearray(f) for f in self.rng.choice(self.corpus)]
        op = self.rng.random()
        if op < 0.5:  # flip bytes, mostly in the header
            f = frames[0] if self.rng.random() < 0.8 or len(frames) == 1 else self.rng.choice(frames[1:])
            for _ in range(self.rng.randint(1, 4)):
                if f:
                    f[self.rng.randrange(len(f))] = self.rng.randrange(256)
        elif op < 0.65:  # drop or duplicate a frame
            i = self.rng.randrange(len(frames))
            if self.rng.random() < 0.5 and len(frames) > 1:
                del frames[i]
            else:
                frames.insert(i, frames[i])
        elif op < 0.8:  # append garbage frames
            frames += [
                bytearray(self.rng.randbytes(self.rng.randint(0, 64))) for _ in range(self.rng.randint(1, 3))
            ]
        elif op < 0.9:  # a header of random bytes
            frames[0] = bytearray(self.rng.randbytes(self.rng.randint(0, 200)))
        else:  # half a header and garbage
            frames[0] = bytearray(frames[0][: len(frames[0]) // 2] + self.rng.randbytes(8))
        return self._stranger("mutated", _bytes(frames))

    def truncated(self) -> Case:
        frames = list(self.rng.choice(self.corpus))
        i = self.rng.randrange(len(frames))
        frames[i] = frames[i][: self.rng.randrange(len(frames[i]) + 1)]
        return self._stranger("truncated", frames)

    def oversized(self) -> Case:
        frames = list(self.rng.choice(self.corpus))
        if self.rng.random() < 0.5:  # over MAXMSGSIZE: libzmq drops it with the connection
            frames.append(bytes(MAXMSGSIZE + 1 + self.rng.randrange(64 << 10)))
        else:  # within MAXMSGSIZE but over the wire limits: a header or a data frame too long
            i = self.rng.randrange(len(frames))
            frames[i] = frames[i] + bytes(
                wire.MAX_FRAME_BYTES + 1 - len(frames[i]) + self.rng.randrange(1 << 16)
            )
        return self._stranger("oversized", frames)

    def wrong_types(self) -> Case:
        """A valid header with one field (or v, type, a tensor entry) replaced by a value of another type."""
        frames = list(self.rng.choice(self.corpus))
        header = msgpack.unpackb(frames[0], raw=False)
        name = self.rng.choice([*header, "extra"])
        header[name] = self.rng.choice(_WRONG)
        frames[0] = msgpack.packb(header, use_bin_type=True)
        return self._stranger("wrong_types", frames)

    def tensor_spec(self) -> Case:
        """Tensor entries that lie: unknown dtypes, negative or huge shapes, frames that do not add up."""
        header = {
            "v": 1,
            "type": "push",
            "id": self._id(),
            "run": RUN,
            "vw": MEMBER_VW,
            "stage": 0,
            "wave": 3,
        }
        dtype = self.rng.choice(["float32", "float128", "complex64", "bool", "<f4", "object", 7])
        ndim = self.rng.randint(0, 10)
        shape = [self.rng.choice([0, 1, 3, -1, 2**40, 1.0]) for _ in range(ndim)]
        header["tensors"] = [{"key": "k", "dtype": dtype, "shape": shape}]
        count = self.rng.randint(0, 3)
        frames = [msgpack.packb(header, use_bin_type=True)] + [
            self.rng.randbytes(self.rng.randint(0, 64)) for _ in range(count)
        ]
        return self._stranger("tensor_spec", frames)

    def replayed(self) -> Case:
        """An earlier case's frames sent again by the stranger (the shard keeps no state for it)."""
        frames = self.rng.choice(self.sent) if self.sent else self.rng.choice(self.corpus)
        return self._stranger("replayed", frames)

    # ---- member: well-formed, refused by the rules ---------------------------------------------------------
    def _stage(self, wave: int | None = None) -> dict:
        fields = {"vw": MEMBER_VW, "stage": 0}
        return fields if wave is None else {**fields, "wave": wave}

    def wrong_shape(self) -> Case:
        shape = self.rng.choice([(3, 2), (6,), (2, 3, 1), (0,), (1, 2, 3)])
        tensors = self._push(3, k=np.ones(shape, np.float32))
        return self._member("wrong_shape", "push", self._stage(WAVES_DONE), tensors, errors("bad_message"))

    def wrong_dtype(self) -> Case:
        dtype = self.rng.choice(["float16", "float64", "int32", "int64"])
        tensors = self._push(3, k=np.ones(MODEL["k"], dtype))
        return self._member("wrong_dtype", "push", self._stage(WAVES_DONE), tensors, errors("bad_message"))

    def wrong_keys(self) -> Case:
        tensors = self._push(3)
        if self.rng.random() < 0.5:
            del tensors[self.rng.choice(list(tensors))]
        else:
            tensors[f"extra{self.rng.randrange(10)}"] = np.ones(2, np.float32)
        return self._member("wrong_keys", "push", self._stage(WAVES_DONE), tensors, errors("bad_message"))

    def non_finite(self) -> Case:
        k = self.np_rng.standard_normal(MODEL["k"]).astype(np.float32)
        for _ in range(self.rng.randint(1, 6)):
            k.flat[self.rng.randrange(k.size)] = self.rng.choice([np.nan, np.inf, -np.inf])
        wave = self.rng.choice(
            [WAVES_DONE, self.rng.randrange(WAVES_DONE), WAVES_DONE + 7]
        )  # any wave: checked first
        if self.rng.random() < 0.5:
            return self._member(
                "non_finite", "push", self._stage(wave), self._push(wave, k=k), errors("non_finite")
            )
        fields = {**self._stage(), **REGISTER, "want_weights": False}
        return self._member("non_finite", "register", fields, self._push(0, k=k), errors("non_finite"))

    def replayed_push(self) -> Case:
        """A push of a wave already applied, with other values: acknowledged, not applied (idempotent)."""
        wave = self.rng.randrange(WAVES_DONE)
        tensors = self._push(wave, k=np.full(MODEL["k"], 100.0, np.float32))
        return self._member("replayed_push", "push", self._stage(wave), tensors, replies("ack"))

    def replayed_register(self) -> Case:
        fields = {**self._stage(), **REGISTER, "want_weights": self.rng.random() < 0.5}
        if self.rng.random() < 0.5:  # the same keys: answered, nothing changes
            return self._member("replayed_register", "register", fields, model(5.0), replies("registered"))
        tensors = {"k": np.ones((3, 3), np.float32), "big": self._big}  # other shapes: refused
        return self._member("replayed_register", "register", fields, tensors, errors("conflict"))

    def out_of_order(self) -> Case:
        wave = WAVES_DONE + self.rng.randint(1, 1000)
        return self._member(
            "out_of_order", "push", self._stage(wave), self._push(wave), errors("out_of_order")
        )

    def pull(self) -> Case:
        """Pulls the gate lets through (c_global 3, D 0: waves <= 4): answered with the weights, or refused as
        stale when the W_t they need was folded away (which ones is the WSP state's business)."""
        wave = self.rng.randint(0, WAVES_DONE + 1)
        expect = Expect(codes=frozenset({"stale"}), replies=frozenset({"weights"}))
        return self._member("pull", "pull", self._stage(wave), None, expect)

    def parked_pull(self) -> Case:
        wave = WAVES_DONE + 2 + self.rng.randint(0, 100)
        return self._member("parked_pull", "pull", self._stage(wave), None, Expect(parked=True))

    def impersonation(self) -> Case:
        """The member's connection claiming vw 0's stage (registered from another connection)."""
        wave = WAVES_DONE
        if self.rng.random() < 0.5:
            return self._member(
                "impersonation",
                "push",
                {"vw": 0, "stage": 0, "wave": wave},
                self._push(wave),
                errors("not_registered"),
            )
        return self._member(
            "impersonation", "pull", {"vw": 0, "stage": 0, "wave": 2}, None, errors("not_registered")
        )

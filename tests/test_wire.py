"""Tests for hetpipe/wire.py: round trips, table-driven rejections, a fuzz property, chunked arithmetic."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetpipe.core.protocol import wire
from hetpipe.core.protocol.wire import (
    CHUNK_BYTES,
    DTYPES,
    PROTOCOL_VERSION,
    Message,
    WireError,
    decode,
    encode,
)

BIG = int(2.5 * CHUNK_BYTES) // 4 + 3  # float32 elements: 3 frames, the last one partial


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out: dict[str, np.ndarray] = {}
    for name in DTYPES:
        out[f"{name}/matrix"] = (rng.standard_normal((3, 5)) * 100).astype(name)
        out[f"{name}/scalar"] = np.asarray(rng.standard_normal() * 100).astype(name)
        out[f"{name}/empty"] = np.zeros((0, 4), dtype=name)
    out["big"] = rng.standard_normal(BIG).astype(np.float32)
    return out


FIELDS: dict[str, dict] = {
    "register": {
        "id": 1,
        "run": "r",
        "vw": 0,
        "stage": 2,
        "num_vws": 3,
        "num_stages": 4,
        "want_weights": True,
        "num_waves": 10,
        "buffers": ["2.bn.running_mean"],
        "ledgers": [],
        "start_wave": 0,
        "vw_weights": [1, 5, 2],
        "members": [0, 2],
        "vw_spans": [[0, 4], [4, 0]],
    },
    "push": {"id": 2**63 - 1, "run": "r" * 128, "vw": 1, "stage": 0, "wave": 2**31 - 1},
    "pull": {"id": 3, "run": "run-7", "vw": 1, "stage": 0, "wave": 5},
    "status": {"id": 4, "run": "r"},
    "read": {"id": 5, "run": "r"},
    "heartbeat": {"id": 11, "run": "r", "vw": 1, "stage": 0, "progress": 77},
    "evict": {"id": 12, "run": "r", "vw": 1},
    "rejoin": {"id": 13, "run": "r", "vw": 1, "start_wave": 9},
    "registered": {"id": 6, "c_global": 0, "pushed": 0, "keep_from": 0, "ckpt_from": 0},
    "ack": {"id": 7, "wave": 3, "applied": False, "c_global": 2, "keep_from": 1, "ckpt_from": 1},
    "weights": {
        "id": 8,
        "wave": 3,
        "version": 9,
        "own_through": -1,
        "parked_ms": 12,
        "gaps": [[1, 2, -1], [0, 1, 4]],
    },
    "beat": {"id": 14, "c_global": 3, "keep_from": 2, "ckpt_from": 1},
    "evicted": {"id": 15, "vw": 1, "at_wave": 3},
    "rejoined": {"id": 16, "vw": 1, "start_wave": 9},
    "status_reply": {"id": 9, "info": {"vws": [1, 2.5, None, "x", b"b"], "nested": {"a": {"b": [True]}}}},
    "snapshot": {"id": 10, "version": 0, "info": {}},
    "error": {"id": None, "code": "stale", "message": "wave 3 is older than c_global - D"},
}
WITH_TENSORS = ["register", "push", "registered", "weights", "snapshot"]


def _frames_needed(arrays: dict[str, np.ndarray]) -> int:
    return sum(-(-a.nbytes // CHUNK_BYTES) for a in arrays.values())


# ---------------------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("msg_type", sorted(FIELDS))
def test_round_trip_fields(msg_type: str) -> None:
    frames = encode(msg_type, FIELDS[msg_type])
    assert len(frames) == 1
    msg = decode(frames)
    assert msg == Message(msg_type, FIELDS[msg_type], {})


@pytest.mark.parametrize("msg_type", WITH_TENSORS)
def test_round_trip_tensors(msg_type: str) -> None:
    arrays = _tensors()
    frames = encode(msg_type, FIELDS[msg_type], arrays)
    assert len(frames) == 1 + _frames_needed(arrays)
    assert _frames_needed({"big": arrays["big"]}) == 3
    for frame in frames[1:]:
        assert isinstance(frame, memoryview)
        assert len(frame) <= CHUNK_BYTES
        assert any(frame.obj is a for a in arrays.values())  # zero-copy: a view of the caller's array
    msg = decode([bytes(f) for f in frames])
    assert msg.type == msg_type and msg.fields == FIELDS[msg_type]
    assert list(msg.tensors) == list(arrays)
    for key, arr in arrays.items():
        view = msg.tensors[key]
        assert (view.dtype, view.shape, view.nbytes) == (arr.dtype, arr.shape, arr.nbytes)
        out = view.to_array()
        assert out.dtype == arr.dtype and out.shape == arr.shape
        np.testing.assert_array_equal(out, arr)
        assert all(c.ndim == 1 and not c.flags.writeable and c.dtype == arr.dtype for c in view.chunks)


def test_decode_is_zero_copy_over_frames() -> None:
    arr = np.arange(1000, dtype=np.float64)
    frames = [bytes(f) for f in encode("push", FIELDS["push"], {"w": arr})]
    view = decode(frames).tensors["w"]
    assert np.shares_memory(view.chunks[0], np.frombuffer(frames[1], dtype=np.uint8))
    assert np.shares_memory(view.to_array(), view.chunks[0])


def test_non_contiguous_and_big_endian_arrays_are_sent_as_c_order_little_endian() -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    swapped = np.arange(6, dtype=">i4")
    msg = decode(encode("push", FIELDS["push"], {"t": base.T, "s": swapped}))
    np.testing.assert_array_equal(msg.tensors["t"].to_array(), base.T)
    np.testing.assert_array_equal(msg.tensors["s"].to_array(), swapped)


def test_round_trip_over_configured_tcp_sockets_and_maxmsgsize_is_per_frame() -> None:
    """A 2.5 MiB tensor (total above MAXMSGSIZE) passes in 1 MiB frames; one oversized frame is dropped."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        wire.configure_socket(router, router=True)
        wire.configure_socket(dealer, router=False)
        assert router.getsockopt(zmq.MAXMSGSIZE) == wire.MAX_FRAME_BYTES + (64 << 10)
        assert router.getsockopt(zmq.LINGER) == 0 and router.getsockopt(zmq.TCP_KEEPALIVE) == 1
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        arr = np.arange(BIG, dtype=np.float32)
        dealer.send_multipart(encode("push", FIELDS["push"], {"w": arr}), copy=False)
        assert router.poll(5000)
        identity, *frames = router.recv_multipart(copy=False)
        assert sum(len(f.buffer) for f in frames) > router.getsockopt(zmq.MAXMSGSIZE)
        np.testing.assert_array_equal(decode(frames).tensors["w"].to_array(), arr)
        with pytest.raises(zmq.ZMQError):  # ROUTER_MANDATORY: unknown peer raises, no silent drop
            router.send_multipart([b"nobody", *wire.error_frames(None, "internal", "x")])
        dealer.send_multipart([b"x" * (router.getsockopt(zmq.MAXMSGSIZE) + 1)])
        assert not router.poll(300)
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


def test_error_frames() -> None:
    msg = decode(wire.error_frames(12, "conflict", "m" * 10_000))
    assert msg.fields["id"] == 12 and msg.fields["code"] == "conflict"
    assert len(msg.fields["message"]) == wire.MAX_MESSAGE_CHARS
    assert decode(wire.error_frames(-1, "internal", "x")).fields["id"] is None
    with pytest.raises(WireError, match="error.code"):
        wire.error_frames(1, "oops", "x")


# ---------------------------------------------------------------------------------------------------------
# Rejections


def _header(msg_type: str = "pull", tensors: list | None = None, **changes: object) -> dict:
    header: dict = {"v": PROTOCOL_VERSION, "type": msg_type, **FIELDS[msg_type]}
    if tensors is not None:
        header["tensors"] = tensors
    for key, value in changes.items():
        if value is _DROP:
            del header[key]
        else:
            header[key] = value
    return header


_DROP = object()
_F32 = [{"key": "w", "dtype": "float32", "shape": [2, 3]}]
_W24 = b"\0" * 24


def _msg(header: object, *data: bytes) -> list[bytes]:
    return [msgpack.packb(header, use_bin_type=True), *data]


REJECTIONS = [
    ("wrong version", _msg(_header(v=1)), "version", "version 1"),
    ("version as bool", _msg(_header(v=True)), "version", "version True"),
    ("no version", _msg(_header(v=_DROP)), "version", "version None"),
    ("unknown type", _msg(_header(type="shove")), "bad_message", "unknown message type 'shove'"),
    ("missing field", _msg(_header(wave=_DROP)), "bad_message", "missing field 'wave'"),
    ("extra field", _msg(_header(colour="red")), "bad_message", "unknown field 'colour'"),
    ("tensors on pull", _msg(_header(tensors=[])), "bad_message", "unknown field 'tensors'"),
    ("missing tensors", _msg(_header("push")), "bad_message", "missing field 'tensors'"),
    ("bool as int", _msg(_header(vw=True)), "bad_message", "pull.vw must be an int"),
    ("int as bool", _msg(_header("ack", applied=1)), "bad_message", "ack.applied must be a bool"),
    ("negative int", _msg(_header(wave=-1)), "bad_message", "pull.wave must be an int in [0, 2**31)"),
    ("int too big", _msg(_header(stage=2**31)), "bad_message", "pull.stage must be an int"),
    ("float as int", _msg(_header(id=1.0)), "bad_message", "pull.id must be an int in [0, 2**63)"),
    ("zero num_vws", _msg(_header("register", [], num_vws=0)), "bad_message", "register.num_vws"),
    ("own_through -2", _msg(_header("weights", [], own_through=-2)), "bad_message", "own_through"),
    ("buffers not names", _msg(_header("register", [], buffers=[1])), "bad_message", "register.buffers"),
    ("zero weight", _msg(_header("register", [], vw_weights=[1, 0])), "bad_message", "register.vw_weights"),
    (
        "ledgers not a list",
        _msg(_header("register", [], ledgers="audit/0")),
        "bad_message",
        "register.ledgers",
    ),
    ("empty run", _msg(_header(run="")), "bad_message", "pull.run must be a str of 1..128"),
    ("long run", _msg(_header(run="r" * 129)), "bad_message", "pull.run must be a str"),
    ("bad error code", _msg(_header("error", code="oops")), "bad_message", "error.code must be one of"),
    ("info not map", _msg(_header("status_reply", info=[1])), "bad_message", "status_reply.info"),
    ("info too deep", _msg(_header("status_reply", info={"a": [[[{"b": 1}]]]})), "bad_message", "depth <= 4"),
    (
        "info int key",
        _msg(_header("status_reply", info={"a": {1: 2}})),
        "bad_message",
        "not allowed for map key",
    ),
    ("info bytes key", _msg(_header("status_reply", info={"a": {b"k": 2}})), "bad_message", "str keys"),
    ("duplicate key", _msg(_header("push", _F32 * 2), _W24, _W24), "bad_message", "duplicate tensor key 'w'"),
    (
        "bad dtype",
        _msg(_header("push", [{**_F32[0], "dtype": "uint8"}]), b"\0" * 6),
        "bad_message",
        "dtype 'uint8' (str) is not allowed",
    ),
    ("empty key", _msg(_header("push", [{**_F32[0], "key": ""}]), _W24), "bad_message", "key must be a str"),
    ("extra spec field", _msg(_header("push", [{**_F32[0], "x": 1}]), _W24), "bad_message", "exactly key"),
    ("negative dim", _msg(_header("push", [{**_F32[0], "shape": [-2, -3]}]), _W24), "bad_message", "shape"),
    ("bool dim", _msg(_header("push", [{**_F32[0], "shape": [True]}]), b"\0" * 4), "bad_message", "shape"),
    (
        "too many dims",
        _msg(_header("push", [{**_F32[0], "shape": [1] * 9}]), b"\0" * 4),
        "bad_message",
        "<= 8 ints",
    ),
    (
        "tensor too big",
        _msg(_header("push", [{**_F32[0], "shape": [2**31, 2]}])),
        "bad_message",
        "exceeds 8589934592 bytes",
    ),
    ("frame length", _msg(_header("push", _F32), b"\0" * 20), "bad_message", "has 20 bytes, expected 24"),
    (
        "too few frames",
        _msg(_header("push", _F32)),
        "bad_message",
        "needing 1 data frames but the message has 0",
    ),
    ("too many frames", _msg(_header("push", _F32), _W24, b""), "bad_message", "needing 1 data frames"),
    ("frames on pull", _msg(_header(), b"x"), "bad_message", "carries no data frames"),
    ("non-map header", _msg([1, "pull"]), "bad_message", "header must be a msgpack map"),
    ("garbage bytes", [b"\xc1\xff\x00garbage"], "bad_message", "not valid msgpack"),
    ("trailing bytes", [msgpack.packb(_header()) + b"\x00"], "bad_message", "1 bytes after its msgpack map"),
    ("repeated map key", [b"\x82\xa1v\x01\xa1v\x01"], "bad_message", "repeated key"),
    ("ext type", [msgpack.packb(msgpack.ExtType(1, b"x"))], "bad_message", "not valid msgpack"),
    (
        "oversize header",
        [b"\x00" * (wire.MAX_HEADER_BYTES + 1)],
        "bad_message",
        "over the 1048576-byte limit",
    ),
    ("huge array claim", [b"\xdd\xff\xff\xff\xff"], "bad_message", "not valid msgpack"),
    ("no frames", [], "bad_message", "non-empty sequence"),
    ("frame of wrong type", [msgpack.packb(_header()), 3], "bad_message", "frame 1 must be"),
]


@pytest.mark.parametrize(
    ("frames", "code", "text"), [r[1:] for r in REJECTIONS], ids=[r[0] for r in REJECTIONS]
)
def test_decode_rejects(frames: list, code: str, text: str) -> None:
    with pytest.raises(WireError) as caught:
        decode(frames)
    assert caught.value.code == code
    assert text in caught.value.message


def test_error_carries_request_id_when_readable() -> None:
    with pytest.raises(WireError) as caught:
        decode(_msg(_header(id=42, wave=-1)))
    assert caught.value.request_id == 42
    with pytest.raises(WireError) as caught:
        decode(_msg(_header(id=-1)))
    assert caught.value.request_id is None


ENCODE_REJECTIONS = [
    ("unknown type", ("shove", {}, None), "unknown message type"),
    ("reserved field", ("pull", {**FIELDS["pull"], "v": 1}, None), "field 'v' is set by encode"),
    ("numpy int", ("pull", {**FIELDS["pull"], "wave": np.int64(3)}, None), "pull.wave must be an int"),
    ("tensors on pull", ("pull", FIELDS["pull"], {"w": np.zeros(2)}), "pull carries no tensors"),
    ("bad dtype", ("push", FIELDS["push"], {"w": np.zeros(2, np.uint8)}), "dtype uint8 is not allowed"),
    ("not an array", ("push", FIELDS["push"], {"w": [1.0]}), "must be a numpy array"),
    ("long key", ("push", FIELDS["push"], {"k" * 257: np.zeros(1)}), "key must be a str of 1..256"),
    ("numpy in info", ("status_reply", {"id": 1, "info": {"x": np.float32(1)}}, None), "status_reply.info"),
]


@pytest.mark.parametrize(
    ("args", "text"), [r[1:] for r in ENCODE_REJECTIONS], ids=[r[0] for r in ENCODE_REJECTIONS]
)
def test_encode_rejects_sender_bugs(args: tuple, text: str) -> None:
    with pytest.raises(WireError) as caught:
        encode(*args)
    assert caught.value.code == "bad_message" and text in caught.value.message


# ---------------------------------------------------------------------------------------------------------
# Fuzzing: decode returns a Message that encodes again, or raises WireError; nothing else.

_u31 = st.integers(0, 2**31 - 1)
_info = (
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=8,
    )
    .map(lambda v: {"v": v})
    .filter(lambda info: wire.FIELDS["status_reply"]["info"](info) is None)
)
FIELD_STRATEGIES = {
    "id": st.integers(0, 2**63 - 1),
    "run": st.text(min_size=1, max_size=128),
    "vw": _u31,
    "stage": _u31,
    "wave": _u31,
    "num_vws": st.integers(1, 2**31 - 1),
    "num_stages": st.integers(1, 2**31 - 1),
    "want_weights": st.booleans(),
    "applied": st.booleans(),
    "c_global": _u31,
    "version": _u31,
    "own_through": st.integers(-1, 2**31 - 1),
    "info": _info,
    "code": st.sampled_from(sorted(wire.ERROR_CODES)),
    "message": st.text(max_size=50),
    "num_waves": _u31,
    "parked_ms": _u31,
    "buffers": st.lists(st.text(min_size=1, max_size=8), max_size=3),
    "ledgers": st.lists(st.text(min_size=1, max_size=8), max_size=3),
    "start_wave": _u31,
    "vw_weights": st.lists(st.integers(1, 2**31 - 1), max_size=3),
    "members": st.lists(_u31, max_size=3, unique=True),
    "vw_spans": st.lists(
        st.tuples(st.integers(0, 100), st.integers(0, 100))
        .filter(lambda p: p[1] == 0 or p[1] > p[0])
        .map(list),
        max_size=3,
    ),
    "pushed": _u31,
    "keep_from": _u31,
    "ckpt_from": _u31,
    "progress": _u31,
    "at_wave": _u31,
    "gaps": st.lists(st.tuples(_u31, _u31, st.integers(-1, 2**31 - 1)).map(list), max_size=3),
}


@st.composite
def valid_messages(draw: st.DrawFn) -> list[bytes]:
    msg_type = draw(st.sampled_from(sorted(wire.FIELDS)))
    fields = {name: draw(FIELD_STRATEGIES[name]) for name in wire.FIELDS[msg_type]}
    if msg_type == "error" and draw(st.booleans()):
        fields["id"] = None
    tensors = None
    if msg_type in WITH_TENSORS:
        shapes = st.lists(st.integers(0, 3), max_size=3)
        specs = draw(
            st.dictionaries(
                st.text(min_size=1, max_size=4),
                st.tuples(st.sampled_from(sorted(DTYPES)), shapes),
                max_size=3,
            )
        )
        tensors = {k: np.arange(int(np.prod(s)), dtype=d).reshape(s) for k, (d, s) in specs.items()}
    return [bytes(f) for f in encode(msg_type, fields, tensors)]


_MULTI_CHUNK = [bytes(f) for f in encode("push", FIELDS["push"], {"big": np.zeros(BIG, np.float32)})]


def _mutate(data: st.DataObject, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "truncate", "drop", "duplicate", "append", "replace"]))
        i = data.draw(st.integers(0, max(len(frames) - 1, 0)))
        if op == "append" or not frames:
            frames.append(data.draw(st.binary(max_size=40)))
        elif op == "flip" and frames[i]:
            buf = bytearray(frames[i])
            j = data.draw(st.integers(0, min(len(buf), 64) - 1))
            buf[j] = data.draw(st.integers(0, 255))
            frames[i] = bytes(buf)
        elif op == "truncate":
            frames[i] = frames[i][: data.draw(st.integers(0, len(frames[i])))]
        elif op == "drop":
            del frames[i]
        elif op == "duplicate":
            frames.insert(i, frames[i])
        elif op == "replace":
            frames[i] = data.draw(st.binary(max_size=40))
    return frames


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(original=st.one_of(valid_messages(), st.just("multi-chunk push")), data=st.data())
def test_mutated_messages_decode_or_raise_wire_error(
    original: list[bytes] | str, data: st.DataObject
) -> None:
    if original == "multi-chunk push":  # prebuilt: a 2.5 MiB example would flood hypothesis' report
        original = _MULTI_CHUNK
    assert decode(original).type
    frames = _mutate(data, original)
    try:
        msg = decode(frames)
    except WireError as err:
        assert err.code in wire.ERROR_CODES
        return
    arrays = {k: v.to_array() for k, v in msg.tensors.items()}
    again = decode(encode(msg.type, msg.fields, arrays))  # what decode accepts, encode accepts too
    assert msgpack.packb(again.fields) == msgpack.packb(msg.fields)  # bytes, since NaN != NaN


# ---------------------------------------------------------------------------------------------------------
# Chunk-wise arithmetic


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_copy_into_and_add_into_across_chunk_boundaries(dtype: str) -> None:
    n = 2 * CHUNK_BYTES // np.dtype(dtype).itemsize + 7  # two full chunks and a partial one
    rng = np.random.default_rng(1)
    src = (rng.standard_normal(n) * 1000).astype(dtype).reshape(1, n)
    view = decode(encode("push", FIELDS["push"], {"w": src})).tensors["w"]
    assert len(view.chunks) == 3
    dst = (rng.standard_normal(n) * 1000).astype(dtype).reshape(1, n)
    expected = dst + src
    base = dst.copy()
    added = view.added_to(base)
    assert added.dtype == np.dtype(dtype) and added.shape == (1, n)
    np.testing.assert_array_equal(added, expected)  # the same sums as base + to_array(), bit for bit
    np.testing.assert_array_equal(base, dst)  # the base is read, not changed
    view.add_into(dst)
    np.testing.assert_array_equal(dst, expected)
    view.copy_into(dst)
    np.testing.assert_array_equal(dst, src)
    np.testing.assert_array_equal(view.to_array(), src)


@pytest.mark.parametrize(
    ("dst", "text"),
    [
        (np.zeros((2, 3), np.float64), "is float32[2, 3] but the destination is float64[2, 3]"),
        (np.zeros((3, 2), np.float32), "destination is float32[3, 2]"),
        (np.zeros((3, 2), np.float32).T, "C-contiguous"),
        ([[0.0] * 3] * 2, "numpy array destination"),
    ],
)
def test_copy_into_and_add_into_reject_mismatched_destinations(dst: object, text: str) -> None:
    view = decode(encode("push", FIELDS["push"], {"w": np.ones((2, 3), np.float32)})).tensors["w"]
    for method in (view.copy_into, view.add_into):
        with pytest.raises(WireError) as caught:
            method(dst)
        assert caught.value.code == "bad_message" and text in caught.value.message
    if (
        isinstance(dst, np.ndarray) and dst.flags.c_contiguous
    ):  # added_to reads its base: any layout of the right shape
        with pytest.raises(
            WireError, match=r"the base is float\d\d\[\d, \d\]; the sender and this side disagree"
        ):
            view.added_to(dst)
    np.testing.assert_array_equal(
        view.added_to(np.ones((3, 2), np.float32).T), np.full((2, 3), 2.0, np.float32)
    )


def test_scalar_and_empty_tensors_copy_and_add() -> None:
    msg = decode(encode("push", FIELDS["push"], {"s": np.asarray(2.5), "e": np.zeros((0, 3))}))
    s, e = np.asarray(1.0), np.zeros((0, 3))
    msg.tensors["s"].add_into(s)
    msg.tensors["e"].add_into(e)
    assert s == 3.5 and e.shape == (0, 3)
    assert msg.tensors["s"].added_to(np.asarray(1.0)) == 3.5 and msg.tensors["e"].added_to(e).shape == (0, 3)
    assert msg.tensors["s"].to_array().shape == ()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_finite_check_finds_nan_and_inf_in_any_chunk(dtype: str) -> None:
    n = 2 * CHUNK_BYTES // np.dtype(dtype).itemsize + 5  # the bad values go into the third chunk
    clean = np.ones(n, dtype)
    view = decode(encode("push", FIELDS["push"], {"w": clean})).tensors["w"]
    assert view.all_finite() and view.non_finite_counts() == (0, 0)
    if np.dtype(dtype).kind != "f":
        return  # integers are always finite
    dirty = clean.copy()
    dirty[[n - 1, n - 2]] = np.nan
    dirty[n - 3] = -np.inf
    view = decode(encode("push", FIELDS["push"], {"w": dirty})).tensors["w"]
    assert len(view.chunks) == 3 and not view.all_finite()
    assert view.non_finite_counts() == (2, 1)


def test_new_error_codes_are_on_the_wire() -> None:
    for code in ("forbidden", "non_finite"):
        msg = decode(wire.error_frames(3, code, "why"))
        assert msg.fields == {"id": 3, "code": code, "message": "why"}


# ---------------------------------------------------------------------------------------------------------
# bfloat16 on the wire ([ps] wire_dtype)


@pytest.mark.parametrize(
    ("value", "bits"),
    [
        (1.0, 0x3F80),
        (1.0 + 2**-8, 0x3F80),  # halfway: to the even neighbour, down
        (1.0 + 3 * 2**-8, 0x3F82),  # halfway: to the even neighbour, up
        (1.0 + 2**-8 + 2**-20, 0x3F81),  # just past halfway: up
        (-2.5, 0xC020),
        (0.0, 0x0000),
        (-0.0, 0x8000),
        (np.inf, 0x7F80),
        (-np.inf, 0xFF80),
        (np.finfo(np.float32).max, 0x7F80),  # past the largest bfloat16: inf
        (1e-45, 0x0000),  # the smallest float32 subnormal rounds to zero
    ],
)
def test_bfloat16_bits_round_to_nearest_even(value: float, bits: int) -> None:
    assert int(wire.to_bfloat16_bits(np.array([value], np.float32))[0]) == bits


def test_bfloat16_keeps_nan_a_nan_and_widens_exactly() -> None:
    packed = wire.to_bfloat16_bits(np.array([np.nan, -np.nan, 1.5], np.float32))
    back = wire.from_bfloat16_bits(packed)
    assert np.isnan(back[:2]).all() and back[2] == 1.5 and back.dtype == np.float32


def test_bfloat16_rounding_equals_torch() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(50_000) * 10.0 ** rng.integers(-38, 38, 50_000)).astype(np.float32)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(wire.to_bfloat16_bits(x), theirs)


def test_packed_push_reads_as_float32_in_half_the_bytes() -> None:
    n = 2 * CHUNK_BYTES // 2 + 7  # bfloat16: two full frames and a partial one
    rng = np.random.default_rng(5)
    src = rng.standard_normal((1, n)).astype(np.float32)
    counts = np.arange(4, dtype=np.int64)
    frames = encode("push", FIELDS["push"], {"w": src, "counts": counts}, pack="bfloat16")
    plain = encode("push", FIELDS["push"], {"w": src, "counts": counts})
    data = sum(memoryview(f).nbytes for f in frames[1:])
    assert (
        data == 2 * n + counts.nbytes
        and sum(memoryview(f).nbytes for f in plain[1:]) == 4 * n + counts.nbytes
    )
    header = msgpack.unpackb(frames[0])
    assert [t["dtype"] for t in header["tensors"]] == ["bfloat16", "int64"]  # only float32 is packed
    msg = decode([bytes(f) for f in frames])
    view, rounded = msg.tensors["w"], wire.from_bfloat16_bits(wire.to_bfloat16_bits(src))
    assert view.dtype == np.float32 and view.packed and len(view.chunks) == 3
    np.testing.assert_array_equal(view.to_array(), rounded)
    dst = np.ones_like(src)
    view.add_into(dst)
    np.testing.assert_array_equal(dst, 1.0 + rounded)
    np.testing.assert_array_equal(view.added_to(np.ones_like(src)), 1.0 + rounded)
    view.copy_into(dst)
    np.testing.assert_array_equal(dst, rounded)
    np.testing.assert_array_equal(msg.tensors["counts"].to_array(), counts)
    assert view.all_finite() and view.non_finite_counts() == (0, 0)
    src[0, -1], src[0, 0] = np.inf, np.nan
    dirty = decode([bytes(f) for f in encode("push", FIELDS["push"], {"w": src}, pack="bfloat16")]).tensors[
        "w"
    ]
    assert not dirty.all_finite() and dirty.non_finite_counts() == (1, 1)


def test_a_packed_tensor_with_float32_sized_frames_is_refused() -> None:
    frames = [bytes(f) for f in encode("push", FIELDS["push"], {"w": np.ones(8, np.float32)})]
    header = msgpack.unpackb(frames[0])
    header["tensors"][0]["dtype"] = "bfloat16"  # 32 bytes of data for 8 bfloat16 values (16 bytes)
    with pytest.raises(WireError) as caught:
        decode([msgpack.packb(header), frames[1]])
    assert caught.value.code == "bad_message" and "expected 16" in caught.value.message
    with pytest.raises(WireError):
        encode("push", FIELDS["push"], {"w": np.ones(8, np.float32)}, pack="float8")

"""The parameter-server wire protocol: msgpack header + raw tensor frames, strictly validated. No socket
loops."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import zmq

__all__ = [
    "CHUNK_BYTES",
    "DTYPES",
    "ERROR_CODES",
    "FIELDS",
    "MAX_FRAME_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_NDIM",
    "MAX_TENSORS",
    "MAX_TENSOR_BYTES",
    "MESSAGE_TYPES",
    "PACKED",
    "PROTOCOL_VERSION",
    "Message",
    "TensorView",
    "WireError",
    "configure_socket",
    "decode",
    "encode",
    "error_frames",
    "from_bfloat16_bits",
    "to_bfloat16_bits",
]

# 2: durable pushes (keep_from), heartbeats, eviction and rejoin; 3: VW weights; 4: ckpt_from; 6: VW spans
PROTOCOL_VERSION = 6
CHUNK_BYTES = 1 << 20  # one data frame; a multiple of every allowed itemsize
MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 100_000
MAX_TENSOR_BYTES = 8 << 30
MAX_NDIM = 8
MAX_FRAME_BYTES = max(CHUNK_BYTES, MAX_HEADER_BYTES)
MAX_KEY_CHARS = 256
MAX_RUN_CHARS = 128
MAX_MESSAGE_CHARS = 4096
MAX_INFO_DEPTH = 4
MAX_INFO_ENTRIES = 4096
MAX_INFO_STR_BYTES = 64 << 10
ERROR_CODES = frozenset(
    {
        "bad_message",
        "version",
        "run_mismatch",
        "not_registered",
        "conflict",
        "out_of_order",
        "stale",
        "internal",
        "forbidden",
        "non_finite",
        "evicted",
        "vw_failed",
    }
)
# Bytes on the wire are little-endian whatever the host; on the usual little-endian hosts this is native.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<") for name in ("float32", "float16", "float64", "int32", "int64")
}
# Packed dtypes: float32 tensors sent in fewer bytes ([ps] wire_dtype). On the wire the frames hold the packed
# form (bfloat16: the upper 16 bits of each float32, rounded to nearest even); a received one reads as
# float32.
PACKED: dict[str, tuple[np.dtype, np.dtype]] = {"bfloat16": (np.dtype("<u2"), DTYPES["float32"])}
assert all(CHUNK_BYTES % dt.itemsize == 0 for dt in [*DTYPES.values(), *(w for w, _ in PACKED.values())])
_ALLOWED = sorted([*DTYPES, *PACKED])

_RESERVED = ("v", "type", "tensors")
_I31 = 2**31
_I63 = 2**63


class WireError(Exception):
    """An invalid message (or a sender's bug); `.code` is one of ERROR_CODES.

    `.request_id` is the request's id when decode could read it, so the server can address its error reply.
    """

    def __init__(self, code: str, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


# ---------------------------------------------------------------------------------------------------------
# Field schema: a check returns None when the value is valid, else what was expected.

Check = Callable[[object], str | None]


def _int_in(lo: int, hi: int, shown: str) -> Check:
    def check(value: object) -> str | None:
        ok = type(value) is int and lo <= value < hi
        return None if ok else f"an int in [{lo}, {shown})"

    return check


def _str_len(lo: int, hi: int) -> Check:
    def check(value: object) -> str | None:
        return None if type(value) is str and lo <= len(value) <= hi else f"a str of {lo}..{hi} chars"

    return check


def _is_bool(value: object) -> str | None:
    return None if type(value) is bool else "a bool"


def _is_error_id(value: object) -> str | None:
    return None if value is None or _ID(value) is None else "nil or an int in [0, 2**63)"


def _is_error_code(value: object) -> str | None:
    return None if type(value) is str and value in ERROR_CODES else f"one of {sorted(ERROR_CODES)}"


def _int_lists(value: object, size: int, each: Callable[[list[int]], bool]) -> bool:
    """Whether `value` is a list of at most MAX_INFO_ENTRIES lists of `size` ints, each passing `each`."""
    return (
        type(value) is list
        and len(value) <= MAX_INFO_ENTRIES
        and all(
            type(g) is list and len(g) == size and all(type(x) is int for x in g) and each(g) for g in value
        )
    )


def _is_gaps(value: object) -> str | None:
    """[vw, from_wave, to_wave] triples: waves a VW contributes nothing to (to_wave -1: open-ended)."""
    ok = _int_lists(value, 3, lambda g: 0 <= g[0] < _I31 and 0 <= g[1] < _I31 and -1 <= g[2] < _I31)
    return None if ok else f"a list of at most {MAX_INFO_ENTRIES} [vw, from, to] int triples"


def _is_movement(value: object) -> str | None:
    """[train] autofreeze's records: [[boundary, [[layer, Q, N], ...]], ...], at most MAX_TENSORS rows in
    all (hetpipe.core.wsp.movement)."""
    expected = f"a list of [boundary, [[layer, Q, N], ...]] with at most {MAX_TENSORS} rows in all"
    if type(value) is not list:
        return expected
    rows = 0
    for entry in value:
        if type(entry) is not list or len(entry) != 2:
            return expected
        if type(entry[0]) is not int or type(entry[1]) is not list:
            return expected
        rows += len(entry[1])
        if not 0 < entry[0] < _I31 or rows > MAX_TENSORS or not all(_is_layer_movement(r) for r in entry[1]):
            return expected
    return None


def _is_layer_movement(row: object) -> bool:
    return (
        type(row) is list
        and len(row) == 3
        and type(row[0]) is int
        and 0 <= row[0] < _I31
        and all(type(x) is float and x >= 0 for x in row[1:])
    )


def _is_key_list(value: object) -> str | None:
    """A list of tensor names (which keys of a registration are buffers, which are ledgers)."""
    ok = (
        type(value) is list
        and len(value) <= MAX_TENSORS
        and all(type(k) is str and 0 < len(k) <= MAX_KEY_CHARS for k in value)
    )
    return None if ok else f"a list of at most {MAX_TENSORS} tensor names"


def _is_weight_list(value: object) -> str | None:
    """Each VW's weight by samples: a list of ints >= 1, one per VW ([] for every VW weighing 1)."""
    ok = (
        type(value) is list
        and len(value) <= MAX_INFO_ENTRIES
        and all(type(w) is int and 1 <= w < _I31 for w in value)
    )
    return None if ok else f"a list of at most {MAX_INFO_ENTRIES} ints in [1, 2**31)"


def _is_span_list(value: object) -> str | None:
    """Each VW's planned waves [start, end) (docs/wsp.md#planned-spans): a list of [start, end] int pairs,
    end 0 for the run's end, else end > start ([] for every VW training every wave)."""
    ok = _int_lists(value, 2, lambda p: 0 <= p[0] < _I31 and 0 <= p[1] < _I31 and (p[1] == 0 or p[1] > p[0]))
    return None if ok else f"a list of at most {MAX_INFO_ENTRIES} [start, end] pairs of ints in [0, 2**31)"


def _is_member_list(value: object) -> str | None:
    """The VWs a node's relay pushes for (docs/wsp.md#node-local-aggregation): a list of distinct VW indices
    ([] for a stage that pushes for its own VW)."""
    ok = (
        type(value) is list
        and len(value) <= MAX_INFO_ENTRIES
        and all(type(v) is int and 0 <= v < _I31 for v in value)
        and len(set(value)) == len(value)
    )
    return None if ok else f"a list of at most {MAX_INFO_ENTRIES} distinct ints in [0, 2**31)"


_SCALARS = (type(None), bool, int, float, str, bytes)


def _small(value: object) -> bool:
    """Strings and bytes fit msgpack's max_str_len/max_bin_len on the decoding side."""
    if type(value) is str:
        return (
            len(value) <= MAX_INFO_STR_BYTES // 4
            or len(value.encode("utf-8", "replace")) <= MAX_INFO_STR_BYTES
        )
    return type(value) is not bytes or len(value) <= MAX_INFO_STR_BYTES


def _is_info(value: object) -> str | None:
    """A map with str keys, nesting depth <= MAX_INFO_DEPTH, <= MAX_INFO_ENTRIES entries in all.

    Strings and bytes are capped at MAX_INFO_STR_BYTES, the limit decode gives msgpack, so that what encode
    accepts decode accepts too.
    """
    expected = (
        f"a map with str keys, depth <= {MAX_INFO_DEPTH}, <= {MAX_INFO_ENTRIES} entries of msgpack values,"
        f" strings <= {MAX_INFO_STR_BYTES} bytes"
    )
    if type(value) is not dict:
        return expected
    entries = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if type(node) in (list, tuple, dict) and depth > MAX_INFO_DEPTH:
            return expected
        if type(node) is dict:
            if not all(type(k) is str and _small(k) for k in node):
                return expected
            children = list(node.values())
        elif type(node) in (list, tuple):
            children = list(node)
        elif type(node) in _SCALARS:
            if (type(node) is int and not -_I63 <= node < 2**64) or not _small(node):
                return expected
            continue
        else:
            return expected
        entries += len(children)
        if entries > MAX_INFO_ENTRIES:
            return expected
        stack.extend((child, depth + 1) for child in children)
    return None


_ID = _int_in(0, _I63, "2**63")
_RUN = _str_len(1, MAX_RUN_CHARS)
_INDEX = _int_in(0, _I31, "2**31")
_COUNT = _int_in(1, _I31, "2**31")

FIELDS: dict[str, dict[str, Check]] = {
    "register": {
        "id": _ID,
        "run": _RUN,
        "vw": _INDEX,
        "stage": _INDEX,
        "num_vws": _COUNT,
        "num_stages": _COUNT,
        "want_weights": _is_bool,
        "num_waves": _INDEX,
        "buffers": _is_key_list,
        "ledgers": _is_key_list,
        "start_wave": _INDEX,
        "vw_weights": _is_weight_list,
        "members": _is_member_list,
        "vw_spans": _is_span_list,
    },
    "push": {"id": _ID, "run": _RUN, "vw": _INDEX, "stage": _INDEX, "wave": _INDEX},
    "pull": {"id": _ID, "run": _RUN, "vw": _INDEX, "stage": _INDEX, "wave": _INDEX},
    "status": {"id": _ID, "run": _RUN},
    "read": {"id": _ID, "run": _RUN},
    "heartbeat": {"id": _ID, "run": _RUN, "vw": _INDEX, "stage": _INDEX, "progress": _INDEX},
    "evict": {"id": _ID, "run": _RUN, "vw": _INDEX},
    "rejoin": {"id": _ID, "run": _RUN, "vw": _INDEX, "start_wave": _INDEX},
    # pushed: waves of this stage the shard holds; keep_from: the client may drop its pushes of earlier waves
    # (they are in a checkpoint, or the shard keeps none and a crash of it cannot be recovered anyway);
    # ckpt_from: the clock of the oldest checkpoint the shard keeps on disk (0: none), from which on a stage
    # keeps its snapshots
    "registered": {"id": _ID, "c_global": _INDEX, "pushed": _INDEX, "keep_from": _INDEX, "ckpt_from": _INDEX},
    "ack": {
        "id": _ID,
        "wave": _INDEX,
        "applied": _is_bool,
        "c_global": _INDEX,
        "keep_from": _INDEX,
        "ckpt_from": _INDEX,
    },
    "weights": {
        "id": _ID,
        "wave": _INDEX,
        "version": _INDEX,
        "own_through": _int_in(-1, _I31, "2**31"),
        "parked_ms": _INDEX,
        "gaps": _is_gaps,
    },
    "beat": {"id": _ID, "c_global": _INDEX, "keep_from": _INDEX, "ckpt_from": _INDEX},
    "evicted": {"id": _ID, "vw": _INDEX, "at_wave": _INDEX},
    "rejoined": {"id": _ID, "vw": _INDEX, "start_wave": _INDEX},
    "status_reply": {"id": _ID, "info": _is_info},
    "snapshot": {"id": _ID, "version": _INDEX, "info": _is_info},
    "error": {"id": _is_error_id, "code": _is_error_code, "message": _str_len(0, MAX_MESSAGE_CHARS)},
}
# fields a message may leave out: [train] autofreeze's (the pull's newest record held and whether it wants
# the records only, the reply's records)
OPTIONAL: dict[str, dict[str, Check]] = {
    "pull": {"known": _int_in(-1, _I31, "2**31"), "records_only": _is_bool},
    "weights": {"movement": _is_movement},
}
MESSAGE_TYPES = frozenset(FIELDS)
_WITH_TENSORS = frozenset({"register", "push", "registered", "weights", "snapshot"})


def _show(value: object) -> str:
    """A short, safe rendering of an untrusted value for error messages."""
    if isinstance(value, str | bytes):
        text = repr(value[:40]) + ("..." if len(value) > 40 else "")
    elif isinstance(value, list | tuple | dict):
        return f"a {type(value).__name__} of {len(value)} items"
    else:
        text = repr(value)[:60]
    return f"{text} ({type(value).__name__})"


# ---------------------------------------------------------------------------------------------------------
# Header validation, shared by encode (sender bugs fail loudly) and decode (never trust the transport).


@dataclass(frozen=True)
class _Spec:
    key: str
    dtype: np.dtype  # what the tensor reads as
    shape: tuple[int, ...]
    nbytes: int
    frames_dtype: np.dtype  # what its frames hold (differs for a packed dtype)

    @property
    def nframes(self) -> int:
        return -(-self.nbytes // CHUNK_BYTES)


def _bad(message: str) -> WireError:
    return WireError("bad_message", message)


def _check_version(header: dict) -> None:
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise WireError(
            "version",
            f"protocol version {_show(version)} is not supported: "
            f"this side speaks version {PROTOCOL_VERSION};"
            " run the same hetpipe version on the server and every worker",
        )


def _check_fields(header: dict) -> str:
    """Check "type" and the exact field set with each value's type and range; return the type."""
    msg_type = header.get("type")
    if type(msg_type) is not str or msg_type not in FIELDS:
        raise _bad(f"unknown message type {_show(msg_type)}: expected one of {sorted(FIELDS)}")
    optional = OPTIONAL.get(msg_type, {})
    schema = {**FIELDS[msg_type], **{k: c for k, c in optional.items() if k in header}}
    allowed = set(schema) | {"v", "type"} | ({"tensors"} if msg_type in _WITH_TENSORS else set())
    unknown = [k for k in header if k not in allowed]
    if unknown:
        known = sorted(allowed | set(optional))
        raise _bad(f"{msg_type}: unknown field {_show(unknown[0])}; its fields are {known}")
    missing = sorted(allowed - set(header))
    if missing:
        raise _bad(f"{msg_type}: missing field {missing[0]!r}; its fields are {sorted(allowed)}")
    for name, check in schema.items():
        expected = check(header[name])
        if expected is not None:
            raise _bad(f"{msg_type}.{name} must be {expected}, got {_show(header[name])}")
    return msg_type


def _check_spec(index: int, entry: object) -> _Spec:
    where = f"tensors[{index}]"
    if type(entry) is not dict or set(entry) != {"key", "dtype", "shape"}:
        raise _bad(f"{where} must be a map with exactly key, dtype, shape; got {_show(entry)}")
    key, dtype, shape = entry["key"], entry["dtype"], entry["shape"]
    if type(key) is not str or not 1 <= len(key) <= MAX_KEY_CHARS:
        raise _bad(f"{where}.key must be a str of 1..{MAX_KEY_CHARS} chars, got {_show(key)}")
    if type(dtype) is not str or (dtype not in DTYPES and dtype not in PACKED):
        raise _bad(f"tensor {key!r}: dtype {_show(dtype)} is not allowed; use one of {_ALLOWED}")
    if type(shape) is not list or len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        raise _bad(f"tensor {key!r}: shape must be a list of <= {MAX_NDIM} ints >= 0, got {_show(shape)}")
    frames_dtype, logical = PACKED[dtype] if dtype in PACKED else (DTYPES[dtype], DTYPES[dtype])
    itemsize = frames_dtype.itemsize
    # Bounding the product of the non-zero dims also keeps zero-size shapes within what numpy can build.
    if math.prod(max(d, 1) for d in shape) * itemsize > MAX_TENSOR_BYTES:
        raise _bad(
            f"tensor {key!r}: shape {list(shape)} of {dtype} exceeds {MAX_TENSOR_BYTES} bytes;"
            " split it into several keys"
        )
    return _Spec(key, logical, tuple(shape), math.prod(shape) * itemsize, frames_dtype)


def _check_specs(entries: object) -> list[_Spec]:
    if type(entries) is not list or len(entries) > MAX_TENSORS:
        raise _bad(f"tensors must be a list of <= {MAX_TENSORS} entries, got {_show(entries)}")
    specs = [_check_spec(i, entry) for i, entry in enumerate(entries)]
    seen: set[str] = set()
    for spec in specs:
        if spec.key in seen:
            raise _bad(f"duplicate tensor key {spec.key!r}: each key may appear once per message")
        seen.add(spec.key)
    return specs


def _validate_header(header: object) -> tuple[str, dict, list[_Spec]]:
    if type(header) is not dict:
        raise _bad(f"header must be a msgpack map, got {_show(header)}")
    _check_version(header)
    msg_type = _check_fields(header)
    specs = _check_specs(header["tensors"]) if msg_type in _WITH_TENSORS else []
    fields = {k: v for k, v in header.items() if k not in _RESERVED}
    return msg_type, fields, specs


# ---------------------------------------------------------------------------------------------------------
# Encoding


@functools.cache
def _dtype_name(dtype: np.dtype) -> str:
    """dtype.name, which numpy computes in Python each time: ~4 us, per tensor per push."""
    return dtype.name


def _wire_array(key: object, value: object) -> np.ndarray:
    """The array as it goes on the wire: allowed dtype, little-endian, C-contiguous (copied only if not)."""
    if type(key) is not str:
        raise _bad(f"tensor keys must be str, got {_show(key)}")
    if not isinstance(value, np.ndarray):
        raise _bad(
            f"tensor {key!r} must be a numpy array, got {type(value).__name__} "
            "(torch: t.detach().cpu().numpy())"
        )
    name = _dtype_name(value.dtype)
    if name not in DTYPES:
        raise _bad(f"tensor {key!r}: dtype {value.dtype} is not allowed; cast it to one of {sorted(DTYPES)}")
    wire_dtype = DTYPES[name]
    if value.dtype == wire_dtype and value.flags.c_contiguous:
        return value
    return np.asarray(value, dtype=wire_dtype, order="C")


def to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 as uint16 bits, rounded to nearest even (as torch's .to(torch.bfloat16)); a NaN
    stays a quiet NaN, and a value that rounds past the largest bfloat16 becomes inf."""
    floats = np.ascontiguousarray(values, dtype=np.float32)
    flat, out = floats.reshape(-1), np.empty(floats.shape, "<u2")
    out_flat = out.reshape(-1)
    block = CHUNK_BYTES  # values per step: a few MiB of temporaries, whatever the tensor's size
    for start in range(0, flat.size, block):
        bits = flat[start : start + block].view(np.uint32)
        rounded = bits >> np.uint32(16)
        rounded &= np.uint32(1)
        rounded += np.uint32(0x7FFF)
        rounded += bits
        rounded >>= np.uint32(16)
        nan = np.isnan(flat[start : start + block])
        if nan.any():
            rounded[nan] = (bits[nan] >> np.uint32(16)) | np.uint32(0x0040)
        out_flat[start : start + block] = rounded
    return out


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bits -> float32 (exact)."""
    return (np.asarray(bits, dtype="<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)


def _data_frames(arr: np.ndarray) -> list[memoryview]:
    """Zero-copy CHUNK_BYTES slices of a C-contiguous array's bytes (none for an empty array)."""
    if arr.nbytes == 0:
        return []
    flat = memoryview(arr).cast("B")
    return [flat[start : start + CHUNK_BYTES] for start in range(0, arr.nbytes, CHUNK_BYTES)]


def _pack(header: dict) -> bytes:
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as err:
        raise _bad(
            f"{header.get('type')}: header cannot be packed ({err}); use plain Python values"
        ) from None
    if len(packed) > MAX_HEADER_BYTES:
        raise _bad(
            f"{header['type']}: header is {len(packed)} bytes, over the {MAX_HEADER_BYTES}-byte limit;"
            " send fewer tensors (or shorter keys) per message"
        )
    return packed


def encode(
    msg_type: str,
    fields: Mapping[str, object],
    tensors: Mapping[str, np.ndarray] | None = None,
    pack: str | None = None,
    pack_only: Collection[str] | None = None,
) -> list[bytes | memoryview]:
    """Frames for `socket.send_multipart(frames, copy=False)`: the header, then each tensor's chunks.

    Validates like decode, so a sender's bug raises WireError here. Data frames are views of the arrays:
    do not modify them until the send has completed. `pack` (a PACKED name): float32 tensors (of `pack_only`,
    when given) go packed, in new arrays (the caller's may change as soon as this returns); others as they
    are.
    """
    if pack is not None and pack not in PACKED:
        raise _bad(f"pack {pack!r} is not a packed dtype; use one of {sorted(PACKED)}")
    if not isinstance(fields, Mapping):
        raise _bad(f"fields must be a mapping, got {type(fields).__name__}")
    reserved = [k for k in _RESERVED if k in fields]
    if reserved:
        raise _bad(f"field {reserved[0]!r} is set by encode; leave it out of fields")
    arrays = {k: _wire_array(k, v) for k, v in (tensors or {}).items()}
    names = {k: _dtype_name(a.dtype) for k, a in arrays.items()}
    if pack is not None:
        for k, a in arrays.items():
            if names[k] == "float32" and (pack_only is None or k in pack_only):
                arrays[k], names[k] = to_bfloat16_bits(a), pack
    header: dict[str, object] = {"v": PROTOCOL_VERSION, "type": msg_type, **fields}
    if msg_type in _WITH_TENSORS:
        header["tensors"] = [{"key": k, "dtype": names[k], "shape": list(a.shape)} for k, a in arrays.items()]
    _validate_header(header)
    if arrays and msg_type not in _WITH_TENSORS:
        raise _bad(f"{msg_type} carries no tensors; got {sorted(arrays)[:5]}")
    frames: list[bytes | memoryview] = [_pack(header)]
    for arr in arrays.values():
        frames.extend(_data_frames(arr))
    return frames


def error_frames(request_id: int | None, code: str, message: str) -> list[bytes]:
    """Frames of an `error` reply; an unreadable id becomes nil and a long message is truncated."""
    if type(request_id) is not int or not 0 <= request_id < _I63:
        request_id = None
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return [bytes(f) for f in encode("error", {"id": request_id, "code": code, "message": message})]


# ---------------------------------------------------------------------------------------------------------
# Decoding


@dataclass(frozen=True)
class TensorView:
    """One received tensor as read-only 1-d chunks over the frames (zero-copy). A packed one (bfloat16) reads
    as float32: each chunk is widened as it is read, one chunk's temporary at a time."""

    key: str
    dtype: np.dtype
    shape: tuple[int, ...]
    chunks: list[np.ndarray]
    nbytes: int
    packed: bool = False

    def to_array(self) -> np.ndarray:
        """The tensor: a read-only view when it came in one frame unpacked, else one fresh (writable)
        array."""
        if len(self.chunks) == 1 and not self.packed:
            return self.chunks[0].reshape(self.shape)
        if not self.chunks:
            return np.empty(self.shape, dtype=self.dtype)
        return np.concatenate([self._read(c) for c in self.chunks]).reshape(self.shape)

    def copy_into(self, dst: np.ndarray) -> None:
        """dst[...] = tensor, chunk by chunk, without temporaries (but one chunk's, packed)."""
        flat = self._flat(dst, "copy_into")
        for start, chunk in self._spans():
            np.copyto(flat[start : start + chunk.size], self._read(chunk))

    def add_into(self, dst: np.ndarray) -> None:
        """dst += tensor, chunk by chunk, in place, without temporaries (but one chunk's, packed)."""
        flat = self._flat(dst, "add_into")
        for start, chunk in self._spans():
            part = flat[start : start + chunk.size]
            np.add(part, self._read(chunk), out=part)

    def all_finite(self) -> bool:
        """No NaN and no inf (integer tensors always pass); reads each chunk once, no copies kept."""
        if self.dtype.kind != "f":
            return True
        return all(bool(np.isfinite(self._read(chunk)).all()) for chunk in self.chunks)

    def non_finite_counts(self) -> tuple[int, int]:
        """(number of NaNs, number of infs): for the message that refuses a tensor."""
        if self.dtype.kind != "f":
            return 0, 0
        nans = sum(int(np.isnan(self._read(chunk)).sum()) for chunk in self.chunks)
        infs = sum(int(np.isinf(self._read(chunk)).sum()) for chunk in self.chunks)
        return nans, infs

    def added_to(self, base: np.ndarray) -> np.ndarray:
        """base + tensor in a fresh array, chunk by chunk straight from the frames: the same float32 sums as
        base + to_array(), without first copying the tensor out of a message of several frames."""
        if base.dtype != self.dtype or base.shape != self.shape:
            raise _bad(
                f"added_to: tensor {self.key!r} is {self.dtype.name}{list(self.shape)} but the base is "
                f"{base.dtype.name}{list(base.shape)}; the sender and this side disagree on the model"
            )
        out = np.empty(self.shape, dtype=self.dtype)
        flat, left = out.reshape(-1), np.ascontiguousarray(base).reshape(-1)
        for start, chunk in self._spans():
            np.add(left[start : start + chunk.size], self._read(chunk), out=flat[start : start + chunk.size])
        return out

    def _read(self, chunk: np.ndarray) -> np.ndarray:
        return from_bfloat16_bits(chunk) if self.packed else chunk

    def _spans(self) -> list[tuple[int, np.ndarray]]:
        per_chunk = CHUNK_BYTES // self.chunks[0].dtype.itemsize if self.chunks else 0
        return [(i * per_chunk, chunk) for i, chunk in enumerate(self.chunks)]

    def _flat(self, dst: object, what: str) -> np.ndarray:
        if not isinstance(dst, np.ndarray):
            raise _bad(
                f"{what}: tensor {self.key!r} needs a numpy array destination, got {type(dst).__name__}"
            )
        if dst.dtype != self.dtype or dst.shape != self.shape:
            raise _bad(
                f"{what}: tensor {self.key!r} is {self.dtype.name}{list(self.shape)} but the destination is"
                f" {dst.dtype.name}{list(dst.shape)}; the sender and this side disagree on the model"
            )
        if not dst.flags.c_contiguous or not dst.flags.writeable:
            raise _bad(f"{what}: destination for tensor {self.key!r} must be C-contiguous and writable")
        return dst.reshape(-1)


@dataclass(frozen=True)
class Message:
    """A validated message: its type, header fields (without v/type/tensors) and tensors in header order."""

    type: str
    fields: dict
    tensors: dict[str, TensorView]


def _buffer(index: int, frame: object) -> memoryview:
    if isinstance(frame, zmq.Frame):
        view = frame.buffer
    elif isinstance(frame, bytes | bytearray | memoryview):
        view = memoryview(frame)
    else:
        raise _bad(f"frame {index} must be a zmq.Frame, bytes or memoryview, got {type(frame).__name__}")
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")
    except (TypeError, ValueError):
        raise _bad(f"frame {index} is not a contiguous buffer") from None


def _unique_map(pairs: list[tuple[object, object]]) -> dict:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise _bad("header has a map with a repeated key")
    return result


def _unpack_header(buf: memoryview) -> object:
    if buf.nbytes > MAX_HEADER_BYTES:
        raise _bad(f"header frame is {buf.nbytes} bytes, over the {MAX_HEADER_BYTES}-byte limit")
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=True,
        object_pairs_hook=_unique_map,
        max_buffer_size=MAX_HEADER_BYTES,
        max_str_len=MAX_INFO_STR_BYTES,
        max_bin_len=MAX_INFO_STR_BYTES,
        max_array_len=MAX_TENSORS,
        max_map_len=MAX_INFO_ENTRIES,
        max_ext_len=0,
    )
    try:
        unpacker.feed(buf)
        header = unpacker.unpack()
    except WireError:
        raise
    except (
        Exception
    ) as err:  # msgpack raises a zoo (ValueError, FormatError, StackError, ...): all mean garbage
        raise _bad(f"header frame is not valid msgpack ({type(err).__name__}: {str(err)[:200]})") from None
    if unpacker.tell() != buf.nbytes:
        raise _bad(f"header frame has {buf.nbytes - unpacker.tell()} bytes after its msgpack map")
    return header


def _tensor_views(specs: list[_Spec], data: list[memoryview]) -> dict[str, TensorView]:
    needed = sum(s.nframes for s in specs)
    if needed != len(data):
        raise _bad(f"header lists tensors needing {needed} data frames but the message has {len(data)}")
    views: dict[str, TensorView] = {}
    position = 0
    for spec in specs:
        chunks = []
        for i in range(spec.nframes):
            expected = min(CHUNK_BYTES, spec.nbytes - i * CHUNK_BYTES)
            frame = data[position]
            if frame.nbytes != expected:
                raise _bad(
                    f"tensor {spec.key!r} frame {i + 1} of {spec.nframes} has {frame.nbytes} bytes,"
                    f" expected {expected} (shape {list(spec.shape)} of {spec.frames_dtype.name})"
                )
            chunk = np.frombuffer(frame, dtype=spec.frames_dtype)
            chunk.flags.writeable = False
            chunks.append(chunk)
            position += 1
        views[spec.key] = TensorView(
            spec.key, spec.dtype, spec.shape, chunks, spec.nbytes, packed=spec.frames_dtype != spec.dtype
        )
    return views


def _readable_id(header: object) -> int | None:
    if type(header) is dict and _ID(header.get("id")) is None:
        return header["id"]
    return None


def decode(frames: Sequence[zmq.Frame | bytes | memoryview]) -> Message:
    """Validate and unpack one message (the frames after any ROUTER envelope); raises only WireError."""
    if isinstance(frames, bytes | str) or not isinstance(frames, Sequence) or not frames:
        raise _bad("a message is a non-empty sequence of frames: a msgpack header, then data frames")
    buffers = [_buffer(i, f) for i, f in enumerate(frames)]
    header = _unpack_header(buffers[0])
    try:
        msg_type, fields, specs = _validate_header(header)
        if msg_type not in _WITH_TENSORS and len(buffers) > 1:
            raise _bad(f"{msg_type} carries no data frames but the message has {len(buffers) - 1}")
        return Message(msg_type, fields, _tensor_views(specs, buffers[1:]))
    except WireError as err:
        err.request_id = _readable_id(header)
        raise


# ---------------------------------------------------------------------------------------------------------
# Sockets


def configure_socket(sock: zmq.Socket, *, router: bool) -> None:
    """Options every PS socket uses: fail fast and loudly rather than hang or drop silently.

    MAXMSGSIZE is enforced per frame, not per multipart message (observed on libzmq 4.3.5, pyzmq 27,
    tcp://127.0.0.1 with MAXMSGSIZE=1000 on a ROUTER): a DEALER's 3 x 900-byte message arrived whole;
    a single 1001-byte frame was dropped without any error at either end, the ROUTER closed the connection
    (monitor: DISCONNECTED), the DEALER reconnected on its own and its next message arrived. So chunked
    tensors pass, an oversized frame costs the message and the connection, and only the client's
    application-level timeout + retry notices.
    """
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + (64 << 10))
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 60)  # the OS default (2 h) would never notice a dead peer
    if router:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer: EHOSTUNREACH instead of a silent drop
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)

"""Messages between a stage and its PS agent process: msgpack maps, each behind a 4-byte length, over a
pipe."""

from __future__ import annotations

import struct
import threading
from typing import Any, BinaryIO

import msgpack

__all__ = ["MAX_MESSAGE_BYTES", "PipeWriter", "read_message"]

MAX_MESSAGE_BYTES = 64 << 20  # control messages are small; W_0 and pulls travel through shared memory
_LENGTH = struct.Struct("<I")


def _read_exactly(stream: BinaryIO, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_message(stream: BinaryIO) -> dict[str, Any] | None:
    """The next message, or None when the other side has closed the pipe (or died)."""
    head = _read_exactly(stream, _LENGTH.size)
    if head is None:
        return None
    (size,) = _LENGTH.unpack(head)
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"agent pipe message of {size} bytes, over the {MAX_MESSAGE_BYTES}-byte limit")
    body = _read_exactly(stream, size)
    if body is None:
        return None
    message = msgpack.unpackb(body, raw=False, strict_map_key=False)
    if not isinstance(message, dict) or "op" not in message:
        raise ValueError(f"agent pipe message is not a map with an 'op': {str(message)[:200]}")
    return message


class PipeWriter:
    """Writes messages to a stream from any thread, one whole message at a time."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self._lock = threading.Lock()

    def send(self, op: str, **fields: Any) -> None:
        body = msgpack.packb({"op": op, **fields}, use_bin_type=True)
        with self._lock:
            self.stream.write(_LENGTH.pack(len(body)) + body)
            self.stream.flush()

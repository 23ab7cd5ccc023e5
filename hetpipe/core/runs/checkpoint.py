"""Checkpoints on disk (a PS shard's, a stage's): atomic writes (temp file, fsync, rename), sha256 manifests,
newest-valid load, load of one clock.

Layout of a checkpoint directory (one per shard or stage):
    ckpt-00000012.bin   MAGIC, 8-byte little-endian header length, msgpack header, raw array bytes
    ckpt-00000012.json  manifest: file name, byte count, sha256, clocks; written after the .bin, so a
                        manifest only ever names a complete file
No pickle: arrays are raw float32 bytes described by the header.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from hetpipe.core.errors import HetpipeError, WriteError

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "discard_after",
    "discard_before",
    "list_clocks",
    "list_manifests",
    "load_clock",
    "load_newest",
    "read_checkpoint",
    "write_checkpoint",
]

MAGIC = b"HETPIPE-CKPT-1\n"
FORMAT_VERSION = 1


class CheckpointError(HetpipeError):
    """No usable checkpoint where one was expected."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    clock: int
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, chunks: list[bytes | memoryview]) -> str:
    """Write chunks to path via a temp file + fsync + rename; returns the sha256 of the content."""
    digest = hashlib.sha256()
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                digest.update(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # a full disk above all: no half-written temp file stays behind
        tmp.unlink(missing_ok=True)
        raise WriteError.of(tmp, exc) from None
    return digest.hexdigest()


def write_checkpoint(
    directory: Path, clock: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray], keep: int
) -> Path:
    """Write checkpoint `clock` of a shard and drop all but the newest `keep`; returns the data path."""
    directory.mkdir(parents=True, exist_ok=True)
    specs: list[dict[str, Any]] = []
    blobs: list[memoryview] = []
    offset = 0
    for key, arr in arrays.items():
        arr = np.asarray(arr)
        arr = arr if arr.flags.c_contiguous else arr.copy(order="C")  # ascontiguousarray would make 0-d 1-d
        specs.append({"key": key, "dtype": arr.dtype.str, "shape": list(arr.shape), "offset": offset})
        blobs.append(memoryview(arr.reshape(-1)).cast("B"))  # 1-d first: 0-d and empty arrays cast too
        offset += arr.nbytes
    header = msgpack.packb({"format": FORMAT_VERSION, "clock": clock, "meta": dict(meta), "arrays": specs})
    stem = f"ckpt-{clock:08d}"
    data_path = directory / f"{stem}.bin"
    chunks = [MAGIC, len(header).to_bytes(8, "little"), header, *blobs]
    sha = _atomic_write(data_path, chunks)
    manifest = {
        "format": FORMAT_VERSION,
        "file": data_path.name,
        "bytes": sum(len(c) for c in chunks),
        "sha256": sha,
        "clock": clock,
        "c_local": meta.get("c_local"),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _atomic_write(directory / f"{stem}.json", [json.dumps(manifest, indent=1).encode()])
    _fsync_dir(directory)
    if keep > 0:
        for old in list_manifests(directory)[:-keep]:
            _remove(old)
    return data_path


def _remove(manifest: Path) -> None:
    manifest.unlink(missing_ok=True)  # the manifest first: a data file without one is never read
    manifest.with_suffix(".bin").unlink(missing_ok=True)


def list_manifests(directory: Path) -> list[Path]:
    """Manifest paths, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(directory.glob("ckpt-*.json"))


def _clock_of(manifest: Path) -> int:
    return int(manifest.stem.split("-")[1])


def list_clocks(directory: Path) -> list[int]:
    """The clocks of the checkpoints that have a manifest, oldest first (not verified: load_clock does
    that)."""
    return [_clock_of(m) for m in list_manifests(directory)]


def discard_after(directory: Path, clock: int) -> list[int]:
    """Remove the checkpoints newer than `clock` (a resume from `clock` starts a new future); their clocks."""
    gone = [m for m in list_manifests(directory) if _clock_of(m) > clock]
    for manifest in gone:
        _remove(manifest)
    if gone:
        _fsync_dir(directory)
    return [_clock_of(m) for m in gone]


def discard_before(directory: Path, clock: int) -> None:
    """Remove the checkpoints older than `clock`."""
    for manifest in list_manifests(directory):
        if _clock_of(manifest) < clock:
            _remove(manifest)


def load_clock(directory: Path, clock: int) -> Checkpoint:
    """Checkpoint `clock` of `directory`, verified; CheckpointError saying what is missing or wrong."""
    manifest = directory / f"ckpt-{clock:08d}.json"
    if not manifest.exists():
        raise CheckpointError(
            f"{directory} holds no checkpoint of clock {clock} (it has {list_clocks(directory)})"
        )
    return read_checkpoint(manifest)


def read_checkpoint(manifest_path: Path) -> Checkpoint:
    """Read and verify one checkpoint; raises CheckpointError saying what is wrong with it."""
    try:
        manifest = json.loads(manifest_path.read_text())
        data_path = manifest_path.with_name(manifest["file"])
        expected_sha, expected_bytes = manifest["sha256"], manifest["bytes"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path.name}: unreadable manifest ({exc})") from None
    try:
        data = data_path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{data_path.name}: cannot read ({exc.strerror})") from None
    if len(data) != expected_bytes:
        raise CheckpointError(
            f"{data_path.name}: {len(data)} bytes, the manifest says {expected_bytes} (truncated)"
        )
    if hashlib.sha256(data).hexdigest() != expected_sha:
        raise CheckpointError(
            f"{data_path.name}: sha256 does not match its manifest (the file changed after it was written)"
        )
    if not data.startswith(MAGIC):
        raise CheckpointError(f"{data_path.name}: not a hetpipe checkpoint")
    start = len(MAGIC) + 8
    header_len = int.from_bytes(data[len(MAGIC) : start], "little")
    header = msgpack.unpackb(data[start : start + header_len], strict_map_key=False)
    body = memoryview(data)[start + header_len :]
    arrays = {}
    for spec in header["arrays"]:
        dtype = np.dtype(spec["dtype"])
        count = int(np.prod(spec["shape"], dtype=np.int64))
        flat = np.frombuffer(body, dtype=dtype, count=count, offset=spec["offset"])
        arrays[spec["key"]] = flat.reshape(spec["shape"]).copy()
    return Checkpoint(path=data_path, clock=header["clock"], meta=header["meta"], arrays=arrays)


def load_newest(directory: Path, log: Callable[[str], None]) -> Checkpoint | None:
    """The newest checkpoint that verifies; each refused one is logged with its reason.

    None when the directory holds no checkpoint; CheckpointError when it holds some but none verifies
    (starting from scratch then would silently lose training, so the user must decide).
    """
    manifests = list_manifests(directory)
    refused = []
    for manifest in reversed(manifests):
        try:
            ckpt = read_checkpoint(manifest)
        except CheckpointError as exc:
            refused.append(str(exc))
            log(f"refusing checkpoint {exc}; trying the previous one")
            continue
        return ckpt
    if refused:
        raise CheckpointError(
            f"no valid checkpoint in {directory} ({len(refused)} refused: {'; '.join(refused)}); "
            "move that directory away to start from scratch"
        )
    return None

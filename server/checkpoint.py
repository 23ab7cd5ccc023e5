"""Shard checkpoints on disk: the file format lives in hetpipe.core.checkpoint (stages write theirs with it too)."""

from hetpipe.core.checkpoint import (
    Checkpoint,
    CheckpointError,
    discard_after,
    list_clocks,
    list_manifests,
    load_clock,
    load_newest,
    read_checkpoint,
    write_checkpoint,
)

__all__ = ["Checkpoint", "CheckpointError", "discard_after", "list_clocks", "list_manifests", "load_clock", "load_newest",
           "read_checkpoint", "write_checkpoint"]

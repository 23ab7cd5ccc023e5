"""Shared fixtures: a process group that owns every child a test starts, and PS shards on ephemeral ports."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from hetpipe.procs import ChildGroup
from hetpipe.server.launch import serve_settings
from hetpipe.server.shard import ShardSettings


@pytest.fixture
def children(tmp_path: Path) -> Iterator[ChildGroup]:
    """Every process a test starts; at teardown all are stopped and none may be left alive."""
    group = ChildGroup(log_dir=tmp_path / "logs")
    yield group
    group.stop(grace_s=5.0)
    alive = [c.name for c in group.children if c.process.is_alive()]
    assert not alive, f"processes left behind: {alive}"
    for child in group.children:
        if child.process.pid:
            with pytest.raises(ProcessLookupError):
                os.kill(child.process.pid, 0)


def start_shard(group: ChildGroup, settings: ShardSettings, name: str = "ps") -> tuple[str, object]:
    """Start one shard as a child; returns its endpoint (the port it bound) and the child."""
    queue = group.ctx.Queue()
    child = group.start(name, serve_settings, settings, queue)
    try:
        port = queue.get(timeout=30)
    except Exception as exc:
        raise AssertionError(f"shard {name} did not start: {child.log.read_text() if child.log else ''}") from exc
    return f"tcp://127.0.0.1:{port}", child

"""`hetpipe train --resume` falls back past damaged checkpoints: the resume point is the newest wave that
every PS shard and every stage holds intact (hetpipe.app.train_guards.resume_point), and it says which files
it passed over."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hetpipe.app.train_guards import resume_point
from hetpipe.compute.build import VwLayout
from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.errors import UsageError
from hetpipe.core.runs.checkpoint import write_checkpoint
from hetpipe.worker.snapshot import snapshot_dir

from conftest import write_config

VWS = (VwLayout(("n0:0",), (4,)), VwLayout(("n0:1", "n0:2"), (2, 2)))


def _run_dir(tmp_path: Path) -> tuple[Path, object]:
    path = write_config(tmp_path, vws=[["n0:0"], ["n0:1", "n0:2"]], nm=2, staleness=0, waves=20)
    config = apply_overrides(load_config(path), ["checkpoint.every=2", 'checkpoint.dir="ps"'])
    run_dir = tmp_path / "run"
    dirs = [run_dir / "ps" / "shard-0"] + [snapshot_dir(run_dir, v, j) for v, j in ((0, 0), (1, 0), (1, 1))]
    for directory in dirs:
        for clock in (2, 4, 6):
            write_checkpoint(directory, clock, {"c_local": [clock]}, {"w": np.full(8, clock, np.float32)}, 0)
    return run_dir, config


def _truncate(directory: Path, clock: int) -> None:
    data = directory / f"ckpt-{clock:08d}.bin"
    data.write_bytes(data.read_bytes()[:-3])


def test_the_newest_intact_wave_of_every_part_is_the_resume_point(tmp_path: Path) -> None:
    run_dir, config = _run_dir(tmp_path)
    notes: list[str] = []
    assert resume_point(config, run_dir, VWS, notes.append) == 6 and notes == []
    _truncate(run_dir / "ps" / "shard-0", 6)
    assert resume_point(config, run_dir, VWS, notes.append) == 4
    assert "from wave 4, not 6" in notes[-1] and "PS shard 0 at 6" in notes[-1] and "truncated" in notes[-1]
    stage = snapshot_dir(run_dir, 1, 1) / "ckpt-00000004.bin"
    stage.write_bytes(b"x" + stage.read_bytes()[1:])  # changed after it was written
    assert resume_point(config, run_dir, VWS, notes.append) == 2
    assert "vw1-s1 at 4" in notes[-1] and "sha256" in notes[-1]


def test_with_no_intact_common_wave_the_resume_is_refused_naming_the_damage(tmp_path: Path) -> None:
    run_dir, config = _run_dir(tmp_path)
    for clock in (2, 4, 6):
        _truncate(snapshot_dir(run_dir, 0, 0), clock)
    with pytest.raises(
        UsageError, match=r"no wave that every PS shard and every stage holds is intact .*vw0-s0"
    ):
        resume_point(config, run_dir, VWS, print)


def test_a_finished_run_is_not_resumed_again(tmp_path: Path) -> None:
    """Its last checkpoint may lie before its last wave (every = 2): its model.pt says it finished."""
    run_dir, config = _run_dir(tmp_path)
    (run_dir / "model.pt").write_bytes(b"")
    with pytest.raises(UsageError, match="finished all 20 waves already"):
        resume_point(config, run_dir, VWS, print)

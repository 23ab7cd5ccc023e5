"""`hetpipe train --resume`: a run stopped by a killed stage continues from the newest wave the PS and every
stage checkpointed, and with exact pulls ends bit for bit where an uninterrupted run ends
(docs/recovery.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hetpipe.app.train import TrainOptions, train
from hetpipe.compute.build import model_of, vw_layouts
from hetpipe.compute.reference import run_reference
from hetpipe.core.config.files import load_config, run_dir_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import UsageError
from hetpipe.worker.snapshot import list_snapshots

from conftest import write_config

pytestmark = pytest.mark.slow

SETTINGS = ["checkpoint.every=2", "checkpoint.keep=2", 'checkpoint.dir="ps"']  # hetpipe train: <run dir>/ps


@pytest.mark.parametrize(
    ("work", "extra"),
    [
        (None, []),
        ([(2, 16), (3, 32)], []),
        ([(2, 16), (3, 32)], ["ps.node_aggregation=true"]),
        (None, ["train.freeze=[[1, 2]]"]),
        ([(2, 16), (3, 32)], ["ps.node_aggregation=true", "train.freeze=[[1, 2]]"]),
        (None, ["train.autofreeze_every=2"]),
    ],
    ids=["same-work", "per-vw-work", "node-aggregation", "freeze", "freeze-node-aggregation", "autofreeze"],
)
def test_resume_after_a_killed_stage_equals_the_uninterrupted_run(
    tmp_path: Path, work: list[tuple[int, int]] | None, extra: list[str]
):
    """The uninterrupted run is the single-process reference, which the runtime equals bit for bit
    (tests/test_train_equivalence.py); with per-VW work too (docs/wsp.md#per-vw-work), with both VWs
    (on one node) through a node relay (docs/wsp.md#node-local-aggregation), and with layers frozen from wave
    1, so the resumed stages' first pulls must bring the frozen weights the later ones leave out
    (docs/wsp.md#freezing), and with the adaptive rule, whose freeze points the restarted stages work out
    again from every movement record the shards kept in their checkpoints (docs/wsp.md#adaptive-freezing)."""
    settings = SETTINGS + extra
    path = write_config(
        tmp_path,
        work=work,
        vws=[["n0:0", "n0:1"], ["n0:2", "n0:3"]],
        nm=2,
        staleness=1,
        waves=10,
        emulation=True,
        time_scale=15.0,
        speeds=[1.0, 1.0, 1.0, 1.0],
    )
    config = apply_overrides(load_config(path), settings)
    cut = tmp_path / "cut"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hetpipe",
            "train",
            str(path),
            "--run-dir",
            str(cut),
            "--quiet",
            "--audit",
            *[a for s in settings for a in ("--set", s)],
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        stages = [(v, j) for v in range(2) for j in range(2)]
        while not all(max(list_snapshots(cut, v, j), default=0) >= 4 for v, j in stages):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.kill(json.loads((cut / "pids.json").read_text())["vw1-s0"], signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "vw1-s0" in err, err
    assert not (cut / "model.pt").exists()

    resumed = train(
        run_dir_config(cut),
        TrainOptions(run_dir=cut, progress=False, dump_weights=True, audit=True, resume=True),
    )
    assert 4 <= resumed["resumed_from"] < 10 and resumed["audit_final_ledgers_exact"] is True
    if "train.autofreeze_every=2" in extra:  # every point the rule chose, the ones before the cut too
        assert resumed["autofreeze"] == [list(p) for p in ref_points(config, work)] != []
    relayed = [p.read_text() for p in (cut / "logs").glob("relay-*.log")]
    relay = "ps.node_aggregation=true" in extra
    assert relay == any("registered upstream for vws [0, 1]" in log for log in relayed)
    splits = [lay.split for lay in vw_layouts(config, model_of(config))]
    assert all(len(split) == 2 for split in splits)
    ref = run_reference(config, splits, work=work)
    got = {(v, j): torch.load(cut / f"final-vw{v}-s{j}.pt", weights_only=True) for v, j in stages}
    for sid, want in ref.stage_weights.items():
        assert set(got[sid]) == set(want)
        for key in want:
            assert torch.equal(got[sid][key], want[key]), f"stage {sid} {key}"
    ps = torch.load(cut / "model.pt", weights_only=True)
    assert set(ps) == set(ref.ps_weights)
    for key, want in ref.ps_weights.items():
        assert torch.equal(ps[key], torch.from_numpy(want)), f"PS {key}"


def test_resume_needs_a_wave_every_part_checkpointed(tmp_path: Path):
    path = write_config(tmp_path, vws=[["n0:0"], ["n0:1"]], nm=2, staleness=0, waves=4)
    config = apply_overrides(load_config(path), SETTINGS)
    with pytest.raises(UsageError, match="no wave was checkpointed by every PS shard and every stage"):
        train(config, TrainOptions(run_dir=tmp_path / "empty", progress=False, resume=True))
    with pytest.raises(UsageError, match="resumed with \\[checkpoint\\] dir not empty, every >= 1"):
        train(load_config(path), TrainOptions(run_dir=tmp_path / "empty", progress=False, resume=True))
    spectrain = apply_overrides(config, ['train.mitigation="spectrain"'])
    with pytest.raises(UsageError, match="mitigation spectrain keeps state that stage snapshots do not hold"):
        train(spectrain, TrainOptions(run_dir=tmp_path / "empty", progress=False, resume=True))


def ref_points(config: ClusterConfig, work: list[tuple[int, int]] | None) -> tuple[tuple[int, int], ...]:
    """The freeze points the reference's adaptive rule chose."""
    splits = [lay.split for lay in vw_layouts(config, model_of(config))]
    return run_reference(config, splits, work=work).freeze

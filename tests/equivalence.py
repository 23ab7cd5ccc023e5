"""Helpers of the bit-for-bit equivalence tests: run `hetpipe train` with each stage's final weights dumped,
and compare it with the single-process reference (hetpipe.compute.reference)."""

from __future__ import annotations

from pathlib import Path

import torch

from hetpipe.app.train import TrainOptions, train
from hetpipe.compute.build import VwLayout
from hetpipe.compute.reference import run_reference
from hetpipe.core.config.schema import ClusterConfig


def layout(vws: int, stages: int) -> list[list[str]]:
    return [[f"n0:{v * stages + j}" for j in range(stages)] for v in range(vws)]


def run(tmp_path: Path, config: ClusterConfig, splits: list[tuple[int, ...]]):
    lays = tuple(
        VwLayout(tuple(str(g) for g in vw.gpus), s, vw.nm or 0, vw.batch_size or 0, vw.waves)
        for vw, s in zip(config.virtual_workers, splits, strict=True)
    )
    run_dir = tmp_path / "run"
    summary = train(config, TrainOptions(run_dir=run_dir, progress=False, dump_weights=True, layouts=lays))
    stage_weights = {}
    for v, split in enumerate(splits):
        for j in range(len(split)):
            stage_weights[(v, j)] = torch.load(run_dir / f"final-vw{v}-s{j}.pt", weights_only=True)
    ps_weights = torch.load(run_dir / "model.pt", weights_only=True)
    return summary, stage_weights, ps_weights


def listed_work(config: ClusterConfig) -> list[tuple[int, int]]:
    """Each listed VW's (Nm, minibatch size), the config's where it sets none of its own."""
    wsp, t = config.wsp, config.train
    return [(vw.nm or wsp.nm, vw.batch_size or t.batch_size) for vw in config.virtual_workers]


def assert_bitwise(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), what
    for key in a:
        x, y = torch.as_tensor(a[key]), torch.as_tensor(b[key])
        assert torch.equal(x, y), f"{what}: {key} differs by up to {float((x - y).abs().max())}"


def assert_equals_reference(
    tmp_path: Path, config: ClusterConfig, splits: list[tuple[int, ...]], order: int = 0
):
    summary, stage_weights, ps_weights = run(tmp_path, config, splits)
    ref = run_reference(config, splits, order_seed=order, work=listed_work(config))
    for sid, weights in stage_weights.items():
        assert_bitwise(weights, ref.stage_weights[sid], f"stage {sid}")
    assert_bitwise(ps_weights, ref.ps_weights, "PS weights")
    return summary, stage_weights

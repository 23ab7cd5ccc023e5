"""Bit-for-bit equivalence of the multi-process runtime (`exact` pulls, fixed seed) with
(a) plain single-process training and (b, c) the single-process reference of the WSP rules."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hetpipe.app.train import TrainOptions, train
from hetpipe.compute import data as datalib
from hetpipe.compute.build import VwLayout, dataset_of, model_of
from hetpipe.compute.reference import run_reference
from hetpipe.core.config import load_config
from hetpipe.models import build_stage

from conftest import write_config

pytestmark = pytest.mark.slow


def run(tmp_path: Path, config_path: Path, splits: list[tuple[int, ...]]):
    config = load_config(config_path)
    lays = tuple(VwLayout(tuple(str(g) for g in vw.gpus), s) for vw, s in zip(config.virtual_workers, splits, strict=True))
    run_dir = tmp_path / "run"
    summary = train(config, TrainOptions(run_dir=run_dir, progress=False, dump_weights=True, layouts=lays))
    stage_weights = {}
    for v, split in enumerate(splits):
        for j in range(len(split)):
            stage_weights[(v, j)] = torch.load(run_dir / f"final-vw{v}-s{j}.pt", weights_only=True)
    ps_weights = torch.load(run_dir / "model.pt", weights_only=True)
    return config, summary, stage_weights, ps_weights


def assert_bitwise(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), what
    for key in a:
        x, y = torch.as_tensor(a[key]), torch.as_tensor(b[key])
        assert torch.equal(x, y), f"{what}: {key} differs by up to {float((x - y).abs().max())}"


def test_a_one_vw_three_stages_nm1_equals_plain_training(tmp_path: Path):
    path = write_config(tmp_path, vws=[["n0:0", "n0:1", "n0:2"]], nm=1, staleness=0, waves=12)
    config, summary, stage_weights, _ = run(tmp_path, path, [(2, 1, 1)])
    torch.set_num_threads(1)
    spec, dataset = model_of(config), dataset_of(config)
    model = build_stage(spec, 0, spec.num_layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=config.train.momentum)
    indices = datalib.shard_indices(len(dataset.train.y), 1, 0, config.seed)
    for p in range(config.train.waves):
        x, y = datalib.minibatch(dataset.train.x, dataset.train.y, indices, 16, config.seed, p)
        spec.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    merged = {k: v for w in stage_weights.values() for k, v in w.items()}
    assert_bitwise(merged, dict(model.named_parameters()), "pipelined vs plain")
    assert summary["test_accuracy"] > 0.2  # it learned something in 12 steps


def test_b_one_vw_three_stages_nm3_equals_reference(tmp_path: Path):
    path = write_config(tmp_path, vws=[["n0:0", "n0:1", "n0:2"]], nm=3, staleness=0, waves=4)
    config, _, stage_weights, ps_weights = run(tmp_path, path, [(1, 2, 1)])
    ref = run_reference(config, [(1, 2, 1)], order_seed=1)
    for sid, weights in stage_weights.items():
        assert_bitwise(weights, ref.stage_weights[sid], f"stage {sid}")
    assert_bitwise(ps_weights, ref.ps_weights, "PS weights")


@pytest.mark.parametrize("staleness", [0, 1])
def test_c_two_vws_two_stages_nm2_equals_reference(tmp_path: Path, staleness: int):
    path = write_config(tmp_path, vws=[["n0:0", "n0:1"], ["n0:2", "n0:3"]], nm=2, staleness=staleness, waves=5)
    splits = [(2, 2), (3, 1)]  # the two VWs split the model differently
    config, _, stage_weights, ps_weights = run(tmp_path, path, splits)
    ref = run_reference(config, splits, order_seed=staleness)
    for sid, weights in stage_weights.items():
        assert_bitwise(weights, ref.stage_weights[sid], f"stage {sid}")
    assert_bitwise(ps_weights, ref.ps_weights, "PS weights")


def test_reference_is_independent_of_the_global_order(tmp_path: Path):
    path = write_config(tmp_path, vws=[["n0:0", "n0:1"], ["n0:2", "n0:3"]], nm=2, staleness=1, waves=4)
    config = load_config(path)
    one = run_reference(config, [(2, 2), (1, 3)], order_seed=0)
    two = run_reference(config, [(2, 2), (1, 3)], order_seed=99)
    for sid in one.stage_weights:
        assert_bitwise(one.stage_weights[sid], two.stage_weights[sid], f"stage {sid}")
    assert all(np.array_equal(one.ps_weights[k], two.ps_weights[k]) for k in one.ps_weights)

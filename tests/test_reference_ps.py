"""Tests of hetpipe/compute/reference_ps.py: the reference folds a wave by its own arithmetic, so the
equivalence tests see a wrong fold at the PS. Three VWs (a mean over 3 is not a power of two), exact pulls
through the runtime against the reference, latest pulls on the shard's state against sums computed here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hetpipe.compute.reference_ps import ReferencePS, _PsOptimizer
from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.wsp.aggregation import (
    KeyKind,
    MeanAggregation,
    OptimizerSettings,
    ServerOptimizer,
    SumAggregation,
    make_aggregation,
)
from hetpipe.core.wsp.state import ShardState

from conftest import write_config
from equivalence import assert_equals_reference, layout

F32 = np.float32


class WrongMean(MeanAggregation):
    """A mean that divides by one VW too many: what the reference must catch."""

    def fold_param(self, key: str, w: np.ndarray, s: np.ndarray, num_vws: int) -> np.ndarray:
        return w + s / F32(num_vws + 1)

    def add_param_now(self, key: str, w: np.ndarray, src: np.ndarray, num_vws: int) -> np.ndarray | None:
        np.add(w, src / F32(num_vws + 1), out=w)
        return None


class SummedBuffers(SumAggregation):
    """BatchNorm statistics summed over the VWs like updates instead of averaged as values."""

    def fold(self, key: str, kind: KeyKind, w: np.ndarray, s: np.ndarray, num_vws: int) -> np.ndarray:
        if kind == "buffer":
            return np.asarray(w + s, dtype=F32)
        return super().fold(key, kind, w, s, num_vws)


def test_the_references_folds_are_its_own_and_equal_the_ps_ones() -> None:
    """The same sums folded by the reference and by the PS's rules: equal bit for bit for what hetpipe ships;
    the wrong rules differ from the reference."""
    rng = np.random.default_rng(1)
    old, s = rng.standard_normal(1000).astype(F32), rng.standard_normal(1000).astype(F32)
    kinds = {"w": "param", "b": "buffer"}
    for name in ("sum", "mean"):
        ref = ReferencePS({"w": old, "b": old}, kinds, [(1,)] * 3, make_aggregation(name), None)
        ps = make_aggregation(name)
        for key in kinds:
            assert np.array_equal(ref.fold(key, old, s, 3), ps.fold(key, kinds[key], old, s, 3)), (name, key)
    for wrong in (WrongMean(), SummedBuffers()):
        ref = ReferencePS({"w": old, "b": old}, kinds, [(1,)] * 3, wrong, None)
        folds = [(ref.fold(k, old, s, 3), wrong.fold(k, kinds[k], old, s, 3)) for k in kinds]
        assert any(not np.array_equal(a, b) for a, b in folds)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_the_references_ps_optimizer_steps_as_the_shards_does(name: str) -> None:
    """Written again in torch, op by op: the same weights bit for bit over several steps, weight decay on."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal(5000).astype(F32)
    shard = ServerOptimizer(name, 0.01, 0.9, 0.01)
    mine = _PsOptimizer(OptimizerSettings(name, 0.01, 0.9, 0.01))
    a, b = w.copy(), torch.from_numpy(w.copy())
    for _ in range(5):
        g = rng.standard_normal(5000).astype(F32)
        a, b = shard.step("k", a, g), mine.step("k", b, torch.from_numpy(g))
        assert np.array_equal(a, b.numpy())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("settings", "model"),
    [
        (['ps.aggregation="mean"'], "mlp"),
        (
            ['ps.aggregation="sum"', "model.options={ batch_norm = true, channels = [4, 8], hidden = 16 }"],
            "mnist-cnn",
        ),
        (['ps.aggregation="test_reference_ps:WrongMean"'], "mlp"),
        (
            [
                'ps.aggregation="test_reference_ps:SummedBuffers"',
                "model.options={ batch_norm = true, channels = [4, 8], hidden = 16 }",
            ],
            "mnist-cnn",
        ),
    ],
)
def test_three_vws_equal_the_reference_and_a_wrong_rule_at_the_ps_does_not(
    tmp_path: Path, settings: list[str], model: str
) -> None:
    path = write_config(tmp_path, vws=layout(3, 1), nm=2, staleness=0, waves=3, model=model)
    config = apply_overrides(load_config(path), settings)
    splits = [(4,)] * 3 if model == "mlp" else [(6,)] * 3
    if "test_reference_ps:" not in settings[0]:
        assert_equals_reference(tmp_path, config, splits)
        return
    with pytest.raises(AssertionError, match="differs"):
        assert_equals_reference(tmp_path, config, splits)


def _latest_mean_check(rule: MeanAggregation) -> bool:
    """Three VWs push in turn to a latest-pull shard under `rule`; after each push the weights must be W plus
    the pushes so far, each divided by 3, in arrival order (computed here with numpy)."""
    state = ShardState(0, "latest", rule)
    w0 = np.arange(6, dtype=F32)
    for vw in range(3):
        state.register(vw, 0, 3, 1, {"k": w0.copy()}, {}, None, 0)
    expected = w0.copy()
    ok = True
    for wave in range(2):
        for vw in (2, 0, 1):
            push = np.full(6, F32(vw + 1 + 10 * wave))
            state.push(vw, 0, wave, {"k": push})
            expected = expected + push / F32(3)
            ok &= np.array_equal(state.read().tensors["k"], expected)
    return ok


def test_latest_pulls_of_three_vws_fold_each_push_at_a_third_and_a_wrong_divisor_shows() -> None:
    assert _latest_mean_check(MeanAggregation())
    assert not _latest_mean_check(WrongMean())

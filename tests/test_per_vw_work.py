"""Per-VW work per wave (docs/wsp.md#per-vw-work): VW v's wave is nm_v minibatches of b_v samples, and the PS
weighs buffers and a mean or server fold by each VW's samples. The weights, the shards, the shard's folds in
both pull modes, the audit's ledgers, the config, and runs with unequal Nm and batch through the runtime
against the reference, bit for bit; a rule that ignores the weights fails that comparison."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hetpipe.compute import data as datalib
from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.errors import ConfigError
from hetpipe.core.wsp.aggregation import MeanAggregation, SumAggregation
from hetpipe.core.wsp.audit import expected_ledger, ledger_violations
from hetpipe.core.wsp.results import WspError
from hetpipe.core.wsp.state import ShardState
from hetpipe.core.wsp.work import VwWork, sample_weights

from conftest import write_config
from equivalence import assert_equals_reference, layout

F32 = np.float32


class UnweightedMean(MeanAggregation):
    """A mean that forgets the weights: pushes summed as they are, divided by the weights' total."""

    def weighs(self, kind: str) -> bool:
        return kind == "buffer"


def test_weights_are_samples_per_wave_over_their_common_divisor() -> None:
    assert sample_weights([VwWork(2, 16), VwWork(5, 32)]) == (1, 5)
    assert sample_weights([VwWork(4, 32), VwWork(4, 32), VwWork(4, 32)]) == (1, 1, 1)
    assert sample_weights([VwWork(3, 10), VwWork(2, 25)]) == (3, 5)
    assert sample_weights([VwWork(8, 16), VwWork(2, 32)]) == (2, 1)


def test_shards_are_sized_by_weight_and_equal_weights_keep_the_old_slices() -> None:
    a, b = (datalib.shard_indices(600, 2, v, 7, (1, 5)) for v in range(2))
    assert (len(a), len(b)) == (100, 500)
    assert not set(a) & set(b)
    perm = np.random.default_rng(7).permutation(601)
    for v in range(3):  # equal work: slice v of n // 3, as before per-VW work existed
        assert np.array_equal(datalib.shard_indices(601, 3, v, 7, (2, 2, 2)), perm[v * 200 : (v + 1) * 200])
        assert np.array_equal(datalib.shard_indices(601, 3, v, 7), perm[v * 200 : (v + 1) * 200])


def _pushes(weights: tuple[int, ...], mode: str, rule: MeanAggregation | SumAggregation) -> ShardState:
    state = ShardState(0, mode, rule)
    n = len(weights)
    for vw in range(n):
        initial = {"k": np.arange(4, dtype=F32), "b": np.zeros(4, F32), "t": np.asarray(F32(0))}
        state.register(vw, 0, n, 1, initial, {"b": "buffer", "t": "buffer"}, None, 0, weights)
    return state


@pytest.mark.parametrize("mode", ["exact", "latest"])
def test_a_mean_and_buffers_weigh_each_vw_by_its_samples(mode: str) -> None:
    """Three VWs of weights 1, 2, 3 push one wave (in the order 2, 0, 1): the mean is W + sum k_v P_v / 6 and
    a buffer sum k_v B_v / 6, computed here with numpy; a mean that ignores the weights is off."""
    weights = (1, 2, 3)
    pushes = {v: np.full(4, F32(v + 1) / F32(7)) for v in range(3)}
    buffers = {v: np.full(4, F32(10 * (v + 1))) for v in range(3)}

    def folded(rule: MeanAggregation) -> ShardState:
        state = _pushes(weights, mode, rule)
        for vw in (2, 0, 1):
            state.push(vw, 0, 0, {"k": pushes[vw], "b": buffers[vw], "t": np.asarray(F32(vw + 1))})
        return state

    total = pushes[0] * F32(1)
    for v in (1, 2):
        total = total + pushes[v] * F32(weights[v])
    if mode == "latest":  # folded as each arrives, in arrival order
        want = np.arange(4, dtype=F32)
        for v in (2, 0, 1):
            want = want + (pushes[v] * F32(weights[v])) / F32(6)
    else:
        want = np.arange(4, dtype=F32) + total / F32(6)
    state = folded(MeanAggregation())
    got = state.read().tensors
    assert np.array_equal(got["k"], want)
    bsum = buffers[0] + buffers[1] * F32(2) + buffers[2] * F32(3)
    assert np.array_equal(got["b"], bsum / F32(6))
    assert got["t"].shape == () and got["t"] == (F32(1) + F32(2) * F32(2) + F32(3) * F32(3)) / F32(6)
    assert not np.array_equal(folded(UnweightedMean()).read().tensors["k"], want)


@pytest.mark.parametrize("mode", ["exact", "latest"])
def test_after_an_eviction_a_mean_divides_by_the_live_vws_weights(mode: str) -> None:
    """Weights 1, 2, 3; VW 2 is evicted after wave 0: wave 0 folds over 6, wave 1 over 1 + 2 = 3."""
    state = _pushes((1, 2, 3), mode, MeanAggregation())
    zero = {"b": np.zeros(4, F32), "t": np.asarray(F32(0))}
    for vw in range(3):
        state.push(vw, 0, 0, {"k": np.full(4, F32(6)), **zero})
    state.evict(2)
    for vw in range(2):
        state.push(vw, 0, 1, {"k": np.full(4, F32(3)), **zero})
    # wave 0: (6 + 2 * 6 + 3 * 6) / 6 = 6; wave 1: (3 + 2 * 3) / 3 = 3
    want = np.arange(4, dtype=F32) + F32(9)
    assert np.array_equal(state.read().tensors["k"], want)


def test_a_sum_stays_unweighted() -> None:
    state = _pushes((1, 4), "exact", SumAggregation())
    for vw in range(2):
        state.push(
            vw, 0, 0, {"k": np.ones(4, F32) * F32(vw + 1), "b": np.zeros(4, F32), "t": np.asarray(F32(1))}
        )
    assert np.array_equal(state.read().tensors["k"], np.arange(4, dtype=F32) + F32(3))


def test_registrations_must_agree_on_the_weights_and_a_checkpoint_keeps_them() -> None:
    state = _pushes((1, 5), "latest", MeanAggregation())
    again = {"k": np.arange(4, dtype=F32), "b": np.zeros(4, F32)}
    with pytest.raises(WspError, match="weigh"):
        state.register(0, 0, 2, 1, again, {"b": "buffer"}, None, 0, (1, 1))
    with pytest.raises(WspError, match="one weight >= 1 per VW"):
        state.register(0, 0, 2, 1, again, {"b": "buffer"}, None, 0, (1, 5, 1))
    state.push(1, 0, 0, {"k": np.ones(4, F32), "b": np.full(4, F32(2)), "t": np.asarray(F32(2))})
    meta, arrays = state.to_state()
    back = ShardState.from_state(meta, arrays, MeanAggregation())
    assert back.membership.weights == (1, 5)
    last = {"k": np.ones(4, F32), "b": np.zeros(4, F32), "t": np.asarray(F32(1))}
    back.push(0, 0, 0, dict(last))
    state.push(0, 0, 0, dict(last))
    for key in ("k", "b", "t"):
        assert np.array_equal(back.read().tensors[key], state.read().tensors[key])


def test_the_audit_reads_each_vws_row_in_its_own_waves() -> None:
    """VW 0 at Nm 2, VW 1 at Nm 5, D = 0: before wave 2 of VW 0 (minibatch 4), G needs VW 1's wave 0 (its
    minibatches 0-4), not its first two minibatches only."""
    nms = (2, 5)
    ledger = expected_ledger((2, 15), nms, [], 1)  # every VW's wave 0 in
    assert ledger[0, :2].all() and not ledger[0, 2:].any() and ledger[1, :5].all() and not ledger[1, 5:].any()
    ledger[0, 2:4] = 1.0  # VW 0's own wave 1, as L wants before minibatch 4 + ... (p - Nm = 2)
    assert ledger_violations(ledger, 0, 4, nms, 0) == []
    ledger[1, 4] = 0.0
    assert any("vw 1's update of minibatch 4" in p for p in ledger_violations(ledger, 0, 4, nms, 0))


def test_the_config_gives_a_vw_its_own_nm_and_batch(tmp_path: Path) -> None:
    path = write_config(tmp_path, vws=layout(2, 1), nm=2, staleness=0, waves=2, work=[(2, 16), (5, 32)])
    vws = load_config(path).virtual_workers
    assert [(vw.nm, vw.batch_size) for vw in vws] == [(2, 16), (5, 32)]
    bad = write_config(tmp_path, vws=layout(2, 1), nm=2, staleness=0, waves=2, work=[(2, 16), (0, 32)])
    with pytest.raises(ConfigError, match=r"virtual_workers\[1\]\.nm"):
        load_config(bad)


MLP = "mlp"
CNN_BN = ["model.options={ batch_norm = true, channels = [4, 8], hidden = 16 }"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rule", "model", "splits"),
    [
        ("mean", MLP, [(2, 1, 1), (4,)]),  # 3 stages at Nm 2 x 16, 1 stage at Nm 5 x 32
        ("server", MLP, [(4,), (2, 2)]),
        ("sum", "mnist-cnn", [(2, 2, 2), (6,)]),  # BatchNorm buffers averaged by samples
    ],
)
def test_unequal_nm_and_batch_equal_the_reference_bit_for_bit(
    tmp_path: Path, rule: str, model: str, splits: list[tuple[int, ...]]
) -> None:
    vws = [[f"n0:{sum(len(s) for s in splits[:v]) + j}" for j in range(len(splits[v]))] for v in range(2)]
    path = write_config(tmp_path, vws=vws, nm=2, staleness=0, waves=3, model=model, work=[(2, 16), (5, 32)])
    settings = [f'ps.aggregation="{rule}"'] + (CNN_BN if model == "mnist-cnn" else [])
    summary, _ = assert_equals_reference(tmp_path, apply_overrides(load_config(path), settings), splits)
    assert summary["samples"] == 3 * (2 * 16 + 5 * 32)
    # train_s spans every minibatch but the first (of either VW): timed_samples are those, at their batch
    assert summary["timed_samples"] in (summary["samples"] - 16, summary["samples"] - 32)
    assert summary["work"] == [{"nm": 2, "batch": 16}, {"nm": 5, "batch": 32}]


@pytest.mark.slow
def test_three_vws_of_unequal_work_catch_a_mean_that_ignores_the_weights(tmp_path: Path) -> None:
    path = write_config(
        tmp_path, vws=layout(3, 1), nm=2, staleness=1, waves=3, work=[(2, 16), (3, 16), (2, 32)]
    )
    config = load_config(path)
    assert_equals_reference(
        tmp_path / "right", apply_overrides(config, ['ps.aggregation="mean"']), [(4,)] * 3
    )
    wrong = apply_overrides(config, ['ps.aggregation="test_per_vw_work:UnweightedMean"'])
    with pytest.raises(AssertionError, match="differs"):
        assert_equals_reference(tmp_path / "wrong", wrong, [(4,)] * 3)

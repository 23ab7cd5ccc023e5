"""The fair peers of launch/bench: DDP with a global batch split by speed (peers.py), its --ddp set and the
hetpipe-fastest row (throughput.py). Pure: no processes (the DDP run itself is in test_bench_peers.py)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import click
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.errors import UsageError
from hetpipe.core.hardware.emulate import cpu_cores, slowdowns

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
import peers  # noqa: E402  (launch/bench is not a package)
import throughput  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "launch" / "clusters" / "bench.toml"


def _devs(*slowdowns_: float) -> list[peers.Device]:
    """GPUs n0:0, n0:1, ... with these slowdowns, each of speed 1/slowdown, typed by their slowdown."""
    return [peers.Device(f"n0:{i}", f"x{s:g}", 1 / s, 1, s) for i, s in enumerate(slowdowns_)]


# ---------------------------------------------------------------------------------------------- the split


@pytest.mark.parametrize(
    ("global_batch", "speeds", "expected"),
    [
        (10, [3.0, 1.0], [8, 2]),  # quotas 7.5 / 2.5: the tied remainder goes to the faster rank
        (10, [1.0, 3.0], [2, 8]),
        (6, [2.0, 1.0], [4, 2]),  # exact quotas
        (7, [1.0, 1.0, 1.0], [3, 2, 2]),  # equal speeds and remainders: the earlier rank
        (1024, [14.9, 14.9, 5.3, 5.3], [378, 378, 134, 134]),  # bench.toml's four that fit: 377.66 / 134.34
        (512, [14.9, 14.9, 5.3, 5.3], [189, 189, 67, 67]),  # 188.83 / 67.17
        (5, [100.0, 1.0, 1.0], [3, 1, 1]),  # minimum 1: quotas 4.90 / 0.05 / 0.05, the fast rank gives back
        (3, [5.0, 1.0, 1.0], [1, 1, 1]),  # as many samples as GPUs
        (1, [7.0], [1]),
    ],
)
def test_proportional_split(global_batch: int, speeds: list[float], expected: list[int]) -> None:
    assert peers.proportional_split(global_batch, speeds) == expected


@pytest.mark.parametrize(
    ("global_batch", "speeds", "says"),
    [(2, [1.0, 1.0, 1.0], "at least 3"), (4, [], "at least one GPU"), (4, [1.0, 0.0], "> 0")],
)
def test_proportional_split_refuses(global_batch: int, speeds: list[float], says: str) -> None:
    with pytest.raises(UsageError, match=says):
        peers.proportional_split(global_batch, speeds)


@given(
    st.lists(st.floats(0.1, 100.0), min_size=1, max_size=8),
    st.integers(0, 2000),
)
def test_proportional_split_sums_exactly_keeps_one_and_follows_speed(speeds: list[float], extra: int) -> None:
    global_batch = len(speeds) + extra
    out = peers.proportional_split(global_batch, speeds)
    assert sum(out) == global_batch and min(out) >= 1
    quota = [global_batch * s / sum(speeds) for s in speeds]
    for i, j in itertools.permutations(range(len(speeds)), 2):
        if speeds[i] > speeds[j]:
            assert out[i] >= out[j]
    if min(quota) >= 1:  # nobody lifted to the minimum: each within one sample of its quota
        assert all(abs(o - q) < 1 for o, q in zip(out, quota, strict=True))


def test_speed_batches_split_by_one_over_slowdown() -> None:
    # bench.toml's slowdowns at time_scale 10: TITAN V 10, P4000 10 x 14.9 / 5.3
    devs = _devs(10.0, 10.0, 10 * 14.9 / 5.3, 10 * 14.9 / 5.3)
    assert peers.speed_batches(devs, 1024) == [378, 378, 134, 134]
    assert peers.speed_batches(_devs(1.0, 1.0, 1.0), 9) == [3, 3, 3]  # emulation off: all alike


# ---------------------------------------------------------------------------------------------- the weighting


@pytest.mark.parametrize(
    ("batch", "world", "global_batch", "weight"),
    [(3, 2, 8, 0.75), (5, 2, 8, 1.25), (4, 2, 8, 1.0), (378, 4, 1024, 1.4765625), (1, 3, 3, 1.0)],
)
def test_loss_weight(batch: int, world: int, global_batch: int, weight: float) -> None:
    assert peers.loss_weight(batch, world, global_batch) == weight


def test_loss_weight_refuses_empty() -> None:
    with pytest.raises(UsageError):
        peers.loss_weight(0, 2, 8)


def test_rank_loss_leaves_an_equal_share_untouched() -> None:
    loss = torch.tensor(2.5)
    assert peers.rank_loss(loss, 4, 2, 8) is loss
    assert float(peers.rank_loss(loss, 3, 2, 8)) == 2.5 * 0.75


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def test_weighted_rank_gradients_average_to_the_whole_batch_gradient() -> None:
    """Two ranks with 3 and 5 samples: DDP's mean of their rank_loss gradients is the gradient of the mean
    loss over all 8 samples (and the plain mean of their own gradients is not)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))
    loss_fn = torch.nn.functional.cross_entropy
    x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
    parts = [(x[:3], y[:3]), (x[3:], y[3:])]
    world, global_batch = len(parts), len(y)
    per_rank = [
        _grads(model, peers.rank_loss(loss_fn(model(xr), yr), len(yr), world, global_batch))
        for xr, yr in parts
    ]
    allreduced = [sum(g) / world for g in zip(*per_rank, strict=True)]  # DDP: sum over ranks / world
    whole = _grads(model, loss_fn(model(x), y))
    for got, want in zip(allreduced, whole, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    plain = [
        sum(g) / world for g in zip(*(_grads(model, loss_fn(model(a), b)) for a, b in parts), strict=True)
    ]
    assert max(float((p - w).abs().max()) for p, w in zip(plain, whole, strict=True)) > 1e-3


# ---------------------------------------------------------------------------------------------- --ddp


def test_parse_ddp_reads_prop_as_a_global_batch() -> None:
    assert throughput.parse_ddp("fit@256,fastest@256/512,prop@1024/512", 256, 4) == [
        ("fit", [256]),
        ("fastest", [256, 512]),
        ("prop", [1024, 512]),
    ]
    # without @: fit and fastest the config's batch, prop the config's batch x the GPUs that fit
    assert throughput.parse_ddp("fit,fastest,prop", 64, 4) == [
        ("fit", [64]),
        ("fastest", [64]),
        ("prop", [256]),
    ]
    assert throughput.parse_ddp(throughput.DEFAULT_DDP, 256, 4)[-1] == ("prop", [1024])


@pytest.mark.parametrize("text", ["slow@256", "prop@0", "prop@x", "fit@256,prop@-4"])
def test_parse_ddp_refuses(text: str) -> None:
    with pytest.raises(click.BadParameter):
        throughput.parse_ddp(text, 256, 4)


def test_parse_micro_reads_pairs_and_none() -> None:
    assert throughput.parse_micro("256x12,128x24") == [(256, 12), (128, 24)]
    assert throughput.parse_micro("none") == []  # no pipeline row
    with pytest.raises(click.BadParameter):
        throughput.parse_micro("256x0")


def test_ddp_rows_batches_and_descriptions() -> None:
    subsets = peers.ddp_subsets(_devs(10.0, 10.0, 10 * 14.9 / 5.3, 10 * 14.9 / 5.3))
    prop, what = throughput.ddp_members_of("prop", subsets)
    assert [d.gpu for d in prop] == ["n0:0", "n0:1", "n0:2", "n0:3"] and what == "all that fit"
    fastest, _ = throughput.ddp_members_of("fastest", subsets)
    assert [d.gpu for d in fastest] == ["n0:0", "n0:1"]
    assert throughput.ddp_batches("fit", 256, prop) == [256] * 4
    batches = throughput.ddp_batches("prop", 1024, prop)
    assert batches == [378, 378, 134, 134]
    text = throughput.ddp_setting("prop", 1024, prop, what, batches)
    assert "global batch 1024" in text and "378/378/134/134" in text and "gpu_types speed" in text
    with pytest.raises(click.BadParameter, match="prop@4"):
        throughput.ddp_batches("prop", 3, prop)
    assert throughput.ddp_batches("prop", 1024, []) == []  # no GPU fits: peers.run_ddp says so when it runs
    assert throughput.ddp_setting("fit", 256, prop, what, [256] * 4) == "4 GPUs (all that fit), batch 256/GPU"


# ------------------------------------------------------------------------------------------- hetpipe-fastest


def test_fastest_overrides_give_one_vw_per_titan_v() -> None:
    config = load_config(BENCH)
    assert throughput.fastest_overrides(config, peers.devices(config)) == [
        'allocation.policy="explicit"',
        'virtual_workers=[{ gpus = ["n0:0"] }, { gpus = ["n0:1"] }]',
        "emulation.time_scale=10.0",
    ]
    fast = apply_overrides(config, throughput.fastest_overrides(config, peers.devices(config)))
    assert [[str(g) for g in vw.gpus] for vw in fast.virtual_workers] == [["n0:0"], ["n0:1"]]
    assert fast.allocation.policy == "explicit"


def test_fastest_on_one_node_keeps_its_ps_shard_there_under_a_per_node_placement() -> None:
    """bench.toml's TITAN Vs both sit on n0: under "spread" (a shard on every node) the pair would push and
    pull over n0's link to n1 and n2; its row runs one balanced shard instead, on the PS node."""
    config = apply_overrides(load_config(BENCH), ['ps.placement="spread"', "ps.shards=3"])
    overrides = throughput.fastest_overrides(config, peers.devices(config))
    assert overrides[-2:] == ['ps.placement="balanced"', "ps.shards=1"]
    fast = apply_overrides(config, overrides)
    assert (fast.ps.placement, fast.ps.shards, fast.ps.shard_per_node) == ("balanced", 1, False)


def test_fastest_keeps_the_whole_clusters_slowdowns_under_auto_time_scale() -> None:
    """The runtime derives slowdowns from its VWs' GPUs alone (worker/jobs.py emulated_slowdowns): the pinned
    time_scale gives the TITAN Vs the slowdown they have among all six GPUs."""
    config = apply_overrides(load_config(BENCH), ['emulation.time_scale="auto"'])
    devs = peers.devices(config)
    fast = apply_overrides(config, throughput.fastest_overrides(config, devs))
    vw_gpus = {str(g): fast.gpu(g).speed for vw in fast.virtual_workers for g in vw.gpus}
    runtime = slowdowns(vw_gpus, cpu_cores(), fast.emulation.time_scale)
    assert runtime == {d.gpu: d.slowdown for d in devs if d.gpu in vw_gpus}


def test_fastest_overrides_none_for_one_type() -> None:
    config = load_config(BENCH)
    assert throughput.fastest_overrides(config, _devs(10.0, 10.0)) == []


_TINY = """name = "fair-peers"
seed = 1
[gpu_types.fast]
speed = 2.0
memory_gib = 1.0
[gpu_types.slow]
speed = 1.0
memory_gib = 1.0
[[nodes]]
name = "n0"
gpus = ["fast", "slow", "fast"]
[model]
name = "mlp"
options = { image_size = 8, hidden = [16, 16, 16] }
[data]
name = "synthetic"
options = { input_shape = [1, 8, 8], num_classes = 10, n = 256 }
[train]
batch_size = 8
[emulation]
time_scale = 1.0
"""


def test_hetpipe_fastest_plans_one_whole_model_vw_per_fast_gpu(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(_TINY)
    config = load_config(path)
    devs = peers.devices(config)
    fast = apply_overrides(config, throughput.fastest_overrides(config, devs))
    profile = peers.model_profile(fast, 8, tmp_path / "profiles")
    for use_planner in (True, False):
        setup = throughput.hetpipe_setup(fast, profile, use_planner, 4, None, None, ("explicit",))
        assert setup.vws == ((("n0:0",), (5,)), (("n0:2",), (5,)))


def test_time_to_accuracy_runs_ddp_prop_at_ddp_fits_global_batch(tmp_path: Path) -> None:
    import time_to_accuracy as tta
    import tta_tasks

    path = tmp_path / "tiny.toml"
    path.write_text(_TINY)
    config = load_config(path)
    task = tta_tasks.Task("tiny", path, (), 0.5, (0.01,), 10.0, 100, 1, "")
    goal = tta.goal_for("classification", 0.5)
    profile = peers.model_profile(config, 8, tmp_path / "profiles")
    bench = tta.Bench(task, config, goal, tmp_path, profile, 10.0, 1, 4, None)
    assert "ddp-prop" in tta.SYSTEMS
    assert [d.gpu for d in bench.members("ddp-prop")] == ["n0:0", "n0:1", "n0:2"]  # every GPU fits
    assert bench.ddp_batch("ddp-fit") == 8
    assert bench.ddp_batch("ddp-prop") == [10, 5, 9]  # 24 by speeds 2/1/2: quotas 9.6 / 4.8 / 9.6
    assert bench.setting("ddp-prop") == bench.setting("ddp-fit")  # the same updates: one learning-rate sweep
    assert "global batch 24 split by speed" in bench.describe("ddp-prop", 0.01)
    assert "10/5/9" in bench.describe("ddp-prop", 0.01)

"""The partitioner (hetpipe/partition.py): hand-computed cases, brute force on random instances, errors,
speed."""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Sequence

import pytest
import torch

from hetpipe.core.config.schema import NetworkConfig
from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.core.planning.memory import MemoryRule, stage_memory
from hetpipe.core.planning.partition import best_order_and_nm, minibatch_time_s, partition
from hetpipe.core.planning.plan import StagePlan, VwPlan
from hetpipe.core.planning.profile import LayerProfile, ModelProfile
from hetpipe.models import get_model, param_counts

FAST = 8.0e9  # Gbit/s: transfers of a few bytes take ~nothing


def rule_of(stashing: bool, nm: int = 1) -> MemoryRule:
    """wsp without a PS (no baseline, no update sums), so the literal sums below are about the pipeline
    alone."""
    return MemoryRule(nm=nm, weight_stashing=stashing, ps=False)


def make_profile(
    times: Sequence[float],
    *,
    params: Sequence[int] | None = None,
    outputs: Sequence[int] | None = None,
    saved: Sequence[int] | None = None,
    working: Sequence[int] | None = None,
    optimizer: Sequence[int] | None = None,
    input_bytes: int = 0,
    gpu_type: str = "t",
) -> ModelProfile:
    """A profile whose layer i takes times[i] (forward a third, backward two thirds)."""
    n = len(times)
    params = params or [0] * n
    layers = tuple(
        LayerProfile(
            f"l{i}",
            times[i] / 3,
            times[i] * 2 / 3,
            params[i],
            (optimizer or [0] * n)[i],
            (outputs or [0] * n)[i],
            (saved or [0] * n)[i],
            (working or [0] * n)[i],
        )
        for i in range(n)
    )
    return ModelProfile("toy", 4, gpu_type, "float32", "x", input_bytes, layers)


def gpus(*memories: int) -> list[tuple[str, str, int]]:
    return [(f"n{j}:0", "t", m) for j, m in enumerate(memories)]


# ---------------------------------------------------------------------------------------------- by hand


def test_homogeneous_even_split() -> None:
    profile = make_profile([1, 1, 1, 1])
    vw = partition([profile, profile], gpus(10**9, 10**9), [FAST], 2)
    assert vw.split == (2, 2)
    assert vw.bottleneck_s == pytest.approx(2.0)
    assert vw.gpus == ("n0:0", "n1:0")
    assert vw.nm == 2


def test_faster_gpu_takes_more_layers() -> None:
    fast = make_profile([1] * 6)
    slow = fast.scaled("slow", 3.0)
    vw = partition([fast, slow], gpus(10**9, 10**9), [FAST], 1)
    # fast takes x layers (x s), slow 6 - x (3 (6 - x) s): x = 5 gives max(5, 3) = 5, x = 4 gives 6
    assert vw.split == (5, 1)
    assert vw.bottleneck_s == pytest.approx(5.0)
    assert [s.forward_s + s.backward_s for s in vw.stages] == pytest.approx([5.0, 3.0])


def test_memory_binds_the_split() -> None:
    fast = make_profile([1] * 6, params=[100] * 6)
    slow = fast.scaled("slow", 3.0)
    # nm = 1 without stashing: stage memory = weights + gradients = 200 per layer; the fast GPU holds 3 layers
    vw = partition([fast, slow], gpus(600, 10**9), [FAST], 1, rule=rule_of(False))
    assert vw.split == (3, 3)
    assert vw.bottleneck_s == pytest.approx(9.0)
    assert [s.memory_bytes for s in vw.stages] == [600, 600]
    assert [s.memory_limit_bytes for s in vw.stages] == [600, 10**9]
    # a reserve of 1 byte leaves room for 2 layers only: 2 + 12 s
    assert partition(
        [fast, slow], gpus(600, 10**9), [FAST], 1, rule=rule_of(False), reserve_bytes=1
    ).split == (2, 4)


def test_transfers_count_on_both_sides_of_a_cut() -> None:
    # 8 Gbit/s = 1e9 B/s. Outputs of layers 0, 1, 2: 0.1 s, 1 s, 0.1 s to send (and as much for the gradient)
    profile = make_profile([1, 1, 1, 1], outputs=[10**8, 10**9, 10**8, 10**7], input_bytes=10**9)
    vw = partition([profile, profile], gpus(10**12, 10**12), [8.0], 1)
    # cut after layer 0: 1 + 0.2 | 3 + 0.2; after 1: 2 + 2 | 2 + 2; after 2: 3.2 | 1.2 -> 3.2, a tie
    assert vw.bottleneck_s == pytest.approx(3.2)
    first, second = vw.stages
    assert first.recv_s == pytest.approx(first.send_s) and first.send_s in (pytest.approx(0.1),)
    assert second.recv_s == pytest.approx(0.1) and second.send_s == pytest.approx(0.1)
    # the model input (10**9 B) and the last output cross no link
    assert partition([profile], gpus(10**12), [], 1).stages[0].recv_s == 0.0


def test_tie_break_on_lower_peak_memory() -> None:
    # splits (1, 2) and (2, 1) both take 2 s; the heavy layer 1 costs stage 0 (2 in flight, 2 stashed
    # versions) 4 x 1000 B but stage 1 only 3 x 1000 B, so it goes to stage 1
    profile = make_profile([2, 0, 2], params=[0, 1000, 0])
    vw = partition([profile, profile], gpus(10**6, 10**6), [FAST], 2, rule=rule_of(True))
    assert vw.split == (1, 2)
    assert [s.memory_bytes for s in vw.stages] == [0, 3000]
    # with the heavy layer's GPU too small for it at stage 1 but not at stage 0, the other tie wins
    vw = partition([profile, profile], gpus(4000, 2999), [FAST], 2, rule=rule_of(True))
    assert vw.split == (2, 1)


def test_stashing_and_nm_raise_memory() -> None:
    profile = make_profile([1, 1], params=[100, 100], saved=[10, 10], input_bytes=5, outputs=[7, 7])
    plain = partition([profile, profile], gpus(10**6, 10**6), [FAST], 3, rule=rule_of(False))
    stashed = partition([profile, profile], gpus(10**6, 10**6), [FAST], 3, rule=rule_of(True))
    # stage 0, 3 in flight: 100 + 100 grads + 3 x (5 input + 7 output) + 7 output gradient received, and
    # 3 x (10 saved + 100 stashed) with stashing; without, the backward recomputes the forward: 1 x 10 saved
    assert plain.stages[0].memory_bytes == 253
    assert stashed.stages[0].memory_bytes == 573
    # stage 1, 2 in flight: 200 + 2 x 7 + (3 + 1) x 7 input gradients sent back [+ 1 x 10 | + 2 x (10 + 100)]
    assert plain.stages[1].memory_bytes == 252
    assert stashed.stages[1].memory_bytes == 462
    assert stashed.param_bytes == 200


def test_single_gpu() -> None:
    vw = partition([make_profile([1, 2, 3])], gpus(10**6), [], 4)
    assert vw.split == (3,)
    assert vw.bottleneck_s == pytest.approx(6.0)


# ---------------------------------------------------------------------------------------------- errors


def test_nothing_fits_names_the_gpu_its_need_and_the_fix() -> None:
    profile = make_profile([1, 1], params=[100, 100])
    with pytest.raises(HetpipeError) as info:
        partition(
            [profile, profile], [("n0:0", "small", 150), ("n1:0", "big", 180)], [FAST], 2, rule=rule_of(True)
        )
    text = str(info.value)
    # best case: one layer each; stage 0 (2 in flight): 100 + 100 + 2 x 100 stashed = 400 B, stage 1 300 B
    assert "GPU n0:0 (small, 150 B)" in text
    assert "needs 400 B for layer 0 but has 150 B usable" in text
    assert "split [1, 1]" in text
    assert "lower batch_size, lower nm, or add GPUs to the VW" in text
    assert "weights 100 B + gradients 100 B + stashed weights 200 B" in text


def test_nothing_fits_with_a_reserve_says_so() -> None:
    profile = make_profile([1], params=[2**30])
    with pytest.raises(
        HetpipeError,
        match=r"GPU n0:0 \(t, 3.00 GiB minus a reserve of 1.50 GiB\) needs 2.00 GiB "
        r"for layer 0 but has 1.50 GiB usable",
    ):
        partition([profile], gpus(3 * 2**30), [], 1, rule=rule_of(False), reserve_bytes=3 * 2**29)


def test_fixed_split_overrides_and_reports_memory() -> None:
    profile = make_profile([1, 1, 1, 1], params=[10, 20, 30, 40])
    vw = partition([profile, profile], gpus(10**6, 10**6), [FAST], 1, rule=rule_of(False), fixed_split=[1, 3])
    assert vw.split == (1, 3)
    assert [s.memory_bytes for s in vw.stages] == [20, 180]
    assert vw.bottleneck_s == pytest.approx(3.0)
    with pytest.raises(
        HetpipeError,
        match=r"with the fixed split \[1, 3\], stage 1 on GPU n1:0 .* needs 180 B "
        r"for layers 1-3 but has 100 B usable.*move layers off that stage",
    ):
        partition([profile, profile], gpus(10**6, 100), [FAST], 1, rule=rule_of(False), fixed_split=[1, 3])


@pytest.mark.parametrize("split", [[4], [1, 2], [0, 4], [1, 1, 2], [2.0, 2]])
def test_fixed_split_must_cover_the_model(split: list) -> None:
    profile = make_profile([1, 1, 1, 1])
    with pytest.raises(UsageError, match="give 2 layer counts"):
        partition([profile, profile], gpus(10**6, 10**6), [FAST], 1, fixed_split=split)


def test_usage_errors() -> None:
    profile = make_profile([1, 1])
    with pytest.raises(UsageError, match="at most 2 GPUs"):
        partition([profile] * 3, gpus(1, 1, 1), [FAST, FAST], 1)
    with pytest.raises(UsageError, match="one profile per GPU"):
        partition([profile], gpus(1, 1), [FAST], 1)
    with pytest.raises(UsageError, match="k - 1 = 1"):
        partition([profile, profile], gpus(1, 1), [], 1)
    with pytest.raises(UsageError, match="link_gbps"):
        partition([profile, profile], gpus(1, 1), [0.0], 1)
    with pytest.raises(UsageError, match="nm must be"):
        partition([profile, profile], gpus(1, 1), [FAST], 0)
    with pytest.raises(UsageError, match="same model at the same batch size"):
        partition([profile, make_profile([1, 1, 1])], gpus(1, 1), [FAST], 1)


def test_a_cuda_stage_needs_room_for_its_push_staging() -> None:
    profile = make_profile([1.0, 1.0], params=[100, 50], outputs=[10, 10], saved=[5, 5])
    plain = MemoryRule(nm=2)
    need = stage_memory(profile.layers, 0, 1, plain, input_bytes=0)
    assert partition([profile], gpus(need), [], 2, rule=plain).stages[0].memory_bytes == need
    staged = MemoryRule(nm=2, staged_push=True)
    assert stage_memory(profile.layers, 0, 1, staged, input_bytes=0) == need + 150
    with pytest.raises(HetpipeError, match="add GPUs to the VW"):
        partition([profile], gpus(need), [], 2, rule=staged)
    assert partition([profile], gpus(need + 150), [], 2, rule=staged).stages[0].memory_bytes == need + 150


# ---------------------------------------------------------------------------------------------- brute force


def brute_force(
    profiles: Sequence[ModelProfile], caps: Sequence[int], links: Sequence[float], nm: int, stash: bool
) -> tuple[float, float] | None:
    """Every split, its stage times and memory computed directly: (least bottleneck, least peak use at it)."""
    n, k = profiles[0].num_layers, len(profiles)
    results = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        times, uses = [], []
        for j in range(k):
            start, stop = bounds[j], bounds[j + 1]
            layers = profiles[j].layers[start:stop]
            entering = profiles[j].input_bytes if start == 0 else profiles[j].layers[start - 1].output_bytes
            t = sum(layer.forward_s + layer.backward_s for layer in layers)
            if j > 0:
                t += 2 * entering / (links[j - 1] * 1e9 / 8)
            if j < k - 1:
                t += 2 * layers[-1].output_bytes / (links[j] * 1e9 / 8)
            times.append(t)
            need = stage_memory(layers, j, k, rule_of(stash, nm), input_bytes=entering)
            uses.append(need / caps[j] if caps[j] > 0 else math.inf)
        if max(uses) <= 1:
            results.append((max(times), max(uses)))
    if not results:
        return None
    best = min(t for t, _ in results)
    return best, min(u for t, u in results if t <= best * (1 + 1e-9))


def random_instance(
    rng: random.Random,
) -> tuple[list[ModelProfile], list[tuple[str, str, int]], list[float], int, bool]:
    k = rng.randint(1, 4)
    n = rng.randint(k, 12)
    whole = rng.random() < 0.3  # small integer times: many exact ties
    times = [float(rng.randint(0, 3)) if whole else rng.uniform(0.0, 2.0) for _ in range(n)]
    base = make_profile(
        times,
        params=[rng.choice([0, rng.randint(1, 1000)]) for _ in range(n)],
        optimizer=[rng.randint(0, 500) for _ in range(n)],
        outputs=[rng.randint(1, 1000) for _ in range(n)],
        saved=[rng.randint(0, 500) for _ in range(n)],
        working=[rng.randint(0, 300) for _ in range(n)],
        input_bytes=rng.randint(0, 1000),
    )
    nm = rng.randint(1, 5)
    stash = rng.random() < 0.7
    whole_model = stage_memory(base.layers, 0, 1, rule_of(stash, nm), input_bytes=base.input_bytes)
    profiles, devices = [], []
    for j in range(k):
        profiles.append(base.scaled(f"type{j}", rng.choice([1.0, 1.0, 0.5, 2.0, rng.uniform(0.3, 3.0)])))
        devices.append((f"n{j}:0", f"type{j}", int(whole_model * rng.uniform(0.1, 1.5))))
    links = [rng.choice([FAST, rng.uniform(2e-6, 2e-5)]) for _ in range(k - 1)]  # 2e-6 Gbit/s: 1000 B in 4 s
    return profiles, devices, links, nm, stash


def test_matches_brute_force_on_500_random_instances() -> None:
    rng = random.Random(20240607)
    feasible = infeasible = 0
    for case in range(500):
        profiles, devices, links, nm, stash = random_instance(rng)
        reserve = rng.choice([0, 0, 50])
        caps = [m - reserve for _, _, m in devices]
        expected = brute_force(profiles, caps, links, nm, stash)
        try:
            vw = partition(profiles, devices, links, nm, rule=rule_of(stash), reserve_bytes=reserve)
        except HetpipeError as exc:
            assert expected is None, f"case {case}: partition found nothing, brute force {expected}: {exc}"
            assert "add GPUs to the VW" in str(exc)
            infeasible += 1
            continue
        assert expected is not None, f"case {case}: partition found {vw.split}, brute force nothing"
        feasible += 1
        best, peak = expected
        assert vw.bottleneck_s == pytest.approx(best, rel=1e-9, abs=1e-12), f"case {case}"
        assert max(s.memory_bytes / s.memory_limit_bytes for s in vw.stages) == pytest.approx(peak, rel=1e-12)
        assert all(s.memory_bytes <= s.memory_limit_bytes for s in vw.stages)
        assert sum(vw.split) == profiles[0].num_layers and min(vw.split) >= 1
    assert feasible > 100 and infeasible > 50, (feasible, infeasible)


# ---------------------------------------------------------------------------------------------- order and Nm


def test_large_memory_gpu_goes_first() -> None:
    profile = make_profile([1, 1, 1, 1], params=[100] * 4)
    # balanced (2, 2) with nm = 2: stage 0 needs 4 x 200 = 800 B (weights, gradients, 2 stashed versions),
    # stage 1 3 x 200 = 600 B
    gpus_small_first = [("n0:0", "small", 700), ("n0:1", "big", 900)]
    vw = best_order_and_nm(
        {"small": profile, "big": profile}, gpus_small_first, lambda a, b: FAST, 2, rule=rule_of(True)
    )
    assert vw.gpus == ("n0:1", "n0:0")
    assert vw.split == (2, 2) and vw.nm == 2
    # given in that order, the small GPU first can only take one layer (400 B); 3 layers after it need 900 B
    assert partition([profile, profile], gpus_small_first, [FAST], 2, rule=rule_of(True)).split == (1, 3)


def test_nm_is_the_largest_that_fits_without_slowing_the_split() -> None:
    profile = make_profile([1, 1, 1, 1], params=[100] * 4)
    # stage 0 of (2, 2) with nm in flight and nm stashed versions: (nm + 2) x 200 B
    two = [("n0:0", "t", 1000), ("n0:1", "t", 10**6)]
    vw = best_order_and_nm({"t": profile}, two, lambda a, b: FAST, 8, rule=rule_of(True))
    assert (vw.nm, vw.split) == (3, (2, 2))
    # nm = 5 fits only as (1, 3): 7 x 100 = 700 B on stage 0, but at 3 s instead of 2 s, so nm stays 3
    assert partition([profile, profile], two, [FAST], 5, rule=rule_of(True)).split == (1, 3)


def test_nm_below_k_only_when_nothing_else_fits() -> None:
    profile = make_profile([1, 1], params=[100, 100])
    # nm = 2 puts 4 x 100 B on stage 0 even with one layer (2 stashed versions); 350 B fits only nm = 1
    vw = best_order_and_nm(
        {"t": profile}, [("n0:0", "t", 350), ("n0:1", "t", 350)], lambda a, b: FAST, 4, rule=rule_of(True)
    )
    assert (vw.nm, vw.split) == (1, (1, 1))
    assert minibatch_time_s(vw) == pytest.approx(2.0)  # nothing overlaps: both stages in turn


def test_best_order_error_when_no_order_fits() -> None:
    profile = make_profile([1, 1], params=[100, 100])
    with pytest.raises(
        HetpipeError,
        match=r"needs 200 B for layer .* but has 150 B usable.*\n  lower batch_size "
        r"or add GPUs to the VW",
    ):
        best_order_and_nm(
            {"t": profile},
            [("n0:0", "t", 150), ("n1:0", "t", 150)],
            lambda a, b: FAST,
            4,
            rule=rule_of(False),
        )
    with pytest.raises(UsageError, match="no profile for GPU type"):
        best_order_and_nm({"t": profile}, [("n0:0", "u", 150)], lambda a, b: FAST, 4)


def best_over_orders(
    by_type: dict[str, ModelProfile],
    devices: list[tuple[str, str, int]],
    link: Callable[[str, str], float],
    nm: int,
    stash: bool,
) -> float:
    """The least minibatch_time_s over every permutation of `devices` at this Nm (inf when none fits)."""
    best = math.inf
    for order in itertools.permutations(devices):
        links = [link(a[0], b[0]) for a, b in itertools.pairwise(order)]
        try:
            vw = partition([by_type[t] for _, t, _ in order], order, links, nm, rule=rule_of(stash))
        except HetpipeError:
            continue
        best = min(best, minibatch_time_s(vw))
    return best


def test_best_order_matches_every_order_tried_by_hand() -> None:
    """The chosen (order, Nm) is as fast (minibatch_time_s) as the best of every order at every Nm."""
    rng = random.Random(7)
    checked = 0
    for _ in range(30):
        profiles, devices, links, _, stash = random_instance(rng)
        k = len(devices)
        if k == 4 and rng.random() < 0.8:  # 24 orders x 5 Nm, simulated below k: keep a few
            continue
        by_type = {p.gpu_type: p for p in profiles}
        rate = {frozenset((devices[j][0], devices[j + 1][0])): links[j] for j in range(k - 1)}

        def link(a: str, b: str, rate: dict = rate) -> float:
            return rate.get(frozenset((a, b)), 1e-5)

        try:
            vw = best_order_and_nm(by_type, devices, link, k + 1, rule=rule_of(stash))
        except HetpipeError:
            assert best_over_orders(by_type, devices, link, 1, stash) == math.inf
            continue
        chosen = minibatch_time_s(vw)
        by_nm = {nm: best_over_orders(by_type, devices, link, nm, stash) for nm in range(1, k + 2)}
        # no order and no Nm does better, and the chosen Nm is as fast as the best order at that Nm
        assert all(chosen <= by_nm[nm] * (1 + 1e-9) for nm in by_nm)
        assert chosen == pytest.approx(by_nm[vw.nm], rel=1e-9, abs=1e-12)
        if by_nm[k + 1] == chosen:
            assert vw.nm == k + 1  # the largest Nm when it costs nothing
        checked += 1
    assert checked > 15, checked


def test_too_many_orders_falls_back_to_large_memory_first() -> None:
    profile = make_profile([1.0] * 8, params=[10] * 8)
    devices = [(f"n{j % 2}:{j}", f"type{j}", 1000 + 100 * j) for j in range(8)]  # 8! orders
    by_type = {f"type{j}": profile for j in range(8)}
    vw = best_order_and_nm(by_type, devices, lambda a, b: FAST, 8, max_orders=100)
    assert [s.memory_limit_bytes for s in vw.stages] == sorted((m for _, _, m in devices), reverse=True)
    assert (vw.split, vw.nm) == ((1,) * 8, 8)


def test_minibatch_time_below_k_follows_the_schedule() -> None:
    """k = 4, F = 1, B = 2 everywhere: Nm = 2 gives 1/0.111 = 9 per minibatch
    (docs/schedules.md#unit-time-figures), Nm >= 4 gives 3."""
    stages = tuple(StagePlan(f"n0:{j}", "t", j, j + 1, 1.0, 2.0, 0.0, 0.0, 0, 1) for j in range(4))
    assert minibatch_time_s(VwPlan(stages, 2, 0)) == pytest.approx(9.0)
    assert minibatch_time_s(VwPlan(stages, 4, 0)) == pytest.approx(3.0)
    assert minibatch_time_s(VwPlan(stages, 6, 0)) == pytest.approx(3.0)


def test_network_link_gbps() -> None:
    link = NetworkConfig(intra_node_gbps=100.0, inter_node_gbps=56.0).link_gbps
    assert link("n0:0", "n0:3") == 100.0
    assert link("n0:0", "n1:0") == 56.0


# ---------------------------------------------------------------------------------------------- ResNet-152


PAPER_TYPES = {"titan-rtx": (16.3, 24), "titan-v": (14.9, 12), "rtx-2060": (6.5, 6), "p4000": (5.3, 8)}


def resnet152_profile(batch: int = 32) -> ModelProfile:
    """ResNet-152 at 224 px: real layer count, parameter sizes (meta build) and output shapes (meta
    forward); made-up times proportional to parameters and activations."""
    spec = get_model("resnet152")
    counts = param_counts(spec)
    x = torch.empty((batch, *spec.input_shape), device="meta")
    layers = []
    for i, count in enumerate(counts):
        x = spec.build_layer(i, "meta")(x)
        out = x.numel() * 4
        forward = 2e-12 * count * batch + 2e-11 * out
        layers.append(
            LayerProfile(
                spec.layer_names[i], forward, 2 * forward, 4 * count, 4 * count, out, 3 * out, 2 * out
            )
        )
    return ModelProfile(
        "resnet152",
        batch,
        "titan-rtx",
        "float32",
        torch.__version__,
        batch * 3 * 224 * 224 * 4,
        tuple(layers),
    )


def test_resnet152_partitions_quickly() -> None:
    """Not a timing assertion: prints how long ResNet-152 takes to partition (run with -s to see)."""
    base = resnet152_profile()
    assert base.num_layers == 52
    profiles = {name: base.scaled(name, 16.3 / speed) for name, (speed, _) in PAPER_TYPES.items()}
    ed = [(f"n{j}:0", name, gib * 2**30) for j, (name, (_, gib)) in enumerate(PAPER_TYPES.items())]
    links = NetworkConfig(intra_node_gbps=100.0, inter_node_gbps=56.0).link_gbps

    start = time.perf_counter()
    vw = partition([profiles[t] for _, t, _ in ed], ed, [56.0] * 3, 4)
    one = time.perf_counter() - start

    start = time.perf_counter()
    best = best_order_and_nm(profiles, ed, links, 8)
    ordered = time.perf_counter() - start

    start = time.perf_counter()
    fits = {}
    for name, (_, gib) in PAPER_TYPES.items():  # NP: one node of 4 GPUs of one type each
        try:
            fits[name] = best_order_and_nm(
                profiles, [(f"{name}:{i}", name, gib * 2**30) for i in range(4)], links, 8
            ).nm
        except HetpipeError as exc:
            fits[name] = str(exc).splitlines()[-1]
    homogeneous = time.perf_counter() - start

    print(
        f"\nResNet-152 (52 layers), 4 GPUs: partition {one * 1e3:.1f} ms; best_order_and_nm over 24 orders x "
        f"nm 1..8 {ordered * 1e3:.1f} ms; 4 homogeneous VWs {homogeneous * 1e3:.1f} ms"
    )
    print(f"  one order nm=4: split {vw.split}, bottleneck {vw.bottleneck_s * 1e3:.1f} ms")
    print(
        f"  best: {best.gpus} nm={best.nm} split {best.split} "
        f"bottleneck {best.bottleneck_s * 1e3:.1f} ms, memory "
        f"{[round(s.memory_bytes / 2**30, 2) for s in best.stages]} GiB"
    )
    print(f"  NP VWs: {fits}")
    assert sum(best.split) == 52


# ---------------------------------------------------------------------------------------------- the Nm search


def test_a_stages_memory_never_falls_as_nm_grows() -> None:
    """What _filled's bisection over Nm stands on: under every schedule, each count a stage keeps per
    minibatch or per copy is non-decreasing in Nm (so a split that fits at Nm fits at every smaller Nm)."""
    from hetpipe.core.pipeline.schedule import SCHEDULES

    for name in SCHEDULES.names():
        for stash, recompute, staleness in itertools.product((False, True), (False, True), (0, 2)):
            rule = MemoryRule(schedule=name, weight_stashing=stash, recompute=recompute, staleness=staleness)
            for k in range(1, 6):
                for j in range(k):
                    counts = [
                        (x.in_flight, x.saved, x.stashed, x.update_sums, nm)
                        for nm in range(1, 2 * k + 3)
                        for x in [rule.with_nm(nm).keeping(j, k)]
                    ]
                    for small, large in itertools.pairwise(counts):
                        assert all(a <= b for a, b in zip(small, large, strict=True)), (
                            name,
                            k,
                            j,
                            small,
                            large,
                        )


def test_best_order_and_nm_is_the_best_of_every_order_and_nm_under_every_schedule() -> None:
    """Its bounds and bisection skip work, never a winner: under each schedule the chosen VW's
    minibatch_time_s equals the least over every order and every Nm of the split `partition` gives there, and
    no larger Nm in its order is as fast."""
    from hetpipe.core.pipeline.schedule import SCHEDULES

    rng = random.Random(11)
    checked = 0
    for _ in range(40):
        profiles, devices, links, _, stash = random_instance(rng)
        k = len(devices)
        if k == 4:  # 24 orders x 6 Nm x every schedule, simulated: keep k <= 3
            continue
        by_type = {p.gpu_type: p for p in profiles}
        rate = {frozenset((devices[j][0], devices[j + 1][0])): links[j] for j in range(k - 1)}

        def link(a: str, b: str, rate: dict = rate) -> float:
            return rate.get(frozenset((a, b)), 1e-5)

        for name in SCHEDULES.names():
            rule = MemoryRule(schedule=name, weight_stashing=stash, ps=False)
            times: dict[tuple[tuple, int], float] = {}
            for order in itertools.permutations(devices):
                hops = [link(a[0], b[0]) for a, b in itertools.pairwise(order)]
                for nm in range(1, k + 3):
                    try:
                        vw = partition([by_type[t] for _, t, _ in order], order, hops, nm, rule=rule)
                    except HetpipeError:
                        continue
                    times[(order, nm)] = minibatch_time_s(vw, name)
            try:
                chosen = best_order_and_nm(by_type, devices, link, k + 2, rule=rule)
            except HetpipeError:
                assert not times, name
                continue
            time_s = minibatch_time_s(chosen, name)
            assert time_s == pytest.approx(min(times.values()), rel=1e-9, abs=1e-12), name
            order = tuple((s.gpu, s.gpu_type, s.memory_limit_bytes) for s in chosen.stages)
            larger = [t for (o, nm), t in times.items() if o == order and nm > chosen.nm]
            assert all(t > time_s for t in larger), (name, chosen.nm, time_s, larger)
            checked += 1
    assert checked > 60, checked

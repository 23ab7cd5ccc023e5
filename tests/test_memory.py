"""The memory model (hetpipe/core/planning/memory.py): what each schedule keeps, against its action lists and
a timed run, and literal sums of the terms."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hetpipe.core.config.files import default_config_path, load_config
from hetpipe.core.errors import UsageError
from hetpipe.core.pipeline.schedule import BACKWARD, FORWARD, SCHEDULES, simulate, wsp_schedule
from hetpipe.core.planning.memory import (
    PLAIN,
    MemoryRule,
    format_bytes,
    ps_shard_bytes,
    stage_memory,
    stage_memory_terms,
)
from hetpipe.core.planning.profile import LayerProfile


def layer(
    params: int = 0, optimizer: int = 0, output: int = 0, saved: int = 0, working: int = 0
) -> LayerProfile:
    return LayerProfile("l", 1.0, 2.0, params, optimizer, output, saved, working)


@pytest.mark.parametrize(
    ("stage", "k", "nm", "expected"),
    [
        (0, 1, 1, 1),
        (0, 4, 4, 4),
        (1, 4, 4, 3),
        (3, 4, 4, 1),
        (4, 8, 4, 1),
        (7, 8, 2, 1),
        (2, 8, 8, 6),
    ],
)
def test_wsp_in_flight_is_nm_minus_stage(stage: int, k: int, nm: int, expected: int) -> None:
    keep = MemoryRule(nm=nm).keeping(stage, k)
    assert (
        keep.in_flight == keep.saved == keep.stashed == expected
    )  # one stashed version per minibatch in flight


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("nm", [1, 2, 3, 4, 6])
def test_in_flight_and_weight_versions_match_the_wsp_lists(k: int, nm: int) -> None:
    """Walk each stage's action list by hand: most minibatches between F and B, and most distinct weight
    versions those minibatches ran on (a version ends at each update)."""
    schedule = wsp_schedule(k, nm, 4, 0)
    for j, actions in enumerate(schedule.stages):
        version, used, most_flight, most_versions = 0, {}, 0, 0
        for action in actions:
            if action.kind == FORWARD:
                used[action.index] = version
            elif action.kind == BACKWARD:
                del used[action.index]
            elif action.kind == "U":
                version += 1
            most_flight = max(most_flight, len(used))
            most_versions = max(most_versions, len(set(used.values())))
        keep = MemoryRule(nm=nm).keeping(j, k)
        assert (most_flight, most_versions) == (keep.in_flight, keep.stashed)


@pytest.mark.parametrize(("k", "nm"), [(4, 4), (4, 2), (3, 5), (2, 1)])
def test_in_flight_matches_a_timed_simulation(k: int, nm: int) -> None:
    """Same count from the simulated timeline with unequal stage times (F started, B not finished)."""
    timeline = simulate(wsp_schedule(k, nm, 5, 5), [1.0, 3.0, 0.5, 2.0][:k], [2.0, 1.0, 4.0, 0.7][:k])
    for j in range(k):
        changes = sorted(
            [(e.start, 1) for e in timeline.events if e.stage == j and e.action.kind == FORWARD]
            + [(e.end, -1) for e in timeline.events if e.stage == j and e.action.kind == BACKWARD]
        )
        count = most = 0
        for _, delta in changes:  # at equal times -1 sorts first: a B ending frees its slot for an F starting
            count += delta
            most = max(most, count)
        assert most == MemoryRule(nm=nm).keeping(j, k).in_flight


def test_what_each_schedule_keeps() -> None:
    """Stage 0 of 4 at Nm 4, D 1: wsp stashes a version per minibatch; 2BW two (and one more when a rebase
    falls between); the flushing schedules keep no stash, gpipe all Nm minibatches' activations, or one with
    recompute."""

    def keep(schedule: str, **kw):
        return MemoryRule(nm=4, schedule=schedule, staleness=1, **kw).keeping(0, 4)

    assert keep("wsp") == keep("wsp")
    assert (
        keep("wsp").stashed,
        keep("pipedream-2bw").stashed,
        keep("1f1b-flush").stashed,
        keep("gpipe").stashed,
    ) == (4, 3, 0, 0)
    assert keep("pipedream-2bw", pulls=False).stashed == 3  # the lists still carry the gates
    assert (keep("gpipe").in_flight, keep("gpipe").saved, keep("gpipe", recompute=True).saved) == (4, 4, 1)
    assert keep("wsp", weight_stashing=False).stashed == 0 and keep("wsp", weight_stashing=False).saved == 1
    assert keep("wsp").update_sums == 3 and keep("wsp", pulls=False).update_sums == 2  # D + 2 with pulls
    # pushed waves' sums in host memory: the one in progress and one on its way back, at any D
    assert [MemoryRule(staleness=d, host_sums=True).keeping(0, 1).update_sums for d in (0, 1, 4)] == [2, 2, 2]
    assert [MemoryRule(staleness=d).keeping(0, 1).update_sums for d in (0, 1, 4)] == [2, 3, 6]
    server = keep("wsp", local_updates=False)
    assert not server.optimizer and not server.baseline
    assert set(SCHEDULES) == {"wsp", "pipedream", "pipedream-2bw", "1f1b-flush", "gpipe"}


def test_pipedream_keeps_what_the_pipes_depth_needs_whatever_the_wave() -> None:
    """wsp keeps Nm minibatches at stage 0 (each with its stashed version); pipedream at most k, so a
    one-stage VW keeps one minibatch at any Nm."""

    def keep(schedule: str, nm: int, k: int):
        return MemoryRule(nm=nm, schedule=schedule, staleness=1).keeping(0, k)

    assert keep("pipedream", 4, 4) == keep("wsp", 4, 4)
    assert (keep("wsp", 8, 4).stashed, keep("pipedream", 8, 4).stashed) == (8, 4)
    assert (
        keep("wsp", 8, 1).in_flight,
        keep("pipedream", 8, 1).in_flight,
        keep("pipedream", 8, 1).stashed,
    ) == (8, 1, 1)


def test_stage_memory_literal_sum() -> None:
    layers = [
        layer(params=100, optimizer=100, output=10, saved=30, working=7),
        layer(params=50, optimizer=50, output=20, saved=5, working=40),
    ]
    # stage 1 of 4 with wsp, nm=4, D=0: 3 in flight, 3 stashed copies, a baseline, 2 update sums
    terms = stage_memory_terms(layers, 1, 4, MemoryRule(nm=4), input_bytes=8)
    assert terms.weights == terms.gradients == terms.optimizer == terms.baseline == 150
    assert terms.stashed == 3 * 150
    assert terms.update_sums == 2 * 150
    assert terms.activations == 3 * 35
    assert terms.inputs == 3 * 8
    assert terms.outputs == 3 * 20  # kept as the roots of their backwards
    assert (
        terms.in_transit == 20 + 5 * 8
    )  # the output gradient received, the input gradients in the P2P window
    assert terms.working == 40
    total = 150 * 9 + 105 + 24 + 60 + 60 + 40
    assert stage_memory(layers, 1, 4, MemoryRule(nm=4), input_bytes=8) == total == terms.total
    # a plain replica: weights, gradients, optimizer state, one minibatch
    assert stage_memory(layers, 0, 1, PLAIN, input_bytes=8) == 150 * 3 + 35 + 8 + 40


def test_stage_memory_describe_names_the_terms() -> None:
    text = stage_memory_terms(
        [layer(params=2**30, saved=2**20)], 0, 2, MemoryRule(nm=2, pulls=False), input_bytes=0
    ).describe()
    assert text.startswith(
        "weights 1.00 GiB + gradients 1.00 GiB + stashed weights 2.00 GiB + update baseline"
    )
    assert "saved activations 2.00 MiB" in text and text.endswith("= 7.00 GiB")


def test_stage_memory_rejects_bad_input() -> None:
    with pytest.raises(UsageError, match="at least one layer"):
        stage_memory([], 0, 1, MemoryRule(), input_bytes=0)
    with pytest.raises(UsageError, match="nm >= 1"):
        stage_memory([layer()], 0, 1, MemoryRule(nm=0), input_bytes=0)
    with pytest.raises(UsageError, match="input_bytes"):
        stage_memory([layer()], 0, 1, MemoryRule(), input_bytes=-1)


def test_ps_shard_holds_w0_and_the_bounded_versions_and_sums() -> None:
    assert ps_shard_bytes(1000, 2, 0, "exact") == 500 * (1 + 2 + 2)
    assert ps_shard_bytes(1000, 1, 3, "exact") == 1000 * (1 + 5 + 5)
    assert ps_shard_bytes(1000, 1, 3, "latest") == 2000


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(7.1 * 2**30) == "7.10 GiB"


def test_a_cuda_stage_counts_the_flat_device_copy_of_its_push() -> None:
    layers = [
        layer(params=100, optimizer=100, output=10, saved=30, working=7),
        layer(params=50, optimizer=50, output=20, saved=5, working=40),
    ]
    cpu = stage_memory_terms(layers, 1, 4, MemoryRule(nm=4), input_bytes=8)
    cuda = stage_memory_terms(layers, 1, 4, MemoryRule(nm=4, staged_push=True), input_bytes=8)
    assert cpu.push_staging == 0 and cuda.push_staging == 150 and cuda.total == cpu.total + 150
    assert "push staging 150 B" in cuda.describe() and "push staging" not in cpu.describe()
    no_ps = MemoryRule(nm=4, staged_push=True, ps=False)  # nothing pushed, nothing staged
    assert stage_memory_terms(layers, 1, 4, no_ps, input_bytes=8).push_staging == 0


def test_memory_rule_of_a_config_stages_pushes_unless_its_gpus_are_emulated_on_the_cpu() -> None:
    config = load_config(default_config_path())
    assert config.emulation.enabled and not MemoryRule.of(config, 2).staged_push
    real = replace(config, emulation=replace(config.emulation, enabled=False))
    on_cuda = replace(config, emulation=replace(config.emulation, device="cuda"))
    assert MemoryRule.of(real, 2).staged_push and MemoryRule.of(on_cuda, 2).staged_push


def test_memory_rule_of_a_config_keeps_pushed_sums_off_the_gpu_at_every_d() -> None:
    """Emulated or real, a run's stages keep the sums of pushed waves in host memory (a CUDA stage at D >= 1
    moves them there: tests/test_update_sums.py), so D adds nothing to what a GPU holds for them."""
    config = load_config(default_config_path())
    real = replace(config, emulation=replace(config.emulation, enabled=False))
    for c in (config, real):
        rule = MemoryRule.of(c, 2)
        assert rule.host_sums and rule.pulls
        assert [replace(rule, staleness=d).keeping(0, 1).update_sums for d in (0, 1, 3)] == [2, 2, 2]

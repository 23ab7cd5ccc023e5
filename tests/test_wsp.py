"""Tests of hetpipe.core.wsp.state: the WSP rules of docs/wsp.md on a ledger where each (vw, stage, wave) adds
1.0."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.core.protocol import wire
from hetpipe.core.wsp.aggregation import make_aggregation
from hetpipe.core.wsp.clock import first_pulled_wave, gate_version, pending_bound
from hetpipe.core.wsp.state import ShardState, WspError


def ledger_key(stage: int) -> str:
    return f"s{stage}"


def ledger_delta(num_vws: int, num_waves: int, vw: int, wave: int) -> np.ndarray:
    d = np.zeros((num_vws, num_waves), dtype=np.float32)
    d[vw, wave] = 1.0
    return d


def expected_weights(num_vws: int, num_waves: int, through: int) -> np.ndarray:
    """W_through on the ledger: every VW's slots of waves < through hold exactly 1.0."""
    w = np.zeros((num_vws, num_waves), dtype=np.float32)
    w[:, :through] = 1.0
    return w


def make_shard(num_vws: int, num_stages: int, num_waves: int, staleness: int, mode: str) -> ShardState:
    shard = ShardState(staleness, mode)
    for vw in range(num_vws):
        for stage in range(num_stages):
            init = {ledger_key(stage): np.zeros((num_vws, num_waves), dtype=np.float32)}
            shard.register(vw, stage, num_vws, num_stages, init, num_waves=num_waves)
    return shard


def push(shard: ShardState, vw: int, stage: int, wave: int, num_vws: int, num_waves: int):
    return shard.push(vw, stage, wave, {ledger_key(stage): ledger_delta(num_vws, num_waves, vw, wave)})


# ---- literal cases ------------------------------------------------------------------------------------


def test_gate_version_and_first_pull():
    assert [gate_version(c, 0) for c in range(4)] == [-1, 0, 1, 2]
    assert gate_version(5, 2) == 2
    assert first_pulled_wave(0) == 2 and first_pulled_wave(3) == 5


def test_clock_needs_every_stage_of_a_vw():
    shard = make_shard(num_vws=2, num_stages=2, num_waves=3, staleness=0, mode="exact")
    push(shard, 0, 0, 0, 2, 3)
    assert shard.c_local(0) == 0
    push(shard, 0, 1, 0, 2, 3)
    assert shard.c_local(0) == 1 and shard.c_global == 0
    push(shard, 1, 1, 0, 2, 3)
    r = push(shard, 1, 0, 0, 2, 3)
    assert r.clock_advanced and r.c_global == 1 and shard.c_global == 1


def test_gate_d0_waits_for_wave_c_minus_2():
    shard = make_shard(num_vws=2, num_stages=1, num_waves=4, staleness=0, mode="exact")
    assert shard.gate_open(1)  # c - D - 1 = 0: W_0 is the initial model
    assert not shard.gate_open(2)
    push(shard, 0, 0, 0, 2, 4)
    assert not shard.gate_open(2)
    push(shard, 1, 0, 0, 2, 4)
    assert shard.gate_open(2) and not shard.gate_open(3)


def test_duplicate_push_counts_once():
    shard = make_shard(num_vws=1, num_stages=1, num_waves=2, staleness=0, mode="latest")
    assert push(shard, 0, 0, 0, 1, 2).applied
    assert not push(shard, 0, 0, 0, 1, 2).applied
    np.testing.assert_array_equal(shard.read().tensors["s0"], expected_weights(1, 2, 1))


def test_out_of_order_push_is_refused():
    shard = make_shard(num_vws=1, num_stages=1, num_waves=3, staleness=0, mode="exact")
    with pytest.raises(WspError) as err:
        push(shard, 0, 0, 1, 1, 3)
    assert err.value.code == "out_of_order" and "before wave 0" in str(err.value)


def test_push_with_wrong_keys_or_shape_changes_nothing():
    shard = make_shard(num_vws=1, num_stages=1, num_waves=2, staleness=0, mode="latest")
    for bad in ({"s0": np.zeros((1, 3), np.float32)}, {"s9": np.zeros((1, 2), np.float32)}, {}):
        with pytest.raises(WspError) as err:
            shard.push(0, 0, 0, bad)
        assert err.value.code == "bad_message"
    with pytest.raises(WspError):
        shard.push(0, 0, 0, {"s0": np.zeros((1, 2), np.float64)})
    assert shard.pushed[(0, 0)] == 0
    np.testing.assert_array_equal(shard.read().tensors["s0"], np.zeros((1, 2), np.float32))


def test_registration_conflicts():
    shard = ShardState(0, "exact")
    shard.register(0, 0, 2, 2, {"a": np.ones(3, np.float32)})
    cases = [
        (lambda: shard.register(0, 1, 3, 2, {"b": np.ones(1, np.float32)}), "conflict", "3 VWs"),
        (lambda: shard.register(0, 1, 2, 3, {"b": np.ones(1, np.float32)}), "conflict", "stages"),
        (
            lambda: shard.register(0, 1, 2, 2, {"a": np.ones(3, np.float32)}),
            "conflict",
            "owned by its stage 0",
        ),
        (lambda: shard.register(1, 0, 2, 2, {"a": np.ones(4, np.float32)}), "conflict", "shape"),
        (lambda: shard.register(2, 0, 2, 2, {"c": np.ones(1, np.float32)}), "bad_message", "out of range"),
        (lambda: shard.register(0, 0, 2, 2, {"z": np.ones(3, np.float32)}), "conflict", "other keys"),
        (lambda: shard.push(1, 1, 0, {}), "not_registered", "not registered"),
    ]
    for call, code, text in cases:
        with pytest.raises(WspError) as err:
            call()
        assert err.value.code == code and text in str(err.value)


def test_first_registration_sets_w0_for_everyone():
    shard = ShardState(0, "exact")
    got0 = shard.register(0, 0, 2, 1, {"a": np.full(2, 3.0, np.float32)})
    got1 = shard.register(1, 0, 2, 1, {"a": np.full(2, 7.0, np.float32)})
    np.testing.assert_array_equal(got0["a"], [3.0, 3.0])
    np.testing.assert_array_equal(got1["a"], [3.0, 3.0])


def test_exact_sum_is_in_vw_order_whatever_the_arrival_order():
    """Float addition is not associative: S_t must be ((Δ0 + Δ1) + Δ2) for any arrival order."""
    rng = np.random.default_rng(0)
    deltas = [(rng.standard_normal(1000) * 10.0 ** rng.integers(-4, 4)).astype(np.float32) for _ in range(3)]
    w0 = rng.standard_normal(1000).astype(np.float32)
    reference = w0 + ((deltas[0] + deltas[1]) + deltas[2])
    results = []
    for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        shard = ShardState(0, "exact")
        for vw in range(3):
            shard.register(vw, 0, 3, 1, {"k": w0})
        for vw in order:
            shard.push(vw, 0, 0, {"k": deltas[vw]})
        results.append(shard.read().tensors["k"])
    for r in results:
        assert np.array_equal(r, reference)


def test_lent_weights_are_copied_before_they_change():
    shard = make_shard(num_vws=1, num_stages=1, num_waves=4, staleness=0, mode="latest")
    sent = shard.read().tensors["s0"]
    shard.lend("s0", lambda: False)  # a zero-copy send still holds the buffer
    push(shard, 0, 0, 0, 1, 4)
    assert sent.sum() == 0.0 and shard.read().tensors["s0"].sum() == 1.0
    now = shard.read().tensors["s0"]
    shard.lend("s0", lambda: True)  # send finished: update in place
    push(shard, 0, 0, 1, 1, 4)
    assert now.sum() == 2.0


def test_stale_exact_pull_is_refused():
    shard = make_shard(num_vws=1, num_stages=1, num_waves=6, staleness=0, mode="exact")
    for wave in range(4):
        push(shard, 0, 0, wave, 1, 6)
        if wave + 2 < 6:
            shard.pull(0, 0, wave + 2)
    with pytest.raises(WspError) as err:
        shard.pull(0, 0, 2)  # W_1 was folded away long ago
    assert err.value.code == "stale"


def test_snapshot_round_trip_keeps_pending_sums_and_held_updates():
    shard = make_shard(num_vws=3, num_stages=1, num_waves=4, staleness=1, mode="exact")
    push(shard, 2, 0, 0, 3, 4)  # held: VW 0 has not pushed wave 0 yet
    push(shard, 0, 0, 0, 3, 4)
    push(shard, 0, 0, 1, 3, 4)
    meta, arrays = shard.to_state()
    copy = ShardState.from_state(meta, arrays)
    assert copy.status() == shard.status()
    for s in (shard, copy):
        push(s, 1, 0, 0, 3, 4)
        push(s, 1, 0, 1, 3, 4)
        push(s, 2, 0, 1, 3, 4)
    np.testing.assert_array_equal(copy.read().tensors["s0"], shard.read().tensors["s0"])
    np.testing.assert_array_equal(copy.read().tensors["s0"], expected_weights(3, 4, 2))


# ---- properties over random push orders and speeds ----------------------------------------------------


def stage_program(num_waves: int, staleness: int, rng: random.Random) -> list[tuple[str, int]]:
    """PUSH c for every wave, WAIT c (c >= D+2) somewhere after PUSH c-2 and before PUSH c, as the wsp
    schedule places it (before or after PUSH c-1 depending on Nm and the stage)."""
    program: list[tuple[str, int]] = []
    for c in range(num_waves):
        if c >= first_pulled_wave(staleness):
            program.insert(len(program) - (1 if rng.random() < 0.5 else 0), ("WAIT", c))
        program.append(("PUSH", c))
    return program


@settings(max_examples=150, deadline=None)
@given(
    num_vws=st.integers(1, 3),
    num_stages=st.integers(1, 3),
    num_waves=st.integers(1, 7),
    staleness=st.integers(0, 3),
    mode=st.sampled_from(["exact", "latest"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_wsp_invariants_over_random_orders(num_vws, num_stages, num_waves, staleness, mode, seed):
    rng = random.Random(seed)
    speeds = [rng.choice([1, 1, 2, 4, 8]) for _ in range(num_vws)]
    shard = make_shard(num_vws, num_stages, num_waves, staleness, mode)
    programs = {
        (v, j): stage_program(num_waves, staleness, rng) for v in range(num_vws) for j in range(num_stages)
    }
    pos = dict.fromkeys(programs, 0)
    pushed = dict.fromkeys(programs, 0)  # the test's own ledger, independent of ShardState

    def completed(vw: int) -> int:
        return min(pushed[(vw, j)] for j in range(num_stages))

    while any(pos[s] < len(programs[s]) for s in programs):
        if mode == "exact":  # memory stays within the spec's bound at every step
            versions, sums = shard.held_waves()
            most_versions, most_sums = pending_bound(staleness)
            assert versions <= most_versions and sums <= most_sums, (versions, sums, staleness)
        runnable = []
        for sid, program in programs.items():
            if pos[sid] == len(program):
                continue
            kind, wave = program[pos[sid]]
            if kind == "PUSH" or shard.gate_open(wave):
                runnable.append(sid)
        assert runnable, "deadlock: no stage can proceed"
        sid = rng.choices(runnable, weights=[speeds[v] for v, _ in runnable])[0]
        vw, stage = sid
        kind, wave = programs[sid][pos[sid]]
        if kind == "PUSH":
            assert push(shard, vw, stage, wave, num_vws, num_waves).applied
            pushed[sid] += 1
            if rng.random() < 0.3:  # a retried push must count once
                again = rng.randrange(wave + 1)
                assert not push(shard, vw, stage, again, num_vws, num_waves).applied
        else:
            # the bound: nobody starts wave c before every VW completed wave c - D - 2
            assert all(completed(v) >= wave - staleness - 1 for v in range(num_vws))
            result = shard.pull(vw, stage, wave)
            got = result.tensors[ledger_key(stage)]
            need = gate_version(wave, staleness)
            if mode == "exact":
                assert result.version == need and result.own_through == wave - staleness - 2
                np.testing.assert_array_equal(got, expected_weights(num_vws, num_waves, need))
            else:
                assert (got[:, :need] == 1.0).all() and np.isin(got, (0.0, 1.0)).all()
                assert (got[vw, : result.own_through + 1] == 1.0).all()
        pos[sid] += 1
    assert shard.c_global == num_waves
    np.testing.assert_array_equal(shard.read().tensors[ledger_key(0)], np.ones((num_vws, num_waves)))


# ---- bounded memory, aggregation rules, buffers -------------------------------------------------------


@pytest.mark.parametrize("staleness", [0, 3])
def test_one_vw_that_never_pulls_keeps_memory_flat(staleness: int):
    """A single VW skips every gate, yet its waves are built into versions and the old ones dropped."""
    shard = make_shard(num_vws=1, num_stages=2, num_waves=2000, staleness=staleness, mode="exact")
    most_versions, most_sums = pending_bound(staleness)
    for wave in range(2000):
        for stage in (1, 0):
            push(shard, 0, stage, wave, 1, 2000)
        versions, sums = shard.held_waves()
        assert versions <= most_versions and sums <= most_sums
    assert shard.version == 2000 and shard.read().tensors["s0"].sum() == 2000.0


def test_stages_that_never_reach_a_gate_keep_memory_flat():
    """D >= waves - 2: no wave has a gate, so nobody pulls; pushes alone let old versions go."""
    shard = make_shard(num_vws=2, num_stages=1, num_waves=50, staleness=60, mode="exact")
    for wave in range(50):
        for vw in (1, 0):
            push(shard, vw, 0, wave, 2, 50)
    assert shard.held_waves() == (1, 0)


def two_vw_shard(aggregation: str, mode: str = "exact", optimizer: str = "sgd") -> ShardState:
    shard = ShardState(0, mode, make_aggregation(aggregation, optimizer=optimizer, lr=0.5))
    for vw in range(2):
        shard.register(
            vw,
            0,
            2,
            1,
            {"w": np.array([1.0, 2.0], np.float32), "bn": np.zeros(2, np.float32)},
            kinds={"bn": "buffer"},
        )
    return shard


@pytest.mark.parametrize("mode", ["exact", "latest"])
def test_mean_aggregation_divides_by_the_vws_and_buffers_average(mode: str):
    shard = two_vw_shard("mean", mode)
    shard.push(0, 0, 0, {"w": np.array([2.0, 4.0], np.float32), "bn": np.array([1.0, 3.0], np.float32)})
    shard.push(1, 0, 0, {"w": np.array([4.0, 0.0], np.float32), "bn": np.array([3.0, 5.0], np.float32)})
    got = shard.read().tensors
    np.testing.assert_array_equal(got["w"], np.array([1.0 + 3.0, 2.0 + 2.0], np.float32))
    np.testing.assert_array_equal(got["bn"], np.array([2.0, 4.0], np.float32))  # averaged, not summed


def test_server_aggregation_runs_the_optimizer_on_the_mean_gradient():
    shard = two_vw_shard("server", optimizer="momentum")
    w = np.array([1.0, 2.0], np.float32)
    buf = None
    for wave, grads in enumerate([([2.0, 0.0], [0.0, 2.0]), ([1.0, 1.0], [3.0, 3.0])]):
        for vw in (1, 0):
            shard.push(vw, 0, wave, {"w": np.array(grads[vw], np.float32), "bn": np.zeros(2, np.float32)})
        g = (np.array(grads[0], np.float32) + np.array(grads[1], np.float32)) / np.float32(2)
        buf = g if buf is None else np.float32(0.9) * buf + g  # torch.optim.SGD(momentum=0.9)
        w = w - np.float32(0.5) * buf
        np.testing.assert_array_equal(shard.read().tensors["w"], w)


def test_buffer_kind_must_agree_and_be_known():
    shard = ShardState(0, "exact")
    shard.register(0, 0, 2, 1, {"bn": np.zeros(1, np.float32)}, kinds={"bn": "buffer"})
    with pytest.raises(WspError, match="is a buffer, a registration says param"):
        shard.register(1, 0, 2, 1, {"bn": np.zeros(1, np.float32)})
    with pytest.raises(WspError, match="kind 'stats'"):
        shard.register(1, 0, 2, 1, {"bn": np.zeros(1, np.float32)}, kinds={"bn": "stats"})


@pytest.mark.parametrize("mode", ["exact", "latest"])
def test_snapshot_round_trip_with_server_optimizer_and_buffers(mode: str):
    shard = two_vw_shard("server", mode, optimizer="adam")
    shard.push(0, 0, 0, {"w": np.array([1.0, -1.0], np.float32), "bn": np.ones(2, np.float32)})
    shard.push(1, 0, 0, {"w": np.array([0.5, 0.5], np.float32), "bn": np.ones(2, np.float32)})
    shard.push(0, 0, 1, {"w": np.array([0.25, 0.0], np.float32), "bn": np.full(2, 3.0, np.float32)})
    meta, arrays = shard.to_state()
    copy = ShardState.from_state(meta, arrays, make_aggregation("server", optimizer="adam", lr=0.5))
    assert copy.status() == shard.status()
    for s in (shard, copy):
        s.push(1, 0, 1, {"w": np.array([-2.0, 1.0], np.float32), "bn": np.full(2, 5.0, np.float32)})
    for key in ("w", "bn"):
        np.testing.assert_array_equal(copy.read().tensors[key], shard.read().tensors[key])


def test_a_zero_dimensional_buffer_stays_an_array():
    """BatchNorm's num_batches_tracked has no dimensions; its average must still go out as an array."""
    for mode in ("exact", "latest"):
        shard = ShardState(0, mode, make_aggregation("mean"))
        for vw in range(2):
            shard.register(vw, 0, 2, 1, {"n": np.zeros((), np.float32)}, kinds={"n": "buffer"})
        for vw in range(2):
            shard.push(vw, 0, 0, {"n": np.array(3.0 + vw, np.float32)})
        got = shard.read().tensors["n"]
        assert isinstance(got, np.ndarray) and got.shape == () and got == 3.5


def test_finished_sends_are_forgotten_between_pushes():
    """5,000 reads with no push between them kept 5,000 readers (about 2 KB each) until the next write."""
    shard = make_shard(num_vws=1, num_stages=1, num_waves=2, staleness=0, mode="latest")
    for _ in range(5000):
        shard.lend("s0", lambda: True)
    shard.lend("s0", lambda: False)
    assert len(shard.running.lent["s0"]) == 1  # only the send still in flight


# ---- live virtual workers: eviction, rejoin, half waves, cut back for a resume -------------------------


def ledger(shard: ShardState, stage: int) -> np.ndarray:
    return shard.read().tensors[ledger_key(stage)]


@pytest.mark.parametrize("mode", ["exact", "latest"])
def test_an_evicted_vw_leaves_no_half_wave_and_the_others_go_on(mode: str):
    shard = make_shard(num_vws=3, num_stages=2, num_waves=6, staleness=0, mode=mode)
    for wave in range(3):
        for vw in (0, 1):
            for stage in (1, 0):
                push(shard, vw, stage, wave, 3, 6)
    push(shard, 2, 1, 0, 3, 6)
    push(shard, 2, 0, 0, 3, 6)
    push(shard, 2, 1, 1, 3, 6)  # stage 1 pushed wave 1, stage 0 never will: a half wave
    assert shard.c_global == 1 and not shard.gate_open(3)
    assert shard.evict(2) == (1, True)
    assert shard.c_global == 3 and shard.gate_open(4) and shard.live_vws() == [0, 1]
    assert shard.gaps() == [[2, 1, -1]]
    for stage in (0, 1):
        got = ledger(shard, stage)
        np.testing.assert_array_equal(got[:2, :3], np.ones((2, 3)))
        np.testing.assert_array_equal(got[2], [1, 0, 0, 0, 0, 0])  # wave 1 of VW 2 counts nowhere
    with pytest.raises(WspError) as err:
        push(shard, 2, 0, 1, 3, 6)
    assert err.value.code == "evicted"
    assert shard.evict(2) == (1, False)  # idempotent


@pytest.mark.parametrize("mode", ["exact", "latest"])
def test_a_half_pushed_wave_is_not_folded_until_its_vw_completes_it(mode: str):
    shard = make_shard(num_vws=1, num_stages=2, num_waves=4, staleness=0, mode=mode)
    push(shard, 0, 1, 0, 1, 4)
    assert ledger(shard, 1).sum() == 0.0  # stage 0 of the VW has not pushed wave 0 yet
    push(shard, 0, 0, 0, 1, 4)
    assert ledger(shard, 1).sum() == 1.0 and ledger(shard, 0).sum() == 1.0


def test_mean_divides_by_the_wave_s_contributors():
    shard = two_vw_shard("mean")
    shard.push(0, 0, 0, {"w": np.array([2.0, 4.0], np.float32), "bn": np.array([1.0, 3.0], np.float32)})
    shard.push(1, 0, 0, {"w": np.array([4.0, 0.0], np.float32), "bn": np.array([3.0, 5.0], np.float32)})
    shard.evict(1)
    shard.push(0, 0, 1, {"w": np.array([2.0, 2.0], np.float32), "bn": np.array([7.0, 7.0], np.float32)})
    got = shard.read().tensors
    np.testing.assert_array_equal(got["w"], np.array([1.0 + 3.0 + 2.0, 2.0 + 2.0 + 2.0], np.float32))
    np.testing.assert_array_equal(got["bn"], np.array([7.0, 7.0], np.float32))


def test_a_rejoined_vw_contributes_from_its_start_wave_and_counts_in_the_gate():
    shard = make_shard(num_vws=2, num_stages=1, num_waves=10, staleness=0, mode="exact")
    push(shard, 0, 0, 0, 2, 10)
    push(shard, 1, 0, 0, 2, 10)
    shard.evict(1)
    for wave in (1, 2):
        push(shard, 0, 0, wave, 2, 10)
    with pytest.raises(WspError) as err:
        shard.rejoin(1, 2)  # VW 0 already pushed wave 2: VW 1's place in its sum is gone
    assert err.value.code == "stale" and "earliest it may is 3" in str(err.value)
    with pytest.raises(WspError) as err:
        shard.register(1, 0, 2, 1, {ledger_key(0): np.zeros((2, 10), np.float32)}, start_wave=0)
    assert err.value.code == "evicted"
    shard.rejoin(1, 4)
    shard.rejoin(1, 4)  # a retried rejoin
    with pytest.raises(WspError, match="starts at wave 0"):
        shard.register(1, 0, 2, 1, {ledger_key(0): np.zeros((2, 10), np.float32)})
    shard.register(1, 0, 2, 1, {ledger_key(0): np.zeros((2, 10), np.float32)}, start_wave=4)
    assert shard.c_local(1) == 4 and shard.c_global == 3 and shard.gaps() == [[1, 1, 4]]
    push(shard, 0, 0, 3, 2, 10)
    push(shard, 1, 0, 4, 2, 10)  # VW 1 ahead: wave 4 waits for VW 0
    assert shard.c_global == 4
    push(shard, 0, 0, 4, 2, 10)
    assert shard.c_global == 5 and shard.pull(1, 0, 6).version == 5
    np.testing.assert_array_equal(ledger(shard, 0)[:, :5], [[1, 1, 1, 1, 1], [1, 0, 0, 0, 1]])


def test_a_shard_cut_back_to_a_clock_equals_one_that_never_saw_the_later_pushes():
    def run(pushes):
        shard = make_shard(num_vws=2, num_stages=1, num_waves=8, staleness=1, mode="exact")
        for vw, wave in pushes:
            push(shard, vw, 0, wave, 2, 8)
        return shard

    base = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
    ahead = run(base + [(0, 3), (1, 2)])  # clock 3 reached with VW 0 one wave ahead
    meta, arrays = ahead.to_state()
    cut = ShardState.from_state(meta, arrays, cut=3)
    plain = run(base + [(1, 2)])
    for shard in (cut, plain):
        assert shard.c_global == 3 and shard.pushed == {(0, 0): 3, (1, 0): 3} and 1 in shard.versions
        for vw, wave in [(1, 3), (0, 3), (0, 4), (1, 4)]:
            push(shard, vw, 0, wave, 2, 8)
    np.testing.assert_array_equal(cut.pull(0, 0, 5).tensors["s0"], plain.pull(0, 0, 5).tensors["s0"])
    np.testing.assert_array_equal(ledger(cut, 0), ledger(plain, 0))
    with pytest.raises(WspError):
        ShardState.from_state(meta, arrays, cut=2)  # the checkpoint of clock 3 is not one of clock 2


def test_snapshot_round_trip_keeps_epochs_and_half_waves():
    for mode in ("exact", "latest"):
        shard = make_shard(num_vws=2, num_stages=2, num_waves=6, staleness=0, mode=mode)
        for vw in (0, 1):
            push(shard, vw, 1, 0, 2, 6)
        push(shard, 1, 0, 0, 2, 6)
        shard.evict(1)
        meta, arrays = shard.to_state()
        copy = ShardState.from_state(meta, arrays)
        assert copy.status() == shard.status() and copy.gaps() == [[1, 1, -1]]
        for s in (shard, copy):
            push(s, 0, 0, 0, 2, 6)
        for stage in (0, 1):
            np.testing.assert_array_equal(ledger(copy, stage), ledger(shard, stage))


@settings(max_examples=150, deadline=None)
@given(
    num_vws=st.integers(2, 3),
    num_stages=st.integers(1, 3),
    staleness=st.integers(0, 2),
    mode=st.sampled_from(["exact", "latest"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_background_snapshot_is_the_moment_it_was_taken(num_vws, num_stages, staleness, mode, seed):
    """A shard's checkpoint writer encodes a detached snapshot while later pushes change the state. Restored
    afterwards (as after a crash) and given again the pushes it lacks (as the clients resend them), it must
    hold every update exactly once: nothing of what came after it may leak into it."""
    num_waves = 6
    rng = random.Random(seed)
    shard = make_shard(num_vws, num_stages, num_waves, staleness, mode)
    next_wave = {(v, j): 0 for v in range(num_vws) for j in range(num_stages)}
    order: list[tuple[int, int, int]] = []
    snapshot_at = rng.randrange(num_vws * num_stages * num_waves)
    snapshot = None
    while True:
        ready = [sid for sid, c in next_wave.items() if c < num_waves and shard.gate_open(c)]
        if not ready:
            break
        if len(order) == snapshot_at:
            snapshot = shard.to_state(detached=True)
        vw, stage = sid = rng.choice(ready)
        push(shard, vw, stage, next_wave[sid], num_vws, num_waves)
        order.append((vw, stage, next_wave[sid]))
        next_wave[sid] += 1
    assert all(c == num_waves for c in next_wave.values()), "deadlock"
    assert snapshot is not None
    restored = ShardState.from_state(*snapshot)
    for vw, stage, wave in order:
        if wave >= restored.pushed[(vw, stage)]:
            push(restored, vw, stage, wave, num_vws, num_waves)
    for stage in range(num_stages):
        np.testing.assert_array_equal(ledger(restored, stage), np.ones((num_vws, num_waves), np.float32))
        np.testing.assert_array_equal(ledger(shard, stage), np.ones((num_vws, num_waves), np.float32))


@settings(max_examples=120, deadline=None)
@given(
    num_vws=st.integers(2, 3),
    num_stages=st.integers(1, 2),
    staleness=st.integers(0, 2),
    mode=st.sampled_from(["exact", "latest"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_evictions_and_rejoins_keep_every_update_exactly_once(num_vws, num_stages, staleness, mode, seed):
    """Random stages push and pull; now and then a VW is evicted (its stages stop where they are) and rejoins
    later at the next wave the shard accepts. Every pull and the final weights hold exactly the updates of the
    complete waves each VW contributed, once."""
    num_waves = 8
    rng = random.Random(seed)
    shard = make_shard(num_vws, num_stages, num_waves, staleness, mode)
    programs = {
        (v, j): stage_program(num_waves, staleness, rng) for v in range(num_vws) for j in range(num_stages)
    }
    pos = dict.fromkeys(programs, 0)
    spans = {v: [[0, None]] for v in range(num_vws)}  # the test's own record of what each VW contributes

    def expected(through: int) -> np.ndarray:
        w = np.zeros((num_vws, num_waves), np.float32)
        for v, vs in spans.items():
            for start, end in vs:
                w[v, start : min(through, num_waves if end is None else end)] = 1.0
        return w

    steps = 0
    while any(pos[s] < len(p) for s, p in programs.items()) and steps < 2000:
        steps += 1
        live = [v for v in range(num_vws) if spans[v][-1][1] is None]
        if mode == "exact":
            versions, sums = shard.held_waves()
            assert versions <= pending_bound(staleness)[0] and sums <= pending_bound(staleness)[1]
        if rng.random() < 0.03 and len(live) > 1:
            victim = rng.choice(live)
            boundary, _ = shard.evict(victim)
            assert boundary == min(shard.pushed[(victim, j)] for j in range(num_stages))
            spans[victim][-1][1] = boundary
            continue
        gone = [v for v in range(num_vws) if spans[v][-1][1] is not None]
        if gone and rng.random() < 0.05:
            back = rng.choice(gone)
            start = shard.c_global + staleness + 2
            if start < num_waves:
                shard.rejoin(back, start)
                spans[back].append([start, None])
                for j in range(num_stages):
                    program = stage_program(num_waves, staleness, rng)
                    programs[(back, j)] = [a for a in program if a[1] >= start]
                    pos[(back, j)] = 0
            continue
        runnable = []
        for sid, program in programs.items():
            if spans[sid[0]][-1][1] is not None or pos[sid] == len(program):
                continue
            kind, wave = program[pos[sid]]
            if kind == "PUSH" or shard.gate_open(wave):
                runnable.append(sid)
        if not runnable:
            assert all(pos[s] == len(p) or spans[s[0]][-1][1] is not None for s, p in programs.items())
            break
        sid = rng.choice(runnable)
        vw, stage = sid
        kind, wave = programs[sid][pos[sid]]
        if kind == "PUSH":
            assert push(shard, vw, stage, wave, num_vws, num_waves).applied
        else:
            result = shard.pull(vw, stage, wave)
            got = result.tensors[ledger_key(stage)]
            need = gate_version(wave, staleness)
            if mode == "exact":
                np.testing.assert_array_equal(got, expected(need))
            else:
                assert np.isin(got, (0.0, 1.0)).all() and (got[expected(need) == 1.0] == 1.0).all()
        pos[sid] += 1
    final = expected(num_waves) if mode == "latest" else expected(shard.c_global)
    for stage in range(num_stages):
        got = ledger(shard, stage)
        assert np.isin(got, (0.0, 1.0)).all()
        if mode == "exact":
            np.testing.assert_array_equal(got, final)
        else:  # complete waves of every VW are in, nothing of a gap
            for v, vs in spans.items():
                for start, end in vs:
                    assert (got[v, start : shard.c_local(v) if end is None else end] == 1.0).all()
            np.testing.assert_array_equal(got[final == 0.0], 0.0)


@pytest.mark.parametrize("mode", ["exact", "latest"])
@pytest.mark.parametrize("aggregation", ["sum", "mean", "server"])
def test_a_push_folded_straight_from_its_frames_builds_the_same_weights_as_from_arrays(
    aggregation: str, mode: str
):
    """One contributor's sum stays the received frames (several of them here); W + S is added from them."""
    n = 2 * wire.CHUNK_BYTES // 4 + 5
    rng = np.random.default_rng(3)
    w0 = {
        "w": rng.standard_normal(n).astype(np.float32),
        "bn": np.ones(3, np.float32),
        "audit": np.zeros(4, np.float32),
    }
    pushes = [
        {
            "w": rng.standard_normal(n).astype(np.float32),
            "bn": rng.standard_normal(3).astype(np.float32),
            "audit": np.ones(4, np.float32),
        }
        for _ in range(3)
    ]
    fields = {"id": 1, "vw": 0, "stage": 0, "wave": 0, "run": "r"}
    built = []
    for as_frames in (False, True):
        shard = ShardState(0, mode, make_aggregation(aggregation, optimizer="adam", lr=0.1))
        shard.register(0, 0, 1, 1, w0, kinds={"bn": "buffer", "audit": "ledger"})
        for wave, tensors in enumerate(pushes):
            if as_frames:
                tensors = wire.decode([bytes(f) for f in wire.encode("push", fields, tensors)]).tensors
                assert len(tensors["w"].chunks) == 3
            shard.push(0, 0, wave, tensors)
        built.append(shard.read().tensors)
    for key in w0:
        np.testing.assert_array_equal(built[1][key], built[0][key])
    np.testing.assert_array_equal(built[0]["audit"], np.full(4, 3.0, np.float32))

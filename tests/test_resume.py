"""Tests of hetpipe.core.pipeline.resume: the cut a checkpoint takes through every schedule, rejoin lists,
which snapshots to keep, the common wave of a resume."""

from __future__ import annotations

import pytest

from hetpipe.core.pipeline.resume import (
    common_cut,
    cut_position,
    forwarded_before,
    rejoin_actions,
    snapshot_floor,
)
from hetpipe.core.pipeline.schedule import BACKWARD, SCHEDULES, get_schedule, needs, parse_actions


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(
    ("stages", "nm", "staleness"), [(1, 1, 0), (2, 2, 0), (3, 2, 1), (4, 4, 0), (3, 5, 2)]
)
def test_the_cut_after_push_c_minus_1_is_one_only_activations_cross(name, stages, nm, staleness):
    """After its PUSH c-1 every stage has run the backwards of exactly the waves < c, and has forwarded at
    least what the next stage has: no gradient crosses the cut, and the activations that do are the
    sender's forwards in flight (which it runs again on resume)."""
    schedule = get_schedule(name)(stages, nm, 6, staleness)
    for wave in range(1, 6):
        positions = [cut_position(schedule.stages[j], wave) for j in range(stages)]
        for j in range(stages):
            done = {a.index for a in schedule.stages[j][: positions[j]] if a.kind == BACKWARD}
            assert done == set(range(wave * nm)), (name, j, wave)
        for j in range(stages - 1):
            assert forwarded_before(schedule.stages[j], positions[j]) >= forwarded_before(
                schedule.stages[j + 1], positions[j + 1]
            )


def test_cut_position_names_the_action_after_the_push():
    actions = parse_actions("F0 F1 B0 U0 F2 B1 U1 PUSH0 F3 B2 U2 WAIT2 F4 B3 U3 PUSH1")
    assert cut_position(actions, 0) == 0
    assert cut_position(actions, 1) == 8 and str(actions[8]) == "F3"
    assert forwarded_before(actions, 8) == {0, 1, 2}
    with pytest.raises(ValueError):
        cut_position(actions, 3)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_rejoining_vw_runs_the_rest_of_every_list_without_deadlock(name):
    """The stages of a VW that rejoins at wave 5 run what is left of their lists against each other (the
    gates depend on the other VWs, so they are left open here)."""
    schedule = get_schedule(name)(3, 2, 8, 1)
    rest = [rejoin_actions(actions, 5, 2) for actions in schedule.stages]
    assert all(a.index >= (10 if a.kind in ("F", "B", "U") else 5) for actions in rest for a in actions)
    assert str(rest[0][0]) in ("WAIT5", "F10")
    done: list[set] = [set() for _ in rest]
    position = [0] * len(rest)
    while any(position[j] < len(rest[j]) for j in range(len(rest))):
        moved = False
        for j, actions in enumerate(rest):
            while position[j] < len(actions) and all(
                other in done[peer] for peer, other in needs(actions[position[j]], j, len(rest))
            ):
                done[j].add(actions[position[j]])
                position[j] += 1
                moved = True
        assert moved, "deadlock at " + str(
            [str(rest[j][position[j]]) for j in range(len(rest)) if position[j] < len(rest[j])]
        )


def test_snapshot_floor_keeps_what_the_ps_may_still_hold():
    assert snapshot_floor(c_global=9, every=2, keep=3) == 4  # the PS keeps checkpoints 4, 6, 8
    assert snapshot_floor(c_global=3, every=2, keep=3) == 0
    assert snapshot_floor(c_global=10, every=5, keep=1) == 10
    # the PS's checkpoints of clocks 11-13 failed (a full disk): it keeps 8, 9, 10, so do the stages
    assert snapshot_floor(c_global=14, every=1, keep=3) == 12
    assert snapshot_floor(c_global=14, every=1, keep=3, ps_oldest=8) == 8
    assert snapshot_floor(c_global=14, every=1, keep=3, ps_oldest=0) == 0  # none on disk: keep them all
    assert snapshot_floor(c_global=9, every=2, keep=3, ps_oldest=6) == 4  # never above the window


def test_common_cut_is_the_newest_wave_everyone_saved():
    assert common_cut([[2, 4, 6], [4, 6]], [[2, 4, 6, 8], [4, 6]]) == 6
    assert common_cut([[2, 4]], [[6, 8]]) is None
    assert common_cut([[0]], [[0]]) is None  # wave 0 is a fresh start, not a resume

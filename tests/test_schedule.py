"""Tests for hetpipe/schedule.py: literal tables derived by hand from docs/schedules.md and docs/wsp.md#gate,
properties, the validator."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.core.pipeline.schedule import (
    KINDS,
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    StageProfile,
    format_grid,
    format_lists,
    get_schedule,
    own_through_required,
    parse_action,
    parse_actions,
    register_schedule,
    simulate,
    stage_profile,
    steps,
    unstashed_forwards,
    validate,
    validate_lists,
    wsp_schedule,
)

RANGES = dict(num_stages=(1, 6), nm=(1, 8), num_waves=(1, 4), staleness=(0, 3))


def lists(*lines: str) -> tuple[tuple[Action, ...], ...]:
    return tuple(parse_actions(line) for line in lines)


def schedules() -> st.SearchStrategy[Schedule]:
    return st.sampled_from(sorted(SCHEDULES)).flatmap(
        lambda name: st.builds(SCHEDULES[name], *(st.integers(lo, hi) for lo, hi in RANGES.values()))
    )


# --- actions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, kind, index",
    [("F3", "F", 3), ("B0", "B", 0), ("U4", "U", 4), ("PUSH1", "PUSH", 1), ("WAIT12", "WAIT", 12)],
)
def test_parse_action_and_str_round_trip(text: str, kind: str, index: int) -> None:
    action = parse_action(text)
    assert action == Action(kind, index)
    assert str(action) == text


@given(st.sampled_from(KINDS), st.integers(0, 10_000))
def test_str_then_parse_is_identity(kind: str, index: int) -> None:
    assert parse_action(str(Action(kind, index))) == Action(kind, index)


def test_parse_actions_splits_on_whitespace() -> None:
    assert parse_actions("F0 F1  B0 U0\nPUSH0") == (
        Action("F", 0),
        Action("F", 1),
        Action("B", 0),
        Action("U", 0),
        Action("PUSH", 0),
    )
    assert parse_actions("") == ()


@pytest.mark.parametrize("text", ["X3", "F", "F-1", "push1", "F 3", "B3x", "PULL2"])
def test_parse_action_rejects_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ScheduleError, match=r"cannot parse action .*F<p>, B<p>, U<p>, PUSH<c> or WAIT<c>"):
        parse_action(text)


def test_action_rejects_bad_kind_and_index() -> None:
    with pytest.raises(ScheduleError, match="unknown action kind 'PULL'"):
        Action("PULL", 1)
    with pytest.raises(ScheduleError, match="index >= 0"):
        Action("F", -1)
    assert issubclass(ScheduleError, HetpipeError)


# --- the wsp generator against literal tables ------------------------------------------------
# (derived by hand from docs/schedules.md#wsp and docs/wsp.md#gate)


def test_one_stage_one_in_flight_is_sequential_with_gate_from_wave_2() -> None:
    s = wsp_schedule(num_stages=1, nm=1, num_waves=3, staleness=0)
    assert s.stages == lists("F0 B0 U0 PUSH0 F1 B1 U1 PUSH1 WAIT2 F2 B2 U2 PUSH2")
    validate(s)


def test_two_stages_nm_2_two_waves() -> None:
    s = wsp_schedule(2, 2, 2, 0)
    assert s.stages == lists(
        "F0 F1 B0 U0 F2 B1 U1 PUSH0 F3 B2 U2 B3 U3 PUSH1",
        "F0 B0 U0 F1 B1 U1 PUSH0 F2 B2 U2 F3 B3 U3 PUSH1",
    )


def test_four_stages_nm_4_three_waves() -> None:
    s = wsp_schedule(4, 4, 3, 0)
    assert s.stages == lists(
        (
            "F0 F1 F2 F3 B0 U0 F4 B1 U1 F5 B2 U2 F6 B3 U3 PUSH0 F7 B4 U4 "
            "WAIT2 F8 B5 U5 F9 B6 U6 F10 B7 U7 PUSH1 F11 B8 U8 B9 U9 B10 U10 B11 U11 PUSH2"
        ),
        (
            "F0 F1 F2 B0 U0 F3 B1 U1 F4 B2 U2 F5 B3 U3 PUSH0 F6 B4 U4 F7 B5 U5 "
            "WAIT2 F8 B6 U6 F9 B7 U7 PUSH1 F10 B8 U8 F11 B9 U9 B10 U10 B11 U11 PUSH2"
        ),
        (
            "F0 F1 B0 U0 F2 B1 U1 F3 B2 U2 F4 B3 U3 PUSH0 F5 B4 U4 F6 B5 U5 F7 B6 U6 "
            "WAIT2 F8 B7 U7 PUSH1 F9 B8 U8 F10 B9 U9 F11 B10 U10 B11 U11 PUSH2"
        ),
        (
            "F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3 PUSH0 F4 B4 U4 F5 B5 U5 F6 B6 U6 F7 B7 U7 PUSH1 "
            "WAIT2 F8 B8 U8 F9 B9 U9 F10 B10 U10 F11 B11 U11 PUSH2"
        ),
    )


def test_three_stages_nm_3_staleness_1_gates_from_wave_3() -> None:
    s = wsp_schedule(3, 3, 4, 1)
    assert s.stages == lists(
        (
            "F0 F1 F2 B0 U0 F3 B1 U1 F4 B2 U2 PUSH0 F5 B3 U3 F6 B4 U4 F7 B5 U5 PUSH1 "
            "F8 B6 U6 WAIT3 F9 B7 U7 F10 B8 U8 PUSH2 F11 B9 U9 B10 U10 B11 U11 PUSH3"
        ),
        (
            "F0 F1 B0 U0 F2 B1 U1 F3 B2 U2 PUSH0 F4 B3 U3 F5 B4 U4 F6 B5 U5 PUSH1 "
            "F7 B6 U6 F8 B7 U7 WAIT3 F9 B8 U8 PUSH2 F10 B9 U9 F11 B10 U10 B11 U11 PUSH3"
        ),
        (
            "F0 B0 U0 F1 B1 U1 F2 B2 U2 PUSH0 F3 B3 U3 F4 B4 U4 F5 B5 U5 PUSH1 "
            "F6 B6 U6 F7 B7 U7 F8 B8 U8 PUSH2 WAIT3 F9 B9 U9 F10 B10 U10 F11 B11 U11 PUSH3"
        ),
    )


def test_nm_below_stages_warms_up_with_at_least_one_forward() -> None:
    # nm - j <= 0 for j >= nm: those stages still do one forward first, then plain 1F1B.
    s = wsp_schedule(4, 2, 2, 0)
    assert s.stages == lists(
        "F0 F1 B0 U0 F2 B1 U1 PUSH0 F3 B2 U2 B3 U3 PUSH1",
        "F0 B0 U0 F1 B1 U1 PUSH0 F2 B2 U2 F3 B3 U3 PUSH1",
        "F0 B0 U0 F1 B1 U1 PUSH0 F2 B2 U2 F3 B3 U3 PUSH1",
        "F0 B0 U0 F1 B1 U1 PUSH0 F2 B2 U2 F3 B3 U3 PUSH1",
    )
    validate(s)


def test_doc_example_prefix() -> None:
    # docs/schedules.md#actions: stage 0 (nm=4, D=0)
    doc = "F0 F1 F2 F3 B0 U0 F4 B1 U1 F5 B2 U2 F6 B3 U3 PUSH0 F7 B4 U4 WAIT2 F8"
    stage0 = wsp_schedule(4, 4, 3, 0).stages[0]
    assert " ".join(map(str, stage0)).startswith(doc + " ")


def test_every_generated_schedule_in_range_validates() -> None:
    for kind in SCHEDULES.values():
        for k, nm, waves, d in itertools.product(*(range(lo, hi + 1) for lo, hi in RANGES.values())):
            validate(kind(k, nm, waves, d))


@settings(max_examples=200, deadline=None)
@given(schedules())
def test_generated_schedule_invariants(s: Schedule) -> None:
    validate(s)
    total = s.num_waves * s.nm
    per_wave = SCHEDULES[s.name].update_every == "wave"
    for j, actions in enumerate(s.stages):
        compute = [a for a in actions if a.kind in "FB"]
        assert sorted((a.kind, a.index) for a in compute) == sorted(itertools.product("FB", range(total)))
        in_flight = peak = 0
        for a in compute:
            in_flight += 1 if a.kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak <= s.nm and peak == stage_profile(s, j).in_flight
        if s.name in ("wsp", "pipedream-2bw"):
            assert peak == max(1, min(s.nm - j, total))
        if s.name == "pipedream":  # as deep as the pipe, whatever the wave
            assert peak == max(1, min(min(s.nm, s.num_stages) - j, total))
        updates = [a.index for a in actions if a.kind == "U"]
        assert updates == (
            [c * s.nm + s.nm - 1 for c in range(s.num_waves)] if per_wave else list(range(total))
        )
        for i, a in enumerate(actions):
            if a.kind == "PUSH":
                assert actions[i - 1] == Action("U", a.index * s.nm + s.nm - 1)
            if a.kind == "WAIT":
                assert actions[i + 1] == Action("F", a.index * s.nm)
            if a.kind == "F":  # guarantee L of this schedule, read off the list
                assert s.own_through(j, a.index) >= own_through_required(s.guarantee, a.index, s.nm)
        waits = [a.index for a in actions if a.kind == "WAIT"]
        assert waits == [c for c in range(s.num_waves) if c - s.staleness - 1 >= 1]
        assert [a.index for a in actions if a.kind == "PUSH"] == list(range(s.num_waves))


@settings(max_examples=80, deadline=None)
@given(schedules(), st.data())
def test_dropping_any_action_is_rejected(s: Schedule, data: st.DataObject) -> None:
    """Any action but an update that a later update of the same wave can take over (one U per two
    backwards is a valid list too)."""
    j = data.draw(st.integers(0, s.num_stages - 1))
    droppable = [
        i
        for i, a in enumerate(s.stages[j])
        if a.kind != "U"
        or not any(
            b.kind == "U" and b.index // s.nm == a.index // s.nm and b.index > a.index for b in s.stages[j]
        )
    ]
    i = data.draw(st.sampled_from(droppable))
    broken = list(s.stages)
    broken[j] = s.stages[j][:i] + s.stages[j][i + 1 :]
    with pytest.raises(ScheduleError, match=f"stage {j}"):
        validate_lists(broken, s.nm, s.num_waves, s.staleness, guarantee=s.guarantee, stashing=s.stashing)


def test_generator_rejects_bad_parameters() -> None:
    with pytest.raises(UsageError, match=r"num_stages \(--stages\) must be an integer >= 1, got 0"):
        wsp_schedule(0, 2, 1, 0)
    with pytest.raises(UsageError, match=r"staleness D \(--staleness\) must be an integer >= 0, got -1"):
        wsp_schedule(2, 2, 1, -1)


# --- the other schedules against literal tables -----------------------------------------------


def test_2bw_is_1f1b_with_one_update_per_wave() -> None:
    s = get_schedule("pipedream-2bw")(3, 3, 3, 0)
    assert s.stages[0] == parse_actions(
        "F0 F1 F2 B0 F3 B1 F4 B2 U2 PUSH0 F5 B3 WAIT2 F6 B4 F7 B5 U5 PUSH1 F8 B6 B7 B8 U8 PUSH2"
    )
    assert s.stages[2] == parse_actions(
        "F0 B0 F1 B1 F2 B2 U2 PUSH0 F3 B3 F4 B4 F5 B5 U5 PUSH1 WAIT2 F6 B6 F7 B7 F8 B8 U8 PUSH2"
    )
    # F6 (wave 2) runs before wave 1's update: one update of delay. Two weight versions live from the
    # updates, and a third here because the rebase at WAIT2 makes one while F4 (version 0) is in flight.
    assert s.own_through(0, 6) == 2 and stage_profile(s, 0) == StageProfile(in_flight=3, versions=3)
    without_gates = get_schedule("pipedream-2bw")(3, 3, 3, 5)
    assert stage_profile(without_gates, 0) == StageProfile(in_flight=3, versions=2)
    validate(s)


def test_pipedream_keeps_the_pipe_full_at_its_depth_and_pushes_every_nm() -> None:
    s = get_schedule("pipedream")(2, 4, 2, 0)
    assert s.stages == lists(
        "F0 F1 B0 U0 F2 B1 U1 F3 B2 U2 F4 B3 U3 PUSH0 F5 B4 U4 F6 B5 U5 F7 B6 U6 B7 U7 PUSH1",
        "F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3 PUSH0 F4 B4 U4 F5 B5 U5 F6 B6 U6 F7 B7 U7 PUSH1",
    )
    # stage 0 sees its own updates through p - 2 (the pipe's depth), not p - Nm as under wsp at Nm 4
    assert s.own_through(0, 5) == 3 and wsp_schedule(2, 4, 2, 0).own_through(0, 5) == 1
    assert [stage_profile(s, j) for j in range(2)] == [StageProfile(2, 2), StageProfile(1, 1)]
    # one stage: sequential training that pushes every Nm minibatches; below the depth it is wsp
    assert get_schedule("pipedream")(1, 3, 1, 0).stages == lists("F0 B0 U0 F1 B1 U1 F2 B2 U2 PUSH0")
    assert get_schedule("pipedream")(4, 2, 3, 1).stages == wsp_schedule(4, 2, 3, 1).stages
    validate(s)


def test_1f1b_flush_warms_up_k_minus_j_and_drains_every_wave() -> None:
    s = get_schedule("1f1b-flush")(3, 3, 3, 0)
    assert s.stages == lists(
        "F0 F1 F2 B0 B1 B2 U2 PUSH0 F3 F4 F5 B3 B4 B5 U5 PUSH1 WAIT2 F6 F7 F8 B6 B7 B8 U8 PUSH2",
        "F0 F1 B0 F2 B1 B2 U2 PUSH0 F3 F4 B3 F5 B4 B5 U5 PUSH1 WAIT2 F6 F7 B6 F8 B7 B8 U8 PUSH2",
        "F0 B0 F1 B1 F2 B2 U2 PUSH0 F3 B3 F4 B4 F5 B5 U5 PUSH1 WAIT2 F6 B6 F7 B7 F8 B8 U8 PUSH2",
    )
    assert [stage_profile(s, j).in_flight for j in range(3)] == [3, 2, 1]
    assert s.own_through(1, 4) == 2  # every minibatch of wave 1 sees all of wave 0: no local staleness


def test_gpipe_runs_every_forward_then_every_backward() -> None:
    s = get_schedule("gpipe")(2, 2, 2, 0)
    assert s.stages == lists(
        "F0 F1 B0 B1 U1 PUSH0 F2 F3 B2 B3 U3 PUSH1", "F0 F1 B0 B1 U1 PUSH0 F2 F3 B2 B3 U3 PUSH1"
    )
    assert [stage_profile(s, j) for j in range(2)] == [StageProfile(2, 1)] * 2


def test_wsp_keeps_one_version_per_minibatch_in_flight() -> None:
    s = wsp_schedule(4, 4, 3, 0)
    assert [stage_profile(s, j) for j in range(4)] == [StageProfile(k, k) for k in (4, 3, 2, 1)]


def test_unstashed_forwards_are_those_no_update_or_rebase_separates_from_their_backward() -> None:
    wsp = wsp_schedule(2, 2, 2, 0)  # stage 0: F0 F1 B0 U0 F2 B1 U1 PUSH0 F3 B2 U2 B3 U3 PUSH1
    assert [sorted(unstashed_forwards(actions)) for actions in wsp.stages] == [[0], [0, 1, 2, 3]]
    one = parse_actions(
        "F0 F1 F2 B0 U0 F3 B1 U1 B2 U2 B3 U3 PUSH0"
    )  # wsp's one stage at Nm 3: ahead of its updates
    assert unstashed_forwards(one) == {0}
    assert unstashed_forwards(parse_actions("F0 B0 PUSH0 F1 B1 U1 WAIT1 F2 B2")) == {0, 1, 2}
    assert (
        unstashed_forwards(parse_actions("F0 WAIT1 B0 F1 U0 B1")) == set()
    )  # a rebase, an update in between
    flush = get_schedule("1f1b-flush")(3, 4, 2, 1)  # one update a wave, after every backward of it
    assert all(unstashed_forwards(actions) == set(range(8)) for actions in flush.stages)


@given(schedules())
@settings(max_examples=60, deadline=None)
def test_an_unstashed_forwards_weights_are_those_of_its_backward(s: Schedule) -> None:
    for actions in s.stages:
        versions, at_forward = 0, {}
        for action in actions:
            if action.kind in ("U", "WAIT"):
                versions += 1
            elif action.kind == "F":
                at_forward[action.index] = versions
            elif action.kind == "B" and action.index in unstashed_forwards(actions):
                assert at_forward[action.index] == versions, (s.name, action)


# --- registry --------------------------------------------------------------------------------


def test_registry_knows_the_five_schedules() -> None:
    assert get_schedule("wsp") is wsp_schedule and SCHEDULES["wsp"] is wsp_schedule
    assert sorted(SCHEDULES) == ["1f1b-flush", "gpipe", "pipedream", "pipedream-2bw", "wsp"]


def test_unknown_schedule_lists_known_names_and_suggests() -> None:
    with pytest.raises(UsageError, match=r'unknown schedule "wps"') as info:
        get_schedule("wps")
    assert "known schedules: 1f1b-flush, gpipe, pipedream, pipedream-2bw, wsp" in str(info.value)
    assert 'did you mean "wsp"?' in str(info.value)


def test_register_schedule_adds_a_kind_and_refuses_duplicates() -> None:
    kind = dataclasses.replace(SCHEDULES["gpipe"], name="test-fill-drain", summary="for the test")
    try:
        assert (
            register_schedule(kind) is kind
            and get_schedule("test-fill-drain")(2, 2, 1, 0).name == "test-fill-drain"
        )
        with pytest.raises(ValueError, match="registered twice"):
            register_schedule(kind)
    finally:
        SCHEDULES.unregister("test-fill-drain")


# --- the validator rejects -------------------------------------------------------------------


def test_deadlock_of_two_stages_waiting_on_each_other() -> None:
    stages = lists(
        "F0 B0 U0 F1 B1 U1 PUSH0",
        "F1 B1 U1 F0 B0 U0 PUSH0",
    )
    with pytest.raises(ScheduleError) as info:
        validate_lists(stages, nm=2, num_waves=1, staleness=0)
    message = str(info.value)
    assert message.startswith("deadlock: no stage can proceed")
    assert "stage 0, position 1 (B0) waits for B0 at stage 1" in message
    assert "stage 1, position 0 (F1) waits for F1 at stage 0" in message


def test_deadlock_of_a_gate_waiting_for_its_own_later_push() -> None:
    stages = lists("F0 B0 U0 F1 B1 U1 WAIT2 PUSH0 PUSH1 F2 B2 U2 PUSH2")
    with pytest.raises(ScheduleError, match=r"stage 0, position 6 \(WAIT2\) waits for PUSH0 at stage 0"):
        validate_lists(stages, nm=1, num_waves=3, staleness=0)


def test_deadlock_of_a_gate_waiting_for_another_stage() -> None:
    # stage 1 holds PUSH0 back until after its F2, which needs stage 0's F2, which is gated on PUSH0
    # at every stage (k=2, nm=1, D=0).
    stages = lists(
        "F0 B0 U0 PUSH0 F1 B1 U1 PUSH1 WAIT2 F2 B2 U2 PUSH2",
        "F0 B0 U0 F1 B1 U1 PUSH1 WAIT2 F2 PUSH0 B2 U2 PUSH2",
    )
    with pytest.raises(ScheduleError) as info:
        validate_lists(stages, nm=1, num_waves=3, staleness=0)
    assert "stage 0, position 8 (WAIT2) waits for PUSH0 at stage 1" in str(info.value)
    assert "stage 1, position 7 (WAIT2) waits for PUSH0 at stage 1" in str(info.value)


def test_backward_before_forward() -> None:
    stages = lists(
        "F0 B0 U0 PUSH0",
        "B0 F0 U0 PUSH0",
    )
    with pytest.raises(
        ScheduleError, match=r"stage 1, position 0 \(B0\): backward before its forward .*put F0 before B0"
    ):
        validate_lists(stages, nm=1, num_waves=1, staleness=0)


def test_in_flight_above_nm() -> None:
    stages = lists("F0 F1 B0 U0 PUSH0 B1 U1 PUSH1")
    with pytest.raises(
        ScheduleError, match=r"stage 0, position 1 \(F1\): 2 minibatches in flight .* more than nm=1"
    ):
        validate_lists(stages, nm=1, num_waves=2, staleness=0)


def test_forward_before_the_backward_nm_earlier() -> None:
    # in flight stays <= 2, but F2 runs before B0's update: guarantee L (docs/schedules.md) breaks
    stages = lists("F0 F1 B1 U1 F2 B0 U0 PUSH0 F3 B2 U2 B3 U3 PUSH1")
    with pytest.raises(ScheduleError, match=r"stage 0, position 4 \(F2\): comes before B0 and its update"):
        validate_lists(stages, nm=2, num_waves=2, staleness=0)


def test_wave_guarantee_needs_the_whole_previous_wave() -> None:
    # a 1f1b-flush order whose F2 runs before wave 0's update
    stages = lists("F0 F1 B0 F2 B1 U1 PUSH0 B2 F3 B3 U3 PUSH1")
    with pytest.raises(
        ScheduleError, match=r"position 3 \(F2\): comes before B0 and its update; guarantee L \(wave\)"
    ):
        validate_lists(stages, nm=2, num_waves=2, staleness=0, guarantee="wave", stashing="none")


def test_update_rules() -> None:
    with pytest.raises(
        ScheduleError,
        match=r"position 3 \(U0\): an update names the last backward it applies, but "
        r"the last backward before it is B1",
    ):
        validate_lists([parse_actions("F0 F1 B1 U0 B0 U1 PUSH0")], nm=2, num_waves=1, staleness=0)
    with pytest.raises(ScheduleError, match=r"applies backwards of waves \[0, 1\]; .* put a U after B0"):
        validate_lists(
            [parse_actions("F0 B0 F1 B1 U1 PUSH0 PUSH1")],
            nm=1,
            num_waves=2,
            staleness=0,
            guarantee="previous-wave",
        )
    with pytest.raises(ScheduleError, match=r"F1 is in flight and this schedule keeps no stashed weights"):
        validate_lists(
            [parse_actions("F0 F1 B0 U0 B1 U1 PUSH0")], nm=2, num_waves=1, staleness=0, stashing="none"
        )
    with pytest.raises(
        ScheduleError, match=r"wave 0's update is not complete, B1's update \(U\) has not run"
    ):
        validate_lists([parse_actions("F0 B0 U0 F1 B1 PUSH0")], nm=2, num_waves=1, staleness=0)
    with pytest.raises(ScheduleError, match=r"stage 0: B1 is never applied; put a U after it"):
        validate_lists([parse_actions("F0 B0 U0 F1 B1")], nm=2, num_waves=1, staleness=0)


def test_missing_push() -> None:
    stages = list(wsp_schedule(2, 2, 2, 0).stages)
    stages[1] = tuple(a for a in stages[1] if a != Action("PUSH", 0))
    with pytest.raises(
        ScheduleError, match=r"stage 1: PUSH0 is missing; put it right after U1 \(position 5\)"
    ):
        validate_lists(stages, nm=2, num_waves=2, staleness=0)


def test_push_before_the_wave_is_done() -> None:
    stages = lists("F0 F1 B0 U0 PUSH0 B1 U1")
    with pytest.raises(
        ScheduleError, match=r"stage 0, position 4 \(PUSH0\): wave 0's update is not complete, B1 has not run"
    ):
        validate_lists(stages, nm=2, num_waves=1, staleness=0)


def test_wait_after_the_waves_first_forward() -> None:
    stages = lists("F0 B0 U0 PUSH0 F1 B1 U1 PUSH1 F2 WAIT2 B2 U2 PUSH2")
    with pytest.raises(ScheduleError) as info:
        validate_lists(stages, nm=1, num_waves=3, staleness=0)
    assert "stage 0, position 8 (F2): first action of wave 2, but WAIT2 comes later (position 9)" in str(
        info.value
    )
    assert "put WAIT2 right before F2" in str(info.value)


def test_missing_wait() -> None:
    stages = lists("F0 B0 U0 PUSH0 F1 B1 U1 PUSH1 F2 B2 U2 PUSH2")
    with pytest.raises(
        ScheduleError, match=r"stage 0, position 8 \(F2\): first action of wave 2, but WAIT2 is missing"
    ):
        validate_lists(stages, nm=1, num_waves=3, staleness=0)


def test_wait_that_is_not_needed() -> None:
    stages = lists("F0 B0 U0 PUSH0 WAIT1 F1 B1 U1 PUSH1")
    with pytest.raises(ScheduleError, match=r"stage 0, position 4 \(WAIT1\): wave 1 needs no gate with D=0"):
        validate_lists(stages, nm=1, num_waves=2, staleness=0)


@pytest.mark.parametrize(
    "line, nm, waves, message",
    [
        ("F0 F0 B0 U0 PUSH0", 1, 1, r"position 1 \(F0\): F0 already at position 0"),
        ("F0 B0 U0 PUSH0 F1", 1, 1, r"position 4 \(F1\): no minibatch 1; .* minibatches are 0..0"),
        ("F0 B0 U0 PUSH0 PUSH1", 1, 1, r"position 4 \(PUSH1\): no wave 1; waves are 0..0"),
        ("F0 B0 U0 F1 PUSH0", 2, 1, r"position 4 \(PUSH0\): wave 0's update is not complete, B1 has not run"),
        ("F0 B0 U0 F1 B1 U1", 2, 1, r"stage 0: PUSH0 is missing; put it right after U1 \(position 5\)"),
        ("F0 B0 U0 PUSH0", 1, 2, r"stage 0: F1 is missing"),
    ],
)
def test_list_level_errors(line: str, nm: int, waves: int, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate_lists([parse_actions(line)], nm=nm, num_waves=waves, staleness=0)


def test_schedule_with_wrong_number_of_lists() -> None:
    s = wsp_schedule(2, 2, 1, 0)
    with pytest.raises(ScheduleError, match="num_stages=3 but 2 stage lists"):
        validate(Schedule(3, 2, 1, 0, "wsp", s.stages))


# --- timing, steps, text ---------------------------------------------------------------------


def test_steps_one_stage() -> None:
    f0, b0, u0, push0 = parse_actions("F0 B0 U0 PUSH0")
    assert steps(wsp_schedule(1, 1, 1, 0)) == [((f0,),), ((b0,),), ((u0, push0),)]


GRID_2_2_2 = """\
wsp: stages=2 nm=2 waves=2 D=0
step  stage 0      stage 1
   0  F0           .
   1  F1           F0
   2  .            B0
   3  B0           U0 F1
   4  U0 F2        B1
   5  B1           U1 PUSH0 F2
   6  U1 PUSH0 F3  B2
   7  B2           U2 F3
   8  U2           B3
   9  B3           U3 PUSH1
  10  U3 PUSH1     ."""


def test_grid_two_stages() -> None:
    assert format_grid(wsp_schedule(2, 2, 2, 0)) == GRID_2_2_2


def test_lists_text() -> None:
    assert format_lists(wsp_schedule(2, 2, 2, 0)) == (
        "wsp: stages=2 nm=2 waves=2 D=0\n"
        "stage 0: F0 F1 B0 U0 F2 B1 U1 PUSH0 F3 B2 U2 B3 U3 PUSH1\n"
        "stage 1: F0 B0 U0 F1 B1 U1 PUSH0 F2 B2 U2 F3 B3 U3 PUSH1"
    )


def test_simulate_heterogeneous_stage_times() -> None:
    # F0: stage 0 [0,1), stage 1 [1,4); B0: stage 1 [4,8), stage 0 [8,10); updates and pushes when B0 ends.
    timeline = simulate(wsp_schedule(2, 1, 1, 0), forward_time=[1.0, 3.0], backward_time=[2.0, 4.0])
    spans = {(e.stage, str(e.action)): (e.start, e.end) for e in timeline.events}
    assert spans == {
        (0, "F0"): (0.0, 1.0),
        (1, "F0"): (1.0, 4.0),
        (1, "B0"): (4.0, 8.0),
        (1, "U0"): (8.0, 8.0),
        (1, "PUSH0"): (8.0, 8.0),
        (0, "B0"): (8.0, 10.0),
        (0, "U0"): (10.0, 10.0),
        (0, "PUSH0"): (10.0, 10.0),
    }
    assert timeline.makespan == 10.0


def test_simulate_matches_the_figures_of_docs_schedules() -> None:
    # docs/schedules.md: k=4, nm=2, forward 1 and backward 2 per stage: static 1F1B runs 0.11 minibatches
    # per time unit; the ideal is nm / (k * (1 + 2)) = 0.17. With nm = k the pipe fills: 1 / 3.
    assert round(simulate(wsp_schedule(4, 2, 100, 0)).throughput, 2) == 0.11
    assert round(simulate(wsp_schedule(4, 4, 100, 0)).throughput, 2) == 0.33
    # a flush per wave costs the fill and drain every wave: (m + k - 1) slots of 3 per m minibatches
    assert simulate(get_schedule("1f1b-flush")(4, 4, 100, 0)).throughput == pytest.approx(
        4 / (7 * 3), rel=0.01
    )


def test_simulate_rejects_bad_times() -> None:
    s = wsp_schedule(2, 1, 1, 0)
    with pytest.raises(UsageError, match="forward_time has 3 entries for 2 stages"):
        simulate(s, forward_time=[1.0, 1.0, 1.0])
    with pytest.raises(UsageError, match="backward_time must be finite and > 0"):
        simulate(s, backward_time=0.0)


@settings(max_examples=60, deadline=None)
@given(
    schedules(),
    st.lists(st.integers(1, 4), min_size=6, max_size=6),
    st.lists(st.integers(1, 4), min_size=6, max_size=6),
)
def test_simulated_run_keeps_the_dependency_rules(s: Schedule, fwd: list[int], bwd: list[int]) -> None:
    k = s.num_stages
    timeline = simulate(s, [float(t) for t in fwd[:k]], [float(t) for t in bwd[:k]])
    end = {(e.stage, e.action): e.end for e in timeline.events}
    start = {(e.stage, e.action): e.start for e in timeline.events}
    assert len(end) == sum(len(a) for a in s.stages)
    for (j, a), t in start.items():
        if a.kind == "F" and j > 0:
            assert end[j - 1, a] <= t
        if a.kind == "B":
            assert end[j, Action("F", a.index)] <= t
            if j < k - 1:
                assert end[j + 1, a] <= t
        if a.kind == "PUSH":
            assert all(end[j, Action("B", p)] <= t for p in range(a.index * s.nm, (a.index + 1) * s.nm))
        if a.kind == "WAIT":
            assert all(
                end[i, Action("PUSH", c)] <= t for i in range(k) for c in range(a.index - s.staleness - 1)
            )
    for j in range(k):  # a stage runs one action at a time, in list order
        spans = [(start[j, a], end[j, a]) for a in s.stages[j]]
        assert all(prev[1] <= nxt[0] for prev, nxt in itertools.pairwise(spans))

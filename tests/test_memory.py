"""The stage memory model (hetpipe/memory.py): in-flight counts against the wsp schedule, literal sums."""

from __future__ import annotations

import pytest

from hetpipe.core.errors import UsageError
from hetpipe.core.memory import format_bytes, in_flight, stage_memory, stage_memory_terms
from hetpipe.core.profile import LayerProfile
from hetpipe.core.schedule import BACKWARD, FORWARD, simulate, wsp_schedule


def layer(params: int = 0, optimizer: int = 0, output: int = 0, saved: int = 0, working: int = 0) -> LayerProfile:
    return LayerProfile("l", 1.0, 2.0, params, optimizer, output, saved, working)


@pytest.mark.parametrize(("stage", "nm", "expected"), [
    (0, 1, 1), (0, 4, 4), (1, 4, 3), (3, 4, 1), (4, 4, 1), (7, 2, 1), (2, 8, 6),
])
def test_in_flight_table(stage: int, nm: int, expected: int) -> None:
    assert in_flight(stage, nm) == expected


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("nm", [1, 2, 3, 4, 6])
def test_in_flight_and_weight_versions_match_the_wsp_schedule(k: int, nm: int) -> None:
    """Walk each stage's action list: most minibatches between F and B, and most distinct weight
    versions alive (those in-flight minibatches used, plus the live one) both equal in_flight."""
    schedule = wsp_schedule(k, nm, 4, 0)
    for j, actions in enumerate(schedule.stages):
        version, used, most_flight, most_versions = 0, {}, 0, 0
        for action in actions:
            if action.kind == FORWARD:
                used[action.index] = version
            elif action.kind == BACKWARD:
                del used[action.index]
                version += 1  # the local optimizer step right after the backward
            most_flight = max(most_flight, len(used))
            most_versions = max(most_versions, len(set(used.values()) | {version}))
        assert most_flight == in_flight(j, nm)
        assert most_versions == in_flight(j, nm)  # so in_flight - 1 stashed copies besides the live weights


@pytest.mark.parametrize(("k", "nm"), [(4, 4), (4, 2), (3, 5), (2, 1)])
def test_in_flight_matches_a_timed_simulation(k: int, nm: int) -> None:
    """Same count from the simulated timeline with unequal stage times (F started, B not finished)."""
    timeline = simulate(wsp_schedule(k, nm, 5, 5), [1.0, 3.0, 0.5, 2.0][:k], [2.0, 1.0, 4.0, 0.7][:k])
    for j in range(k):
        changes = sorted([(e.start, 1) for e in timeline.events if e.stage == j and e.action.kind == FORWARD]
                         + [(e.end, -1) for e in timeline.events if e.stage == j and e.action.kind == BACKWARD])
        count = most = 0
        for _, delta in changes:  # at equal times -1 sorts first: a B ending frees its slot for an F starting
            count += delta
            most = max(most, count)
        assert most == in_flight(j, nm)


def test_stage_memory_literal_sum() -> None:
    layers = [layer(params=100, optimizer=100, output=10, saved=30, working=7),
              layer(params=50, optimizer=50, output=20, saved=5, working=40)]
    # stage 1 with nm=4: 3 in flight, 2 stashed copies
    terms = stage_memory_terms(layers, 1, 4, True, input_bytes=8)
    assert terms.weights == 150
    assert terms.gradients == 150
    assert terms.optimizer == 150
    assert terms.stashed == 2 * 150
    assert terms.activations == 3 * 35
    assert terms.inputs == 3 * 8
    assert terms.working == 40
    assert stage_memory(layers, 1, 4, True, input_bytes=8) == 150 * 5 + 105 + 24 + 40 == terms.total
    # without stashing the extra copies go; the last stage of a deep VW holds one minibatch
    assert stage_memory(layers, 1, 4, False, input_bytes=8) == 150 * 3 + 105 + 24 + 40
    assert stage_memory(layers, 5, 4, True, input_bytes=8) == 150 * 3 + 35 + 8 + 40


def test_stage_memory_describe_names_the_terms() -> None:
    text = stage_memory_terms([layer(params=2**30, saved=2**20)], 0, 2, True, input_bytes=0).describe()
    assert text.startswith("weights 1.00 GiB + gradients 1.00 GiB + stashed weights 1.00 GiB")
    assert "saved activations 2.00 MiB" in text
    assert text.endswith("= 3.00 GiB")


def test_stage_memory_rejects_bad_input() -> None:
    with pytest.raises(UsageError, match="at least one layer"):
        stage_memory([], 0, 1, True, input_bytes=0)
    with pytest.raises(UsageError, match="nm >= 1"):
        stage_memory([layer()], 0, 0, True, input_bytes=0)
    with pytest.raises(UsageError, match="input_bytes"):
        stage_memory([layer()], 0, 1, True, input_bytes=-1)


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(7.1 * 2**30) == "7.10 GiB"

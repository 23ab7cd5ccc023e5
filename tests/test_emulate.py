"""Tests of hetpipe.core.hardware.emulate: slowdowns worked out by hand, the dilator on a fake clock, a
real-time check."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetpipe.core.config.files import default_config_path, load_config
from hetpipe.core.hardware.emulate import (
    CORE_SHARE,
    DilatedBlock,
    Dilator,
    EmulationError,
    LinkEmulator,
    auto_time_scale,
    cpu_cores,
    gpu_speeds,
    link_delay_s,
    slowdowns,
    usable_cores,
)

# The packaged default cluster: n0 = [fast, slow], n1 = [fast, slow], fast = 2.0, slow = 1.0.
SPEEDS = {"n0:0": 2.0, "n0:1": 1.0, "n1:0": 2.0, "n1:1": 1.0}


class FakeTime:
    """A clock that only moves when the block under test or a sleep moves it; sleeps wake `late` seconds
    late."""

    def __init__(self, late: float = 0.0) -> None:
        self.now = 0.0
        self.late = late
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds + self.late


# ---------------------------------------------------------------------------------------------- slowdowns


def test_default_cluster_speeds() -> None:
    assert gpu_speeds(load_config(default_config_path())) == SPEEDS


def test_auto_on_two_cores() -> None:
    # relative slowdowns fastest/speed: 1, 2, 1, 2 -> busy cores 1 + 1/2 + 1 + 1/2 = 3
    # usable = 0.75 * 2 = 1.5 -> time_scale = 3 / 1.5 = 2 -> slowdowns 2, 4, 2, 4 (busy 1.5 = usable)
    assert usable_cores(2) == 1.5
    assert auto_time_scale(SPEEDS, 2) == 2.0
    assert slowdowns(SPEEDS, 2, None) == {"n0:0": 2.0, "n0:1": 4.0, "n1:0": 2.0, "n1:1": 4.0}


@pytest.mark.parametrize(
    ("speeds", "cores", "time_scale", "expected"),
    [
        # enough cores: auto keeps time_scale 1 (busy 3 <= 0.75 * 8 = 6)
        (SPEEDS, 8, None, {"n0:0": 1.0, "n0:1": 2.0, "n1:0": 1.0, "n1:1": 2.0}),
        # an explicit time_scale is used as given, cores ignored
        (SPEEDS, 2, 3.0, {"n0:0": 3.0, "n0:1": 6.0, "n1:0": 3.0, "n1:1": 6.0}),
        # one device on one core: busy 1 > 0.75 -> time_scale 1 / 0.75
        ({"a:0": 5.0}, 1, None, {"a:0": 4 / 3}),
        # titan-v 16, p4000 4 on 4 cores: busy 1 + 1/4 = 1.25 <= 3 -> time_scale 1
        ({"a:0": 16.0, "b:0": 4.0}, 4, None, {"a:0": 1.0, "b:0": 4.0}),
        ({}, 2, None, {}),
    ],
)
def test_slowdowns_cases(
    speeds: dict[str, float], cores: int, time_scale: float | None, expected: dict[str, float]
) -> None:
    assert slowdowns(speeds, cores, time_scale) == pytest.approx(expected)


@given(
    st.lists(st.floats(min_value=0.1, max_value=100.0), min_size=1, max_size=16),
    st.integers(min_value=1, max_value=64),
)
def test_auto_fits_the_cores_and_is_smallest(speeds: list[float], cores: int) -> None:
    by_ref = {f"n0:{i}": speed for i, speed in enumerate(speeds)}
    result = slowdowns(by_ref, cores, None)
    busy = sum(1.0 / s for s in result.values())
    assert busy <= CORE_SHARE * cores * (1 + 1e-9)
    assert min(result.values()) >= 1.0
    time_scale = auto_time_scale(by_ref, cores)
    assert time_scale == 1.0 or busy == pytest.approx(CORE_SHARE * cores)


@pytest.mark.parametrize(
    ("speeds", "cores", "time_scale"),
    [
        (SPEEDS, 2, 0.5),
        (SPEEDS, 2, float("inf")),
        ({"n0:0": 0.0}, 2, None),
        (SPEEDS, 0, None),
    ],
)
def test_slowdowns_rejects(speeds: dict[str, float], cores: int, time_scale: float | None) -> None:
    with pytest.raises(EmulationError, match=r"set|give|pass"):
        slowdowns(speeds, cores, time_scale)


def test_cpu_cores() -> None:
    assert cpu_cores() >= 1


# ---------------------------------------------------------------------------------------------- dilator


def test_dilator_sleeps_slowdown_minus_one_times_compute() -> None:
    fake = FakeTime()
    dilator = Dilator(3.0, clock=fake.clock, sleep=fake.sleep)
    with dilator.compute("F0"):
        fake.now += 0.25
    with dilator.compute("B0"):
        fake.now += 0.125
    assert fake.sleeps == [0.5, 0.25]
    assert fake.now == 3 * (0.25 + 0.125)
    assert (dilator.compute_s, dilator.slept_s, dilator.count, dilator.wall_s) == (0.375, 0.75, 2, 1.125)
    assert dilator.last == DilatedBlock("B0", 0.125, 0.25)


def test_dilator_slowdown_one_never_sleeps() -> None:
    fake = FakeTime()
    dilator = Dilator(1.0, clock=fake.clock, sleep=fake.sleep)
    with dilator.compute("F0"):
        fake.now += 0.5
    assert fake.sleeps == []
    assert (dilator.compute_s, dilator.slept_s, dilator.count) == (0.5, 0.0, 1)


def test_dilator_pays_back_late_wakeups() -> None:
    fake = FakeTime(late=0.125)
    dilator = Dilator(2.0, clock=fake.clock, sleep=fake.sleep)
    for name in ("F0", "F1", "F2"):
        with dilator.compute(name):
            fake.now += 0.25
    # due 0.25 (woke 0.125 late), then 0.25 - 0.125, then 0.25 - 0.125 again
    assert fake.sleeps == [0.25, 0.125, 0.125]
    with dilator.compute("F3"):
        fake.now += 0.0625
    # due 0.0625 - 0.125 < 0: no sleep; the remaining 0.0625 is paid by the next block
    assert fake.sleeps == [0.25, 0.125, 0.125]
    with dilator.compute("F4"):
        fake.now += 0.25
    assert fake.sleeps == [0.25, 0.125, 0.125, 0.1875]


def test_dilator_does_not_dilate_a_block_that_raises() -> None:
    fake = FakeTime()
    dilator = Dilator(4.0, clock=fake.clock, sleep=fake.sleep)
    with pytest.raises(RuntimeError), dilator.compute("F0"):
        fake.now += 1.0
        raise RuntimeError("boom")
    assert fake.sleeps == []
    assert dilator.count == 0


@pytest.mark.parametrize("slowdown", [0.5, 0.0, float("nan"), float("inf")])
def test_dilator_rejects_speedups(slowdown: float) -> None:
    with pytest.raises(EmulationError, match="slowdowns"):
        Dilator(slowdown)


def test_dilator_real_time() -> None:
    dilator = Dilator(3.0)
    start = time.perf_counter()
    with dilator.compute("F0"):
        while time.perf_counter() - start < 0.020:
            pass
    elapsed = time.perf_counter() - start
    assert 0.050 < elapsed < 0.150


# ---------------------------------------------------------------------------------------------- links


def test_link_delay() -> None:
    assert link_delay_s(1_000_000, 8.0) == 0.001
    assert link_delay_s(0, 10.0) == 0.0
    with pytest.raises(EmulationError, match=r"\[network\]"):
        link_delay_s(1, 0.0)


def test_link_emulator_sleeps_scaled_delay() -> None:
    fake = FakeTime()
    link = LinkEmulator.for_link(True, 10.0, time_scale=2.0, sleep=fake.sleep)
    assert link.delay(1_250_000) == pytest.approx(0.002)  # 1e7 bits at 1e10 bit/s, times 2
    assert fake.sleeps == pytest.approx([0.002])
    assert (link.nbytes, link.delayed_s) == (1_250_000, pytest.approx(0.002))


def test_link_emulator_off_unless_configured() -> None:
    fake = FakeTime()
    link = LinkEmulator.for_link(False, 10.0, sleep=fake.sleep)
    assert not link.enabled
    assert link.delay(10**9) == 0.0
    assert fake.sleeps == []


def test_cpu_clock_tops_up_to_slowdown_times_cpu_time():
    """Under contention a block's wall time exceeds its CPU time; the sleep fills up to slowdown x CPU."""
    slept = []
    walls = iter([0.0, 0.05])  # the block took 50 ms of wall time ...
    cpus = iter([1.0, 1.02])  # ... but only 20 ms of CPU time (it waited for a core)
    dilator = Dilator(3.0, clock=lambda: next(walls, 0.0), sleep=slept.append, cpu_clock=lambda: next(cpus))
    with dilator.compute("F0"):
        pass
    assert slept == [pytest.approx(3.0 * 0.02 - 0.05)]

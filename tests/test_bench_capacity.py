"""launch/bench/capacity.py: the capacity bound sums each GPU's standalone rate by its type, at the type's
fastest batch, and keeps the slowdown-1 figure beside it. Pure: the rates are given, no process runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
import capacity  # noqa: E402  (launch/bench is not a package)
import peers  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "launch" / "clusters" / "bench.toml"


def device(gpu: str, gpu_type: str, slowdown: float) -> peers.Device:
    return peers.Device(gpu, gpu_type, 1.0, 1 << 20, slowdown)


CLUSTER = [
    device("n0:0", "fast", 10.0),
    device("n0:1", "fast", 10.0),
    device("n1:0", "slow", 25.0),
    device("n1:1", "slow", 25.0),
    device("n1:2", "slow", 25.0),
]


def test_every_gpu_counts_its_types_fastest_batch_and_the_ideal_divides_the_solo_rate() -> None:
    found = capacity.summed(
        CLUSTER, 1000.0, {"fast": {256: 80.0, 1024: 95.0}, "slow": {256: 30.0, 1024: 28.0}}
    )
    assert found.total == pytest.approx(2 * 95.0 + 3 * 30.0)  # each type at its own fastest batch
    assert found.ideal == pytest.approx(2 * 1000.0 / 10 + 3 * 1000.0 / 25)
    assert found.record() == {
        "total": 280.0,
        "ideal": 320.0,
        "solo_rate": 1000.0,
        "per_type": {"fast": 95.0, "slow": 30.0},
        "per_batch": {"fast": {"256": 80.0, "1024": 95.0}, "slow": {"256": 30.0, "1024": 28.0}},
    }
    text = found.describe()
    assert "capacity 280 samples/s" in text and "fast 80 at 256, 95 at 1024; slow 30 at 256" in text
    assert "1.14x" in text


def test_a_type_without_a_measured_rate_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="slow: measure every type"):
        capacity.summed(CLUSTER, 1000.0, {"fast": {256: 80.0}, "slow": {}})


def test_larger_batches_get_fewer_steps_but_at_least_four() -> None:
    assert capacity.steps_at(256, 256) == capacity.TYPE_STEPS
    assert capacity.steps_at(512, 256) == capacity.TYPE_STEPS // 2
    assert capacity.steps_at(4096, 256) == 4


def test_one_gpu_of_each_type_is_measured_in_config_order() -> None:
    assert [d.gpu for d in capacity.one_per_type(CLUSTER)] == ["n0:0", "n1:0"]
    from hetpipe.core.config.files import load_config

    bench = peers.devices(load_config(BENCH))
    chosen = capacity.one_per_type(bench)
    assert [d.gpu_type for d in chosen] == ["titan-v", "rtx-2060", "p4000"]
    for d in bench:  # a type's GPUs share one slowdown, so one stands for all
        assert d.slowdown == next(c.slowdown for c in chosen if c.gpu_type == d.gpu_type)


def test_the_repeats_measure_at_the_largest_per_gpu_batch_any_row_runs() -> None:
    import throughput  # noqa: PLC0415  (imports torch: only this test needs it)

    plain = throughput.HetpipeSetup(((("n0:0",), (10,)),), 4, 0, "config", None)
    own = throughput.HetpipeSetup(
        ((("n0:0",), (10,)), (("n1:0", "n1:1"), (5, 5))), 16, 0, "planner", None, work=((16, 576), (32, 64))
    )
    assert throughput.largest_batch([plain], [], 256) == 256
    assert throughput.largest_batch([plain, own], [("fastest", [256, 512])], 256) == 576
    assert throughput.largest_batch([own], [("fastest", [256, 1024]), ("prop", [4096])], 256) == 1024

"""launch/bench/capacity.py: the capacity bound sums each GPU's standalone rate by its type, and keeps the
slowdown-1 figure beside it. Pure: the rates are given, no process runs."""

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


def test_every_gpu_counts_its_types_standalone_rate_and_the_ideal_divides_the_solo_rate() -> None:
    found = capacity.summed(CLUSTER, 1000.0, {"fast": 80.0, "slow": 30.0})
    assert found.total == pytest.approx(2 * 80.0 + 3 * 30.0)
    assert found.ideal == pytest.approx(2 * 1000.0 / 10 + 3 * 1000.0 / 25)
    assert found.record() == {
        "total": 250.0,
        "ideal": 320.0,
        "solo_rate": 1000.0,
        "per_type": {"fast": 80.0, "slow": 30.0},
    }
    text = found.describe()
    assert "capacity 250 samples/s" in text and "fast 80, slow 30" in text and "1.28x" in text


def test_a_type_without_a_measured_rate_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="slow: measure every type"):
        capacity.summed(CLUSTER, 1000.0, {"fast": 80.0})


def test_one_gpu_of_each_type_is_measured_in_config_order() -> None:
    assert [d.gpu for d in capacity.one_per_type(CLUSTER)] == ["n0:0", "n1:0"]
    from hetpipe.core.config.files import load_config

    bench = peers.devices(load_config(BENCH))
    chosen = capacity.one_per_type(bench)
    assert [d.gpu_type for d in chosen] == ["titan-v", "rtx-2060", "p4000"]
    for d in bench:  # a type's GPUs share one slowdown, so one stands for all
        assert d.slowdown == next(c.slowdown for c in chosen if c.gpu_type == d.gpu_type)

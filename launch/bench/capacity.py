"""The capacity bound of throughput.py: the sum of every GPU's standalone rate, each GPU type measured alone.

An emulated GPU's standalone rate is one process training the whole model at the config's batch, alone on
the machine, at that GPU's slowdown: the emulation's sleeps cost something per step (docs/emulation.md#what-
dilation-costs), so a GPU at slowdown 10 makes less than a tenth of what one process makes at slowdown 1.
The bound sums those rates over the cluster's GPUs, one measurement per GPU type. The figure the earlier
runs used (one process at slowdown 1 over each GPU's slowdown, which leaves that cost out) is kept beside
it as `ideal`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import peers

from hetpipe.core.config.schema import ClusterConfig

SOLO_STEPS = 12 + 3  # the slowdown-1 process: 3 warm-up steps, 12 measured
TYPE_STEPS = 12 + 2  # each GPU type at its slowdown: 2 warm-up steps, 12 measured (1.3 s a step at x28)


@dataclass(frozen=True)
class Capacity:
    """One measurement of the bound: the slowdown-1 rate, each GPU type's standalone rate, both sums."""

    solo_rate: float  # one process at slowdown 1, samples/s
    per_type: Mapping[str, float]  # each GPU type alone at its slowdown, samples/s
    total: float  # sum over the GPUs of their type's standalone rate
    ideal: float  # sum over the GPUs of solo_rate / slowdown

    def describe(self) -> str:
        types = ", ".join(f"{name} {rate:.0f}" for name, rate in self.per_type.items())
        return (
            f"capacity {self.total:.0f} samples/s: each GPU type alone at its slowdown ({types}), "
            f"summed over the GPUs; one process at slowdown 1 {self.solo_rate:.0f}, over each GPU's slowdown "
            f"{self.ideal:.0f} (leaves out what the emulation's sleeps cost, {self.ideal / self.total:.2f}x)"
        )

    def record(self) -> dict[str, object]:
        return {
            "total": round(self.total, 1),
            "ideal": round(self.ideal, 1),
            "solo_rate": round(self.solo_rate, 1),
            "per_type": {name: round(rate, 1) for name, rate in self.per_type.items()},
        }


def summed(devs: Sequence[peers.Device], solo_rate: float, per_type: Mapping[str, float]) -> Capacity:
    """The bound from the measured rates: each GPU counts its type's standalone rate once."""
    missing = sorted({d.gpu_type for d in devs} - set(per_type))
    if missing:
        raise ValueError(f"no standalone rate for GPU type(s) {', '.join(missing)}: measure every type")
    return Capacity(
        solo_rate,
        dict(per_type),
        sum(per_type[d.gpu_type] for d in devs),
        sum(solo_rate / d.slowdown for d in devs),
    )


def one_per_type(devs: Sequence[peers.Device]) -> list[peers.Device]:
    """The first GPU of each type, in config order: whose slowdown stands for the type's."""
    seen: dict[str, peers.Device] = {}
    for d in devs:
        seen.setdefault(d.gpu_type, d)
    return list(seen.values())


def measure(config: ClusterConfig, devs: Sequence[peers.Device], logs: Path) -> Capacity:
    """The slowdown-1 process, then each GPU type alone at its slowdown, one after another (no network)."""
    batch = config.train.batch_size
    solo = peers.run_solo(config, batch, SOLO_STEPS, logs).rate(3)
    per_type = {
        d.gpu_type: peers.run_solo(config, batch, TYPE_STEPS, logs, slowdown=d.slowdown).rate(2)
        for d in one_per_type(devs)
    }
    return summed(devs, solo, per_type)

"""The capacity bound of throughput.py: the sum of every GPU's standalone rate, each GPU type measured alone.

An emulated GPU's standalone rate is one process training the whole model, alone on the machine, at that
GPU's slowdown: the emulation's sleeps cost something per step (docs/emulation.md#what-dilation-costs), so a
GPU at slowdown 10 makes less than a tenth of what one process makes at slowdown 1. throughput.py measures
each type at the config's batch and at the largest per-GPU batch any of the run's rows uses, and takes the
faster (a GPU often makes more samples/s at a larger batch, and a bound must hold for every row; the
emulation does not hold a GPU to its memory, so a batch it could not hold counts too). The bound sums those
rates over the cluster's GPUs. The figure earlier runs used (one
process at slowdown 1 over each GPU's slowdown, at the config's batch, which leaves the sleeps' cost out) is
kept beside it as `ideal`.

    python launch/bench/capacity.py --batches 576,1024     # the bound alone, at the config's batch and these
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (launch/bench is not a package)
from testbed_options import parse_ints  # noqa: E402

from hetpipe.core.config.files import load_config  # noqa: E402
from hetpipe.core.config.overrides import apply_overrides  # noqa: E402
from hetpipe.core.config.schema import ClusterConfig  # noqa: E402

SOLO_STEPS = 12 + 3  # the slowdown-1 process: 3 warm-up steps, 12 measured
TYPE_STEPS = (
    12  # measured steps of each GPU type at the config's batch (1.3 s a step at x28), fewer at larger
)
TYPE_WARMUP = 2


@dataclass(frozen=True)
class Capacity:
    """One measurement of the bound: the slowdown-1 rate, each GPU type's standalone rate per batch, sums."""

    solo_rate: float  # one process at slowdown 1, the config's batch, samples/s
    per_batch: Mapping[str, Mapping[int, float]]  # each GPU type alone at its slowdown: batch -> samples/s
    total: float  # sum over the GPUs of their type's best standalone rate
    ideal: float  # sum over the GPUs of solo_rate / slowdown

    def per_type(self) -> dict[str, float]:
        """Each type's standalone rate: its fastest batch's."""
        return best_rates(self.per_batch)

    def describe(self) -> str:
        types = "; ".join(
            f"{name} " + ", ".join(f"{rate:.0f} at {b}" for b, rate in rates.items())
            for name, rates in self.per_batch.items()
        )
        return (
            f"capacity {self.total:.0f} samples/s: each GPU type alone at its slowdown ({types}), the best "
            f"batch summed over the GPUs; one process at slowdown 1 {self.solo_rate:.0f}, over each GPU's "
            f"slowdown {self.ideal:.0f} (no cost for the emulation's sleeps, {self.ideal / self.total:.2f}x)"
        )

    def record(self) -> dict[str, object]:
        return {
            "total": round(self.total, 1),
            "ideal": round(self.ideal, 1),
            "solo_rate": round(self.solo_rate, 1),
            "per_type": {name: round(rate, 1) for name, rate in self.per_type().items()},
            "per_batch": {
                name: {str(b): round(rate, 1) for b, rate in rates.items()}
                for name, rates in self.per_batch.items()
            },
        }


def best_rates(per_batch: Mapping[str, Mapping[int, float]]) -> dict[str, float]:
    """Each type's standalone rate: that of its fastest batch."""
    return {name: max(rates.values()) for name, rates in per_batch.items()}


def summed(
    devs: Sequence[peers.Device], solo_rate: float, per_batch: Mapping[str, Mapping[int, float]]
) -> Capacity:
    """The bound from the measured rates: each GPU counts its type's best standalone rate once."""
    missing = sorted(t for t in {d.gpu_type for d in devs} if not per_batch.get(t))
    if missing:
        raise ValueError(f"no standalone rate for GPU type(s) {', '.join(missing)}: measure every type")
    best = best_rates(per_batch)
    return Capacity(
        solo_rate,
        {name: dict(rates) for name, rates in per_batch.items()},
        sum(best[d.gpu_type] for d in devs),
        sum(solo_rate / d.slowdown for d in devs),
    )


def one_per_type(devs: Sequence[peers.Device]) -> list[peers.Device]:
    """The first GPU of each type, in config order: whose slowdown stands for the type's."""
    seen: dict[str, peers.Device] = {}
    for d in devs:
        seen.setdefault(d.gpu_type, d)
    return list(seen.values())


def steps_at(batch: int, base: int) -> int:
    """Measured steps at `batch`: TYPE_STEPS at the config's batch `base`, fewer at larger batches so each
    batch takes about as long (at least 4)."""
    return max(4, round(TYPE_STEPS * base / batch))


def measure(
    config: ClusterConfig, devs: Sequence[peers.Device], logs: Path, batches: Sequence[int] = ()
) -> Capacity:
    """The slowdown-1 process, then each GPU type alone at its slowdown at the config's batch and each of
    `batches`, one after another (no network)."""
    base = config.train.batch_size
    solo = peers.run_solo(config, base, SOLO_STEPS, logs).rate(3)
    sizes = sorted({base, *batches})
    per_batch = {
        d.gpu_type: {
            b: peers.run_solo(config, b, steps_at(b, base) + TYPE_WARMUP, logs, slowdown=d.slowdown).rate(
                TYPE_WARMUP
            )
            for b in sizes
        }
        for d in one_per_type(devs)
    }
    return summed(devs, solo, per_batch)


@click.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=Path(__file__).resolve().parents[1] / "clusters" / "bench.toml",
    show_default=True,
)
@click.option(
    "--set", "sets", multiple=True, help="Config override SECTION.KEY=VALUE (TOML value), repeatable."
)
@click.option("--batches", default="", help="Per-GPU batches to measure besides the config's, e.g. 576,1024.")
@click.option(
    "--logs", type=click.Path(path_type=Path), default=Path("runs/bench/capacity"), show_default=True
)
def main(config_path: Path, sets: tuple[str, ...], batches: str, logs: Path) -> None:
    """Measure the capacity bound alone, as throughput.py does at the start of each repeat."""
    extra = parse_ints(batches, "batches") if batches else []
    config = apply_overrides(load_config(config_path), list(sets))
    logs.mkdir(parents=True, exist_ok=True)
    print(measure(config, peers.devices(config), logs, extra).describe())


if __name__ == "__main__":
    main()

"""Per-VW work per wave (docs/planning.md#per-vw-work): given each virtual worker's options (its Nm and
minibatch size, the time of one wave at them, whether they fit its GPUs' memory), choose one per VW so that
the VWs' waves take about as long and the cluster does the most samples per second. Pure."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetpipe.core.planning.fit import largest

__all__ = ["Balance", "WorkOption", "balance", "batch_ladder"]

TOLERANCE = 0.01  # estimates within 1% of the best are equal: the one closest to the config's batch wins


@dataclass(frozen=True)
class WorkOption:
    """One way a VW can run a wave: `nm` minibatches of `batch` samples in `wave_s` (steady, alone)."""

    nm: int
    batch: int
    wave_s: float
    over: str = ""  # why it does not fit its GPUs' memory ("" when it fits)

    @property
    def samples(self) -> int:
        return self.nm * self.batch

    @property
    def fits(self) -> bool:
        return not self.over


@dataclass(frozen=True)
class Balance:
    """The chosen option of every VW, the slowest chosen wave, the PS's seconds per wave and the estimate."""

    work: tuple[WorkOption, ...]
    wave_s: float
    ps_s: float
    samples_per_s: float  # every VW's samples per wave / max(the slowest wave, the PS's time per wave)
    held: tuple[tuple[int, WorkOption], ...] = ()  # (VW, the larger option memory refused it at this wave)


def batch_ladder(batch: int) -> tuple[int, ...]:
    """The minibatch sizes a VW may run: multiples of a quarter of the config's batch, from a quarter of it to
    four times it (1 to 4 x batch when it is under 4), the config's own among them."""
    step = max(1, batch // 4)
    return tuple(sorted({*range(step, 4 * batch + 1, step), batch}))


def fine_batches(batch: int) -> tuple[int, ...]:
    """The minibatch sizes below the config's `batch` that a VW which does not hold the model at `batch`
    falls back to, the largest it holds: multiples of a sixteenth of it (every size when it is under 16)."""
    step = max(1, batch // 16)
    return tuple(range(step, batch, step))


def largest_fine_batch(batch: int, holds: Callable[[int], bool]) -> int:
    """The largest of fine_batches(batch) at which `holds` (false from some size up, as memory is), by
    binary search (fit.largest); 0 when not even the smallest."""
    fine = fine_batches(batch)
    k = largest(len(fine), lambda i: holds(fine[i - 1]))
    return fine[k - 1] if k else 0


def _off(option: WorkOption, base_batch: int) -> float:
    """How far an option's batch is from the config's (log2 ratio, 0 at the config's batch)."""
    return abs(math.log2(option.batch / base_batch))


class _Ladder:
    """One VW's fitting options by wave time, with the most work (then the batch nearest the config's, then
    the smaller Nm) among those no slower than each."""

    def __init__(self, options: Sequence[WorkOption], base_batch: int) -> None:
        ordered = sorted((o for o in options if o.fits), key=lambda o: o.wave_s)
        self.times = [o.wave_s for o in ordered]
        self.best: list[WorkOption] = []
        for o in ordered:
            prev = self.best[-1] if self.best else None
            key = (o.samples, -_off(o, base_batch), -o.nm)
            better = prev is None or key > (prev.samples, -_off(prev, base_batch), -prev.nm)
            self.best.append(o if better else prev)  # type: ignore[arg-type]
        self.refused = [o for o in options if not o.fits]

    def within(self, wave_s: float) -> WorkOption | None:
        i = bisect.bisect_right(self.times, wave_s * (1 + 1e-9))
        return self.best[i - 1] if i else None

    def held(self, wave_s: float, chosen: WorkOption) -> WorkOption | None:
        """The option with the most work memory refused among those no slower than `wave_s`, if it is more."""
        larger = [o for o in self.refused if o.wave_s <= wave_s * (1 + 1e-9) and o.samples > chosen.samples]
        return max(larger, key=lambda o: (o.samples, -o.wave_s)) if larger else None


def balance(options: Sequence[Sequence[WorkOption]], ps_s: float, base_batch: int) -> Balance | None:
    """One option per VW (options[v]: VW v's) for the most samples/s by the estimate: each wave time T among
    the options' lets every VW do the most work it can in T; the estimate is the samples of one wave of every
    VW over max(the slowest chosen wave, `ps_s`: the PS link's seconds per wave). Among estimates within
    TOLERANCE of the best: the fewest batch changes (sum of |log2(batch / base_batch)|), then the shorter
    wave. None when a VW has no option that fits."""
    kinds: dict[tuple[WorkOption, ...], _Ladder] = {}
    ladders = [kinds.setdefault(tuple(opts), _Ladder(opts, base_batch)) for opts in options]
    if not ladders or any(not ladder.times for ladder in ladders):
        return None
    floor = max(ladder.times[0] for ladder in ladders)  # every VW must fit one wave in T
    scored: list[tuple[float, float, float, tuple[WorkOption, ...]]] = []
    for t in sorted({t for ladder in kinds.values() for t in ladder.times if t >= floor}):
        work = tuple(ladder.within(t) for ladder in ladders)
        assert all(o is not None for o in work)
        wave = max(o.wave_s for o in work)  # type: ignore[union-attr]
        samples = sum(o.samples for o in work)  # type: ignore[union-attr]
        rate = samples / max(wave, ps_s) if max(wave, ps_s) > 0 else math.inf
        scored.append((rate, sum(_off(o, base_batch) for o in work), wave, work))  # type: ignore[arg-type]
    top = max(s[0] for s in scored)
    rate, _, wave, work = min((s for s in scored if s[0] >= top * (1 - TOLERANCE)), key=lambda s: s[1:3])
    held = tuple(
        (v, found) for v, ladder in enumerate(ladders) if (found := ladder.held(wave, work[v])) is not None
    )
    return Balance(work, wave, ps_s, rate, held)

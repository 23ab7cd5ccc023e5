"""What a candidate plan is (GpuUse, Candidate, the baselines' names), how one is described, and which one
wins (best): by predicted time to target when a convergence calibration prices them, else by samples/s with a
tolerance that favours less staleness. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hetpipe.core.errors import UsageError
from hetpipe.core.pipeline.schedule import get_schedule
from hetpipe.core.planning.plan import Plan, VwPlan

__all__ = [
    "ALLREDUCE",
    "D_TOLERANCE",
    "SYNC_PIPELINE",
    "Candidate",
    "GpuUse",
    "best",
    "first_line",
    "gpu_uses",
    "own_lag",
    "ranked",
    "same_rate",
    "samples_per_wave",
    "seconds_for",
    "slowest_stage_text",
]

D_TOLERANCE = 0.02  # a larger D must predict more than 2% more samples/s to be chosen over a smaller one
# baseline: Horovod/DDP-style data parallelism over the GPUs that hold the whole model
ALLREDUCE = "allreduce"
SYNC_PIPELINE = "sync-pipeline"  # baseline: one GPipe-like pipeline over all GPUs, flushed every minibatch


@dataclass(frozen=True)
class GpuUse:
    """One GPU in a candidate: its peak memory by the memory model of docs/memory.md and what it may use."""

    gpu: str  # "n0:1"
    gpu_type: str
    memory_bytes: int
    limit_bytes: int  # the GPU's memory minus the reserve

    @property
    def fraction(self) -> float:
        return self.memory_bytes / max(self.limit_bytes, 1)


@dataclass(frozen=True)
class Candidate:
    """One way to train on the cluster, with its predicted throughput; `reason` says why it cannot run.

    HetPipe candidates (policy np/ed/hd/explicit) carry the Plan `hetpipe train --plan` runs; the
    baselines (ALLREDUCE, SYNC_PIPELINE) carry none: they show what the user would get instead.
    """

    policy: str
    staleness: int | None  # D; None for the synchronous baselines and for a policy that makes no VWs
    plan: Plan | None
    samples_per_s: float  # predicted for a long run; 0.0 when infeasible
    memory: tuple[GpuUse, ...] = ()
    bottleneck: str = ""  # the stage (or link) that sets the pace
    reason: str = ""  # why it cannot run; "" when it can
    notes: tuple[str, ...] = ()  # what was left out and other facts the table cannot show
    nm: int | None = None
    gate_wait_share: float = 0.0  # WSP: share of stage time blocked at the gate
    ps_utilisation: float = 0.0  # WSP: busy share of the PS link
    comm_share: float = 0.0  # baselines: share of the step spent synchronising
    run_samples_per_s: float = (
        0.0  # WSP: all samples / makespan of the simulated run (fill and drain included)
    )
    schedule: str | None = None  # the pipeline schedule of a hetpipe candidate
    # Samples to the convergence calibration's target (hetpipe.core.planning.convergence.attach_samples): None
    # when not known or not reached; `samples_source` says where the number comes from ("" when no calibration
    # was given).
    samples_to_target: float | None = None
    samples_source: str = ""
    # The cluster's capacity (hetpipe.core.planning.capacity: every GPU's standalone rate, summed; 0.0 when
    # not known) and, for a candidate below CAPACITY_TARGET of it, what bounds it, largest loss first.
    capacity: float = 0.0
    bounds: tuple[str, ...] = ()
    # Whether the prediction assumes [ps] node_aggregation, and the groups of VWs it relays through one
    # process on their node (hetpipe.core.planning.relays; () when it is off or no node holds two VWs wholly).
    node_aggregation: bool = False
    relayed: tuple[tuple[int, ...], ...] = ()
    # [train] freeze: (wave, layers frozen, samples/s predicted) at each freeze point, the plan unchanged
    # (hetpipe.core.planning.freeze_gain); () without freezing, and for a candidate not simulated
    after_freeze: tuple[tuple[int, int, float], ...] = ()
    # [train] freeze_cache_mib: the same once each point's frozen outputs come from the cache, which holds a
    # VW's samples after one epoch of the training set from the point on (`epoch_samples`; 0: not known, the
    # cache not priced)
    cached_after_freeze: tuple[tuple[int, int, float], ...] = ()
    epoch_samples: int = 0
    # samples/s predicted with every PS link at half its speed (headroom.HEADROOM), for a candidate tied with
    # the best on D, local staleness and samples/s; the tie goes to the one keeping more (0.0: not computed)
    headroom_samples_per_s: float = 0.0

    @property
    def feasible(self) -> bool:
        return not self.reason

    @property
    def runnable(self) -> bool:
        """A plan `hetpipe train --plan` can run."""
        return self.feasible and self.plan is not None

    @property
    def label(self) -> str:
        if self.staleness is None:
            return self.policy
        return (
            f"{self.policy} {self.schedule} D={self.staleness}"
            if self.schedule
            else f"{self.policy} D={self.staleness}"
        )

    @property
    def capacity_share(self) -> float | None:
        """Predicted samples/s over the cluster's capacity (None when the capacity is not known)."""
        return self.samples_per_s / self.capacity if self.capacity > 0 else None

    @property
    def gpus_used(self) -> int:
        return len(self.memory)

    @property
    def time_to_target_s(self) -> float | None:
        """Predicted seconds to the calibration's target: samples to target at samples/s, each freeze point's
        samples from its wave on at its rate, and with the cache, from an epoch later, at that rate (None
        when unknown)."""
        if self.samples_to_target is None or not self.samples_per_s > 0:
            return None
        return seconds_for(self.samples_to_target, self.rate_segments())

    def rate_segments(self) -> list[tuple[float, float]]:
        """(first sample, samples/s) of each stretch of the run: the plan's rate, each freeze point's, and
        the cache's an epoch after each point (until the next point)."""
        segments = [(0.0, self.samples_per_s)]
        per_wave = samples_per_wave(self.plan) if self.plan is not None else 0
        if not per_wave:
            return segments
        cached = dict(((w, n), r) for w, n, r in self.cached_after_freeze)
        points = list(self.after_freeze)
        for i, (wave, layers, rate) in enumerate(points):
            start = float(wave * per_wave)
            end = points[i + 1][0] * per_wave if i + 1 < len(points) else math.inf
            segments.append((start, rate))
            warm = start + self.epoch_samples
            if (wave, layers) in cached and self.epoch_samples and warm < end:
                segments.append((warm, cached[(wave, layers)]))
        return segments

    @property
    def peak(self) -> GpuUse | None:
        """The fullest GPU (largest share of its usable memory)."""
        return max(self.memory, key=lambda u: (u.fraction, u.gpu), default=None)


def samples_per_wave(plan: Plan) -> int:
    """Samples a wave trains over every VW of `plan`."""
    return sum(vw.nm * vw.batch(plan.batch_size) for vw in plan.vws)


def seconds_for(samples: float, segments: Sequence[tuple[float, float]]) -> float:
    """Seconds to train `samples` samples over stretches (first sample, samples/s), in order, the first at
    sample 0."""
    seconds = 0.0
    for i, (start, rate) in enumerate(segments):
        end = min(samples, segments[i + 1][0] if i + 1 < len(segments) else math.inf)
        if end > start:
            seconds += (end - start) / rate
    return seconds


def best(candidates: Sequence[Candidate]) -> Candidate:
    """The runnable candidate with the shortest predicted time to target when the candidates carry samples to
    target (a convergence calibration, hetpipe.core.planning.convergence): samples to target / samples/s, ties
    to the smaller D, then the one listed first. Without one, the highest predicted samples/s; but staleness
    costs convergence, so among those within D_TOLERANCE of the highest the smallest D wins, then the least
    local staleness (own_lag), then the higher rate, then the higher rate on PS links at half speed
    (headroom_samples_per_s: of two plans equal on the links as measured, the one a slower link holds back
    less), then the one listed first.

    Baselines are not runnable by hetpipe, so they never win here; `explain` says when one predicts more.
    UsageError when nothing is runnable, with every reason.
    """
    runnable = [c for c in candidates if c.runnable]
    if not runnable:
        reasons = "\n".join(f"  {c.label}: {c.reason}" for c in candidates if c.reason)
        raise UsageError(
            f"no plan fits this cluster:\n{reasons}\n  lower batch_size, use a smaller model, "
            "or add GPUs with more memory"
        )
    return ranked(candidates)[0]


def ranked(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates in the order `best` chooses among them, best first: the runnable ones (those timed to
    target first, by time to target, smaller D, listing; then those within D_TOLERANCE of the highest
    samples/s, by D, own_lag, samples/s, headroom, listing; then the rest by samples/s, D, listing); then the
    baselines and other candidates hetpipe does not run, by samples/s; then the infeasible ones as listed."""
    index = {id(c): i for i, c in enumerate(candidates)}
    runnable = [c for c in candidates if c.runnable]
    top = max((c.samples_per_s for c in runnable), default=0.0)
    timed = any(c.time_to_target_s is not None for c in runnable)

    def key(c: Candidate) -> tuple:
        at = index[id(c)]
        if not c.feasible:
            return (4, at)
        if not c.runnable:
            return (3, -c.samples_per_s, at)
        if c.time_to_target_s is not None:
            return (0, c.time_to_target_s, c.staleness or 0, at)
        if not timed and c.samples_per_s >= top * (1 - D_TOLERANCE):
            return (1, c.staleness or 0, own_lag(c.plan), -same_rate(c), -c.headroom_samples_per_s, at)
        return (2, -c.samples_per_s, c.staleness or 0, at)

    return sorted(candidates, key=key)


def same_rate(c: Candidate) -> float:
    """Its samples/s to 9 significant digits: rates that differ only by rounding in the simulation (two plans
    both bound by the same compute) tie."""
    return float(f"{c.samples_per_s:.9g}")


def own_lag(plan: Plan | None) -> int:
    """A plan's local staleness: the own minibatches whose updates the forward of a wave's first minibatch
    misses at a VW's first stage, past the pipe's fill (ScheduleKind.own_lag, read off the schedule's lists);
    the most over the VWs (0 for a baseline)."""
    if plan is None:
        return 0
    kind = get_schedule(plan.schedule)
    return max(kind.own_lag(len(vw.stages), vw.nm) for vw in plan.vws)


def gpu_uses(vw: VwPlan) -> tuple[GpuUse, ...]:
    """Each GPU of a VW with its peak memory and what it may use."""
    return tuple(GpuUse(s.gpu, s.gpu_type, s.memory_bytes, s.memory_limit_bytes) for s in vw.stages)


def slowest_stage_text(vw: VwPlan, v: int, prefix: str) -> str:
    """The VW's slowest stage in words: its GPU, layers, time per minibatch and transfer share."""
    j = max(range(len(vw.stages)), key=lambda i: vw.stages[i].time_s)
    s = vw.stages[j]
    where = f"{prefix}{v} " if prefix else ""
    comm = (s.recv_s + s.send_s) / s.time_s if s.time_s else 0.0
    transfers = f", {comm:.0%} transfers" if comm >= 0.005 else ""
    return (
        f"{where}stage {j} {s.gpu} ({s.gpu_type}) layers {s.start}-{s.stop - 1}: "
        f"{s.time_s:.3g} s/minibatch{transfers}"
    )


def first_line(exc: Exception) -> str:
    """The first line of an error's message (what a table cell or note shows)."""
    return str(exc).split("\n")[0]

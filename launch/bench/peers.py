"""What users would run instead of hetpipe, on the same emulated GPUs: torch DDP and one torch pipeline.

Each peer is a group of spawned processes (hetpipe.core.runs.procs.ChildGroup), one per emulated GPU, under
the emulation hetpipe's own stages get (docs/emulation.md): one torch thread per process, and every
block of compute - forward with the loss, backward, optimizer step - stretched by
hetpipe.core.hardware.emulate.Dilator to the GPU's slowdown, the same slowdowns
hetpipe.core.hardware.emulate.slowdowns gives hetpipe's stages. Communication (gloo all-reduce, send/recv) is
not stretched, as in hetpipe (link emulation is off). Given a testbed topology (hetpipe.core.runs.testbed;
docs/testbed.md), each rank enters its GPU's node's network namespace first thing (setns in the spawned child,
before any socket or thread) and gloo binds to the node's shaped veth, so the peers' traffic crosses the same
shaped links as hetpipe's.

- DDP: torch DistributedDataParallel (gloo), synchronous, one replica per GPU that can hold the whole
  model (memory rule: `whole_model_bytes`), same data shards and seeded minibatches as hetpipe's virtual
  workers. Either every GPU one minibatch of the same size per step (a step waits for the slowest GPU), or,
  as heterogeneity-aware DDP (LB-BSP, Poplar) does, a global batch split in proportion to each GPU's speed
  (`speed_batches`), each rank's loss scaled by its share (`rank_loss`) so the update is the gradient of
  the whole global batch's mean loss.
- Pipeline: one torch.distributed.pipelining pipeline over all GPUs (Schedule1F1B, or ScheduleGPipe),
  a flush and one optimizer step per minibatch of n_micro microbatches, split by hetpipe's partitioner.

The parent reads the ranks' step end times; `steady_rate` turns them into samples/s after warm-up. This
file does not run hetpipe (throughput.py does) and does not pick settings (the scripts sweep them).
"""

from __future__ import annotations

import datetime
import math
import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetpipe.compute import data as datalib
from hetpipe.compute.build import dataset_of, model_of, start_from_init
from hetpipe.compute.heap import keep_freed_memory
from hetpipe.compute.optim import make_optimizer
from hetpipe.compute.profiler import cached_profile
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.config.serialize import pack_config, unpack_config
from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.core.hardware.emulate import Dilator, cpu_cores, device_dilator, gpu_speeds, slowdowns
from hetpipe.core.planning.memory import PLAIN, format_bytes, stage_memory
from hetpipe.core.planning.partition import best_order_and_nm
from hetpipe.core.planning.profile import ModelProfile
from hetpipe.core.runs.procs import ChildFailed, ChildGroup, free_port
from hetpipe.core.runs.testbed import NS_IFNAME, Topology
from hetpipe.models import build_stage

__all__ = [
    "SPLIT_BY",
    "Device",
    "PeerRun",
    "PipelineLayout",
    "ddp_members",
    "ddp_subsets",
    "devices",
    "loss_weight",
    "model_profile",
    "pipeline_layout",
    "proportional_split",
    "rank_loss",
    "run_ddp",
    "run_pipeline",
    "run_solo",
    "speed_batches",
    "steady_rate",
    "whole_model_bytes",
]

_GIB = 2**30
_INIT_TIMEOUT_S = 300.0


# ---------------------------------------------------------------------------------------------- devices


@dataclass(frozen=True)
class Device:
    """One emulated GPU: its reference ("n0:1"), type, relative speed, memory and slowdown."""

    gpu: str
    gpu_type: str
    speed: float
    memory_bytes: int
    slowdown: float


def devices(config: ClusterConfig) -> list[Device]:
    """Every GPU of the cluster, in config order, with the slowdown hetpipe's stages get.

    Slowdowns come from hetpipe.core.hardware.emulate.slowdowns over all the cluster's GPUs, as the launcher
    computes them over its virtual workers' GPUs (the same set when the VWs use every GPU); 1.0 without
    emulation.
    """
    speeds = gpu_speeds(config)
    slow = (
        slowdowns(speeds, cpu_cores(), config.emulation.time_scale)
        if config.emulation.enabled
        else dict.fromkeys(speeds, 1.0)
    )
    out = []
    for ref in config.all_gpus():
        kind = config.gpu(ref)
        out.append(Device(str(ref), kind.name, kind.speed, int(kind.memory_gib * _GIB), slow[str(ref)]))
    return out


def model_profile(
    config: ClusterConfig, batch: int, cache_dir: str | Path, *, refresh: bool = False
) -> ModelProfile:
    """The model's per-layer profile at `batch` on this CPU (one thread), cached in cache_dir (refresh:
    measured again and the cache entry replaced)."""
    torch.set_num_threads(1)
    return cached_profile(
        model_of(config), batch, "cpu", cache_dir, optimizer=config.train.optimizer, refresh=refresh
    )


# ---------------------------------------------------------------------------------------------- DDP members


def whole_model_bytes(profile: ModelProfile) -> int:
    """Memory one data-parallel replica needs, by hetpipe's memory model (hetpipe.core.planning.memory,
    docs/memory.md).

    The whole model as a single stage with one minibatch in flight and no stashed weights: weights +
    gradients + optimizer state + saved activations + input buffer + the largest layer's working memory.
    DDP's gradient buckets are not counted (with gradient_as_bucket_view they are the gradients), so the
    rule errs towards letting a GPU in.
    """
    return stage_memory(profile.layers, 0, 1, PLAIN, input_bytes=profile.input_bytes)


def ddp_members(devs: Sequence[Device], need_bytes: int) -> tuple[list[Device], list[Device]]:
    """(GPUs whose memory holds `need_bytes`, GPUs left out), each in the given order."""
    fit = [d for d in devs if d.memory_bytes >= need_bytes]
    return fit, [d for d in devs if d.memory_bytes < need_bytes]


def ddp_subsets(fit: Sequence[Device]) -> dict[str, list[Device]]:
    """The GPU sets worth trying for synchronous DDP: all that fit, and the fastest types only.

    A synchronous step waits for the slowest replica, so dropping the slowest type can be faster:
    for each speed s among the members, the set of members at least as fast as s. Named "fit" (all)
    and "speed>=S" for the smaller ones.
    """
    if not fit:
        return {}
    out = {"fit": list(fit)}
    for speed in sorted({d.speed for d in fit}, reverse=True)[:-1]:
        out[f"speed>={speed:g}"] = [d for d in fit if d.speed >= speed]
    return out


# ---------------------------------------------------------------------------------------------- batch split

# What speed_batches splits by, for the rows' descriptions: the emulated GPU's speed, which is the config's
# gpu_types speed (each GPU's slowdown is fastest speed / its speed x time_scale; all 1 without emulation).
SPLIT_BY = "split by speed (1/slowdown, from the config's gpu_types speeds)"


def proportional_split(global_batch: int, speeds: Sequence[float]) -> list[int]:
    """Per-rank batches in proportion to `speeds` that sum to exactly `global_batch`, each at least 1.

    Each rank gets the floor of its quota (global_batch x speed / total), at least 1; the samples still
    missing go one each to the largest remainders (ties: the faster rank, then the earlier one); samples
    over (from the minimum of 1) come back one each from the ranks most above their quota that keep 1.
    """
    n = len(speeds)
    if n == 0:
        raise UsageError("a batch split needs at least one GPU")
    if not all(math.isfinite(s) and s > 0 for s in speeds):
        raise UsageError(f"speeds {list(speeds)}: every GPU's speed must be a number > 0")
    if global_batch < n:
        raise UsageError(
            f"a global batch of {global_batch} cannot give each of {n} GPUs a sample: use at least {n}"
        )
    total = sum(speeds)
    quota = [global_batch * s / total for s in speeds]
    out = [max(1, math.floor(q)) for q in quota]
    while sum(out) < global_batch:
        out[max(range(n), key=lambda r: (quota[r] - out[r], speeds[r], -r))] += 1
    while sum(out) > global_batch:
        over = [r for r in range(n) if out[r] > 1]
        out[max(over, key=lambda r: (out[r] - quota[r], -speeds[r], r))] -= 1
    return out


def speed_batches(members: Sequence[Device], global_batch: int) -> list[int]:
    """`global_batch` split over `members` by their emulated speed, 1/slowdown (SPLIT_BY), so that every
    rank's step takes about as long."""
    return proportional_split(global_batch, [1.0 / d.slowdown for d in members])


def loss_weight(batch: int, world: int, global_batch: int) -> float:
    """The factor on a rank's mean loss over its `batch` samples that makes DDP's all-reduce (the mean of the
    `world` ranks' gradients) the gradient of the mean loss over all `global_batch` samples:
    batch x world / global_batch (1.0 when every rank has global_batch / world)."""
    if min(batch, world, global_batch) < 1:
        raise UsageError(f"batch {batch}, world {world}, global batch {global_batch}: each must be >= 1")
    return batch * world / global_batch


def rank_loss(loss: torch.Tensor, batch: int, world: int, global_batch: int) -> torch.Tensor:
    """The loss a DDP rank backpropagates: its mean loss x loss_weight (unchanged, not even multiplied, when
    the weight is 1)."""
    weight = loss_weight(batch, world, global_batch)
    return loss if weight == 1.0 else loss * weight


# ---------------------------------------------------------------------------------------------- pipeline plan


@dataclass(frozen=True)
class PipelineLayout:
    """One pipeline over `gpus` in stage order with `split` layers per stage; `bottleneck_s` predicted."""

    gpus: tuple[Device, ...]
    split: tuple[int, ...]
    bottleneck_s: float


def pipeline_layout(
    devs: Sequence[Device], profile: ModelProfile, link_gbps: float | Callable[[str, str], float] = 27.0
) -> PipelineLayout:
    """Order and time-balanced split of one synchronous pipeline over all `devs`, by hetpipe's partitioner.

    `profile` is the model at the pipeline's microbatch size; each GPU's times are the profile's times its
    slowdown (what the Dilator makes of them). The 1F1B schedule keeps at most k - j microbatches on stage j,
    which is the memory model's nm = k, without weight stashing (one weight version: the pipeline flushes
    before its optimizer step). link_gbps: gloo loopback (~3.4 GB/s measured,
    docs/emulation.md#measured-limits), or the Gbit/s between two GPUs (e.g. a testbed's shaped links between
    nodes).
    """
    by_type: dict[str, ModelProfile] = {}
    for d in devs:
        key = f"{d.gpu_type}@{d.slowdown:.6g}"
        by_type.setdefault(key, profile.scaled(key, d.slowdown))
    gpus = [(d.gpu, f"{d.gpu_type}@{d.slowdown:.6g}", d.memory_bytes) for d in devs]
    link = link_gbps if callable(link_gbps) else (lambda a, b: link_gbps)
    plan = best_order_and_nm(by_type, gpus, link, len(devs), rule=PLAIN.with_nm(len(devs)))
    ordered = {d.gpu: d for d in devs}
    return PipelineLayout(tuple(ordered[s.gpu] for s in plan.stages), plan.split, plan.bottleneck_s)


# ---------------------------------------------------------------------------------------------- results


@dataclass
class PeerRun:
    """What one peer run reports: per-step end times (Unix s) of the reporting rank and per-rank stats."""

    system: str
    setting: dict[str, Any]
    gpus: list[str]
    samples_per_step: int
    ends: list[float]
    start: float  # Unix time of the first step's start (after every process is up)
    losses: list[float] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)  # offline scores of snapshots: t, step, metrics
    ranks: list[dict[str, Any]] = field(default_factory=list)  # compute_s, slept_s per rank

    def rate(self, warmup: int) -> float:
        return steady_rate(self.ends, self.samples_per_step, warmup)


def steady_rate(ends: Sequence[float], samples_per_step: int, warmup: int) -> float:
    """Samples/s from the end of step `warmup - 1` to the end of the last step (steps after warm-up)."""
    if warmup < 1 or len(ends) < warmup + 1:
        raise UsageError(
            f"{len(ends)} steps leave nothing to measure after {warmup} warm-up steps: "
            "run more steps or lower the warm-up"
        )
    window = ends[-1] - ends[warmup - 1]
    return (len(ends) - warmup) * samples_per_step / window


# ---------------------------------------------------------------------------------------------- emulation


class _HeldBlock:
    """A Dilator block opened in one place and closed in another (start in the loop, end in a DDP hook)."""

    def __init__(self, dilator: Dilator, name: str) -> None:
        self.dilator, self.name = dilator, name
        self._open: AbstractContextManager[None] | None = None

    def start(self) -> None:
        self._open = self.dilator.compute(self.name)
        self._open.__enter__()

    def end(self) -> None:
        """Close the block (measure it and sleep); a second call does nothing."""
        block, self._open = self._open, None
        if block is not None:
            block.__exit__(None, None, None)


def _ddp_comm_hook(backward: _HeldBlock) -> Callable[[Any, dist.GradBucket], torch.futures.Future]:
    """DDP's default all-reduce, but the last bucket first ends (dilates) the backward block.

    DDP waits for its all-reduces inside loss.backward(), so dilating around backward() would stretch
    communication too. The bucket that becomes ready last holds the first layers' gradients: when its
    hook runs the backward compute is done, so the block ends there, before that bucket's all-reduce.
    Earlier buckets' all-reduces overlap the sleep, as they would overlap the rest of a slower GPU's
    backward (slightly generous to DDP: they also overlap the stretch of the layers before them).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):  # unannotated: DDP rejects the string annotations `from __future__` makes
        if bucket.is_last():
            backward.end()
        return allreduce_hook(state, bucket)

    return hook


def _dilate_stage(stage: Any, dilator: Dilator) -> None:
    """Stretch a torch.distributed.pipelining stage's forward and backward chunks (not its send/recv)."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_chunk(*args: Any, **kwargs: Any) -> Any:
        with dilator.compute("F"):
            return forward(*args, **kwargs)

    def backward_chunk(*args: Any, **kwargs: Any) -> Any:
        with dilator.compute("B"):
            return backward(*args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_chunk, backward_chunk


# ---------------------------------------------------------------------------------------------- jobs


@dataclass(frozen=True)
class _Job:
    """One process of a peer (picklable, passed to a spawned child)."""

    kind: str  # "ddp" | "pipeline" | "solo"
    packed_config: bytes  # hetpipe.core.config.pack_config
    rank: int
    world: int
    port: int
    slowdown: float
    batch: int  # DDP and solo: this GPU's minibatch; pipeline: microbatch
    steps: int
    n_micro: int = 1  # pipeline: microbatches per minibatch
    split: tuple[int, ...] = ()  # pipeline: layers per stage
    schedule: str = "1f1b"  # pipeline: "1f1b" | "gpipe"
    snapshot_every: int = 0  # DDP: rank 0 keeps the weights every this many steps (0: never), scored after
    lr: float | None = None  # None: the config's
    deadline_s: float = 0.0  # DDP: stop after the step that ends this long after the start (0: run all steps)
    netns: str = ""  # testbed: the network namespace of this rank's node ("": stay where the parent is)
    master: str = "127.0.0.1"  # rendezvous host: rank 0's address
    global_batch: int = 0  # DDP: the samples of all ranks in one step (0: batch x world, every rank alike)


def _init_group(job: _Job) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{job.master}:{job.port}",
        rank=job.rank,
        world_size=job.world,
        timeout=datetime.timedelta(seconds=_INIT_TIMEOUT_S),
    )


def _optimizer(config: ClusterConfig, params: list[torch.nn.Parameter], lr: float | None) -> Any:
    t = config.train
    return make_optimizer(params, t.optimizer, t.lr if lr is None else lr, t.momentum, t.weight_decay)


def _fine_tuned(module: torch.nn.Module, config: ClusterConfig) -> torch.nn.Module:
    """A peer's model (or stage) as hetpipe's starts: from [model] init's state, and with [train] freeze's
    layers frozen (no gradient, eval mode). A peer has no waves, so it freezes them from its first step; a
    freeze point after wave 1 is refused."""
    start_from_init(module, config)
    late = [(wave, layers) for wave, layers in config.train.freeze if wave > 1]
    if late:
        raise UsageError(
            f"train.freeze {[list(p) for p in late]}: the peers freeze from their first step only; freeze "
            "from wave 1 for a benchmark with peers"
        )
    frozen = max((layers for _, layers in config.train.freeze), default=0)
    for name, child in module.named_children():  # named by their global layer index (build_stage)
        if int(name) < frozen:
            child.eval()
            child.requires_grad_(False)
    return module


def _ddp_main(job: _Job, report: Callable[[dict[str, Any]], None]) -> None:
    from torch.nn.parallel import DistributedDataParallel

    config = unpack_config(job.packed_config)
    spec, data = model_of(config), dataset_of(config)
    _init_group(job)
    model = DistributedDataParallel(_fine_tuned(build_stage(spec, 0, spec.num_layers), config))  # as W_0
    dilator = device_dilator(job.slowdown)
    backward = _HeldBlock(dilator, "B")
    model.register_comm_hook(None, _ddp_comm_hook(backward))
    optimizer = _optimizer(config, list(model.parameters()), job.lr)
    indices = datalib.shard_indices(len(data.train.y), job.world, job.rank, config.seed)
    ends, losses, snapshots = [], [], []
    dist.barrier()
    start = time.time()
    for step in range(job.steps):
        x, y = datalib.minibatch(data.train.x, data.train.y, indices, job.batch, config.seed, step)
        with dilator.compute("F"):
            loss = spec.loss(model(x), y)
            weighted = rank_loss(loss, job.batch, job.world, job.global_batch or job.batch * job.world)
        backward.start()
        weighted.backward()
        backward.end()  # normally already ended by the comm hook
        with dilator.compute("S"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        ends.append(time.time())
        losses.append(float(loss.detach()))
        if job.rank == 0 and job.snapshot_every and (step + 1) % job.snapshot_every == 0:
            snapshots.append(
                (ends[-1], step + 1, {k: v.detach().clone() for k, v in model.module.state_dict().items()})
            )
        if job.deadline_s and _stop_all(job.rank == 0 and ends[-1] - start >= job.deadline_s):
            break
    evals = _score(spec, snapshots, data, config.train.eval_samples) if snapshots else []
    report(
        {
            "rank": job.rank,
            "ends": ends,
            "start": start,
            "losses": losses,
            "evals": evals,
            "compute_s": dilator.compute_s,
            "slept_s": dilator.slept_s,
        }
    )
    dist.destroy_process_group()


def _stop_all(stop: bool) -> bool:
    """Whether any rank wants to stop (rank 0 decides by the clock; all must run the same steps)."""
    flag = torch.tensor([1.0 if stop else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _score(
    spec: Any, snapshots: list[tuple[float, int, dict[str, torch.Tensor]]], data: Any, max_samples: int = 0
) -> list[dict[str, Any]]:
    """Test metrics of each kept weight version on the first `max_samples` held-out samples (0: all; hetpipe's
    train.eval_samples, as its own scores use), after training (not timed)."""
    from hetpipe.compute.evaluate import evaluate

    return [
        {"t": t, "step": step, **evaluate(spec, state, data, max_samples=max_samples)}
        for t, step, state in snapshots
    ]


def _pipeline_main(job: _Job, report: Callable[[dict[str, Any]], None]) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    config = unpack_config(job.packed_config)
    spec, data = model_of(config), dataset_of(config)
    _init_group(job)
    first, last = job.rank == 0, job.rank == job.world - 1
    start_layer = sum(job.split[: job.rank])
    module = _fine_tuned(build_stage(spec, start_layer, start_layer + job.split[job.rank]), config)
    stage = PipelineStage(module, job.rank, job.world, torch.device("cpu"))
    dilator = device_dilator(job.slowdown)
    _dilate_stage(stage, dilator)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with dilator.compute("L"):
            return spec.loss(output, target)

    schedule_cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[job.schedule]
    schedule = schedule_cls(stage, job.n_micro, loss_fn=loss_fn)
    optimizer = _optimizer(config, list(module.parameters()), job.lr)
    indices = datalib.shard_indices(len(data.train.y), 1, 0, config.seed)
    ends, losses, snapshots = [], [], []
    dist.barrier()
    start = time.time()
    for step in range(job.steps):
        x, y = datalib.minibatch(
            data.train.x, data.train.y, indices, job.batch * job.n_micro, config.seed, step
        )
        step_losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        if last:
            schedule.step(*args, target=y, losses=step_losses)
        else:
            schedule.step(*args)
        if optimizer is not None:  # None: a stage of weightless layers only (e.g. just the flatten)
            with dilator.compute("S"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        ends.append(time.time())
        if step_losses:
            losses.append(float(torch.stack(step_losses).detach().mean()))
        if (
            job.snapshot_every and (step + 1) % job.snapshot_every == 0
        ):  # this stage's part, merged by the parent
            # numpy, not tensors: the result queue would pass a tensor's storage by a file descriptor that the
            # parent fetches from this process, which may have exited by then (seen: ConnectionResetError)
            snapshots.append(
                (ends[-1], step + 1, {k: v.detach().numpy().copy() for k, v in module.state_dict().items()})
            )
        if job.deadline_s and _stop_all(job.rank == 0 and ends[-1] - start >= job.deadline_s):
            break
    report(
        {
            "rank": job.rank,
            "ends": ends,
            "start": start,
            "losses": losses,
            "snapshots": snapshots,
            "compute_s": dilator.compute_s,
            "slept_s": dilator.slept_s,
        }
    )
    dist.barrier()
    dist.destroy_process_group()


def _solo_main(job: _Job, report: Callable[[dict[str, Any]], None]) -> None:
    """The whole model on one emulated GPU: plain training steps (forward, loss, backward, step)."""
    config = unpack_config(job.packed_config)
    spec, data = model_of(config), dataset_of(config)
    model = _fine_tuned(build_stage(spec, 0, spec.num_layers), config)
    optimizer = _optimizer(config, list(model.parameters()), job.lr)
    dilator = device_dilator(job.slowdown)
    indices = datalib.shard_indices(len(data.train.y), 1, 0, config.seed)
    ends = []
    start = time.time()
    for step in range(job.steps):
        x, y = datalib.minibatch(data.train.x, data.train.y, indices, job.batch, config.seed, step)
        with dilator.compute("FBS"):
            loss = spec.loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        ends.append(time.time())
    report(
        {
            "rank": 0,
            "ends": ends,
            "start": start,
            "losses": [],
            "compute_s": dilator.compute_s,
            "slept_s": dilator.slept_s,
        }
    )


_MAINS = {"ddp": _ddp_main, "pipeline": _pipeline_main, "solo": _solo_main}


def _child(job: _Job, results: Any) -> None:
    """Child-process entry point: into its node's namespace (testbed), one torch thread, freed memory kept
    (as in hetpipe's stages), run the job, report a failure with its traceback."""
    if job.netns:
        from hetpipe.app.testbed import enter_netns

        enter_netns(job.netns)  # before any socket or thread: gloo's and the result queue's are made after
        os.environ["GLOO_SOCKET_IFNAME"] = NS_IFNAME
    torch.set_num_threads(1)
    keep_freed_memory()
    try:
        _MAINS[job.kind](job, results.put)
    except BaseException as exc:
        results.put(
            {"rank": job.rank, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        )
        raise


# ---------------------------------------------------------------------------------------------- running


def _run(jobs: Sequence[_Job], log_dir: Path, timeout_s: float) -> list[dict[str, Any]]:
    """Start one child per job, collect every rank's report; any failure stops them all and raises."""
    reports: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    with ChildGroup(log_dir) as group:
        results = group.ctx.Queue()
        for job in jobs:
            group.start(f"{job.kind}-r{job.rank}", _child, job, results)
        while len(reports) < len(jobs):
            try:
                msg = results.get(timeout=0.5)
            except queue_mod.Empty:
                bad = group.failed()
                if bad is not None:
                    raise HetpipeError(str(ChildFailed(bad))) from None
                if time.monotonic() > deadline:
                    raise HetpipeError(
                        f"{jobs[0].kind} did not finish in {timeout_s:.0f} s (logs in {log_dir}): "
                        "give it more time or fewer steps"
                    ) from None
                continue
            if "error" in msg:
                raise HetpipeError(
                    f"{jobs[0].kind} rank {msg['rank']} failed: {msg['error']}\n{msg['traceback']}"
                )
            reports[msg["rank"]] = msg
        group.wait()
    return [reports[r] for r in sorted(reports)]


def _placed(jobs: list[_Job], devs: Sequence[Device], testbed: Topology | None) -> list[_Job]:
    """Each rank's job in its GPU's node's namespace, the rendezvous at rank 0's node (no testbed:
    unchanged)."""
    if testbed is None:
        return jobs
    master = testbed.of_gpu(devs[0].gpu).address
    return [
        replace(job, netns=testbed.of_gpu(d.gpu).netns, master=master)
        for job, d in zip(jobs, devs, strict=True)
    ]


def _peer_run(
    system: str,
    setting: dict[str, Any],
    devs: Sequence[Device],
    samples_per_step: int,
    reports: list[dict[str, Any]],
    reporter: int,
) -> PeerRun:
    main = reports[reporter]
    ranks = [
        {"gpu": d.gpu, "compute_s": round(r["compute_s"], 3), "slept_s": round(r["slept_s"], 3)}
        for d, r in zip(devs, reports, strict=True)
    ]
    return PeerRun(
        system,
        setting,
        [d.gpu for d in devs],
        samples_per_step,
        main["ends"],
        min(r["start"] for r in reports),
        main["losses"],
        main.get("evals", []),
        ranks,
    )


def run_ddp(
    config: ClusterConfig,
    members: Sequence[Device],
    batch: int | Sequence[int],
    steps: int,
    log_dir: Path,
    *,
    snapshot_every: int = 0,
    lr: float | None = None,
    deadline_s: float = 0.0,
    timeout_s: float = 900.0,
    testbed: Topology | None = None,
) -> PeerRun:
    """Synchronous DDP over `members` (one replica each), `steps` steps (fewer when deadline_s > 0 runs out
    first) of `batch` per replica, or of batch[r] on rank r (each rank's loss weighted by its share: the
    update is the global batch's mean gradient); with snapshot_every, rank 0 scores its weights every that
    many steps. With a testbed, each rank runs in its GPU's node's namespace."""
    if not members:
        raise UsageError(
            "DDP needs at least one GPU that holds the whole model: give the cluster a GPU type "
            "with more memory_gib, or lower batch_size"
        )
    batches = [batch] * len(members) if isinstance(batch, int) else list(batch)
    if len(batches) != len(members) or min(batches) < 1:
        raise UsageError(f"DDP over {len(members)} GPUs needs {len(members)} batches >= 1, got {batches}")
    port = free_port()
    jobs = [
        _Job(
            "ddp",
            pack_config(config),
            r,
            len(members),
            port,
            d.slowdown,
            b,
            steps,
            snapshot_every=snapshot_every,
            lr=lr,
            deadline_s=deadline_s,
            global_batch=sum(batches),
        )
        for r, (d, b) in enumerate(zip(members, batches, strict=True))
    ]
    reports = _run(_placed(jobs, members, testbed), log_dir, timeout_s)
    setting = {
        "batch": batch if isinstance(batch, int) else batches,
        "global_batch": sum(batches),
        "gpus": len(members),
        "lr": lr if lr is not None else config.train.lr,
    }
    return _peer_run("ddp", setting, members, sum(batches), reports, 0)


def run_pipeline(
    config: ClusterConfig,
    layout: PipelineLayout,
    microbatch: int,
    n_micro: int,
    steps: int,
    log_dir: Path,
    *,
    schedule: str = "1f1b",
    timeout_s: float = 900.0,
    testbed: Topology | None = None,
    snapshot_every: int = 0,
    lr: float | None = None,
    deadline_s: float = 0.0,
) -> PeerRun:
    """One torch.distributed.pipelining pipeline: `steps` minibatches of n_micro x microbatch, flushed each
    (fewer when deadline_s > 0 runs out first). With snapshot_every, every stage keeps its weights every that
    many steps and the parent scores the merged model after the run (a snapshot's time: its last stage's step
    end). With a testbed, each stage runs in its GPU's node's namespace."""
    k = len(layout.gpus)
    if schedule == "1f1b" and n_micro < k:
        raise UsageError(
            f"Schedule1F1B needs at least as many microbatches as stages: n_micro={n_micro} < {k}; "
            f"use n_micro >= {k} or schedule gpipe"
        )
    port = free_port()
    jobs = [
        _Job(
            "pipeline",
            pack_config(config),
            r,
            k,
            port,
            d.slowdown,
            microbatch,
            steps,
            n_micro=n_micro,
            split=layout.split,
            schedule=schedule,
            snapshot_every=snapshot_every,
            lr=lr,
            deadline_s=deadline_s,
        )
        for r, d in enumerate(layout.gpus)
    ]
    reports = _run(_placed(jobs, layout.gpus, testbed), log_dir, timeout_s)
    setting = {
        "schedule": schedule,
        "microbatch": microbatch,
        "n_micro": n_micro,
        "split": list(layout.split),
        "lr": lr if lr is not None else config.train.lr,
    }
    run = _peer_run("pipeline", setting, list(layout.gpus), microbatch * n_micro, reports, k - 1)
    if snapshot_every:
        run.evals = _score(
            model_of(config), _merged_snapshots(reports), dataset_of(config), config.train.eval_samples
        )
    return run


def _merged_snapshots(
    reports: Sequence[Mapping[str, Any]],
) -> list[tuple[float, int, dict[str, torch.Tensor]]]:
    """The whole model at each step every stage kept, its time the latest stage's end of that step."""
    by_step: dict[int, tuple[float, dict[str, torch.Tensor]]] = {}
    counts: dict[int, int] = {}
    for report in reports:
        for t, step, state in report.get("snapshots", []):
            old_t, merged = by_step.get(step, (0.0, {}))
            by_step[step] = (max(old_t, t), {**merged, **{k: torch.from_numpy(v) for k, v in state.items()}})
            counts[step] = counts.get(step, 0) + 1
    return [(t, step, state) for step, (t, state) in sorted(by_step.items()) if counts[step] == len(reports)]


def run_solo(
    config: ClusterConfig,
    batch: int,
    steps: int,
    log_dir: Path,
    *,
    slowdown: float = 1.0,
    timeout_s: float = 600.0,
) -> PeerRun:
    """The whole model on one process (one thread) at `slowdown`: the unit of the capacity bound."""
    job = _Job("solo", pack_config(config), 0, 1, 0, slowdown, batch, steps)
    reports = _run([job], log_dir, timeout_s)
    return PeerRun(
        "solo",
        {"batch": batch, "slowdown": slowdown},
        ["cpu"],
        batch,
        reports[0]["ends"],
        reports[0]["start"],
        ranks=[{"compute_s": reports[0]["compute_s"]}],
    )


def describe_members(fit: Sequence[Device], left_out: Sequence[Device], need_bytes: int) -> Iterator[str]:
    """Lines saying which GPUs DDP uses and why the others are left out."""
    yield (
        f"DDP: a replica needs {format_bytes(need_bytes)} "
        "(hetpipe's memory model, whole model, one minibatch); "
        f"{len(fit)} of {len(fit) + len(left_out)} GPUs hold it"
    )
    for d in left_out:
        yield f"  left out {d.gpu} ({d.gpu_type}, {format_bytes(d.memory_bytes)})"


def predicted_steps(seconds: float, step_s: float, warmup: int, least: int = 5) -> int:
    """Steps for about `seconds` of measurement after `warmup` steps, at least `least` measured."""
    return warmup + max(least, math.ceil(seconds / max(step_s, 1e-6)))


def env_note() -> Mapping[str, Any]:
    """What the measurement ran on: cores, load, versions (for JSON output)."""
    import platform
    import sys

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cores": cpu_cores(),
        "loadavg_1_5_15": [round(v, 2) for v in load],
    }

"""Throughput benchmark: hetpipe vs DDP vs one torch pipeline on the same emulated cluster, in one run.

Per repeat, in this order and under the same emulation (peers.py), one row each:
- hetpipe: the planner's best plan over every GPU (or the config's VWs, --no-planner), run by
  hetpipe.app.train.train;
- hetpipe-fastest (--hetpipe-fastest, on by default when the cluster has more than one GPU type): hetpipe with
  one VW per GPU of the fastest type alone (policy dp on those GPUs; the planner picks Nm and D), at the same
  slowdowns, so the table shows what the slower GPUs add to hetpipe;
- ddp-fit: DDP over every GPU that holds the model, the same batch on every GPU (a step waits for the
  slowest);
- ddp-fastest: DDP over the fastest type that holds the model, the same batch on every GPU;
- ddp-prop: DDP over every GPU that holds the model with the global batch split in proportion to each GPU's
  speed (peers.speed_batches: the emulated speed 1/slowdown, i.e. the config's gpu_types speeds), as
  heterogeneity-aware DDP (LB-BSP, Poplar) does, each rank's loss weighted by its share of the global batch;
- pipeline: one torch.distributed.pipelining pipeline over all GPUs.
Every rate is samples/s after warm-up: hetpipe's from its stage traces (backward ends on each VW's last
stage; warm-up: `warmup_waves`, the waves before the first gate, so a remote VW's start over a slow link is
left out and recorded apart as `start_s`), the peers' from their step end times.

The capacity bound is the sum of the GPUs' standalone rates (capacity.py): samples/s of the whole model on one
process alone at each GPU type's slowdown, the faster of the config's batch and the largest per-GPU batch any
row runs, summed over all GPUs (measured first at the config's batch, and again at the start of every repeat:
the table uses the repeats' median). The earlier figure, one process at slowdown 1 over each GPU's slowdown
(no cost for the emulation's sleeps), is printed and kept in the JSON beside it.
Settings given as lists (--ddp's batches, --micro, --nm, --staleness) are swept once first and the best one
is repeated.

Network: free by default (every process on this machine's loopback, no link costs anything: say so with the
figures). With --testbed every system runs in the shaped-network testbed (root; docs/testbed.md): each node of
the config its own network namespace and address, its egress shaped with tbf at inter_node_gbps x the link
scale (derived, or --testbed-scale); hetpipe as `hetpipe server` + `hetpipe worker`s in the nodes' namespaces,
DDP and the pipeline with each rank in its GPU's node's namespace. The bench first measures every node's
egress (printed against the configured rate) and records it, the scale, and the bytes each node sent in every
run.

    python launch/bench/throughput.py [--config launch/clusters/bench.toml] [--repeats 3] [--seconds 10]
        [--ddp fit@256,fastest@512,prop@1024] [--micro 256x15] [--nm 4,8] [--staleness 0,4]
        [--hetpipe-fastest/--no-hetpipe-fastest] [--out FILE.json]

--ddp takes SET@BATCH[/BATCH..] items: fit@B and fastest@B run B samples per GPU; prop@G splits a global batch
of G samples a step over every GPU that fits, by speed (prop alone: the config's batch x the GPUs that fit,
the global batch of fit at the config's batch).

Sweep first (each listed setting measured once, the best kept), e.g. what chose the defaults:

    python launch/bench/throughput.py --repeats 1 --ddp fit@256/512,fastest@256/512/1024,prop@512/1024 \
        --micro 256x6,256x12,256x15,128x30 --nm 4,8 --staleness 0,4

In the testbed, on the communication-heavy model (the peers' defaults were swept on bench.toml; sweep again):

    python launch/bench/throughput.py --config launch/clusters/bench-vgg.toml --testbed \
        --ddp fit,fastest,prop --micro 64x6 --seconds 60
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import capacity as bound  # noqa: E402  (launch/bench is not a package)
import peers  # noqa: E402
import plots  # noqa: E402
from testbed_options import parse_ints, profile_option, testbed_options  # noqa: E402

from hetpipe.compute.build import VwLayout, dataset_of  # noqa: E402
from hetpipe.core.config.files import load_config  # noqa: E402
from hetpipe.core.config.overrides import apply_overrides  # noqa: E402
from hetpipe.core.config.schema import ClusterConfig  # noqa: E402
from hetpipe.core.errors import HetpipeError  # noqa: E402
from hetpipe.core.planning.profile import ModelProfile  # noqa: E402
from hetpipe.core.planning.simulate import PsNetwork  # noqa: E402
from hetpipe.core.runs.metrics import (  # noqa: E402
    STAGE_PARTS,
    stage_breakdown_ms,
    stage_totals,
    wave_breakdown_ms,
)
from hetpipe.core.runs.testbed import (  # noqa: E402
    LinkScale,
    Topology,
    describe_drift,
    format_nodes,
    plan_topology,
    within,
)

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "clusters" / "bench.toml"
WARMUP_STEPS = (
    1  # peers: the rate starts when the first step ends (DDP builds buckets, pipelining infers shapes)
)
WARMUP_WAVES = 1  # hetpipe, one VW: the rate starts when it finished its first wave (pipeline full)
# The peers' best settings found on the default cluster (sweeps in the module docstring; rerun them for
# another cluster): DDP at hetpipe's batch over every GPU that fits (the baseline), and over the
# fastest type at its best batch; the pipeline at the most microbatches of hetpipe's batch that MNIST-5k's
# 4000 samples allow. DDP split by speed (prop) at 1024 a step: the global batch of the other two DDP rows
# (4 x 256 and 2 x 512 on bench.toml), so the three differ only in how the GPUs share it (not swept).
DEFAULT_DDP = "fit@256,fastest@512,prop@1024"
DDP_SETS = ("fit", "fastest", "prop")
DEFAULT_MICRO = "256x15"
# hetpipe: the planner's plan under Nm caps 4 and 8, the faster one measured kept. The simulator predicts no
# gain beyond Nm 4 (it has no timing noise); measured, Nm 8 buys slack against the jitter of sleeping emulated
# devices (1387 vs 1197 samples/s in one sweep).
DEFAULT_NM = "4,8"
EGRESS_TOLERANCE = (
    0.15  # the testbed's acceptance: every node's measured egress within 15% of its configured rate
)


# ---------------------------------------------------------------------------------------------- configs


# ---------------------------------------------------------------------------------------------- hetpipe


@dataclass(frozen=True)
class HetpipeSetup:
    """hetpipe's VWs, Nm and D for a run; `source` says where they came from, `predicted` its samples/s."""

    vws: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]  # (gpus, layers per stage) per VW
    nm: int
    staleness: int
    source: str
    predicted: float | None
    schedule: str | None = None  # the plan's schedule (None: the config's)
    # each VW's own (Nm, minibatch size) where the plan gives VWs unequal work (docs/wsp.md#per-vw-work); ()
    # every VW at `nm` and the config's batch
    work: tuple[tuple[int, int], ...] = ()
    # what the planner says bounds the plan below 90% of capacity, each with its figure (planning.md#capacity)
    bounds: tuple[str, ...] = ()

    @property
    def layouts(self) -> tuple[VwLayout, ...]:
        work = self.work or ((0, 0),) * len(self.vws)
        return tuple(VwLayout(gpus, split, *w) for (gpus, split), w in zip(self.vws, work, strict=True))

    @classmethod
    def of_plan(
        cls, plan: Any, batch: int, source: str, predicted: float | None, bounds: Sequence[str] = ()
    ) -> HetpipeSetup:
        """A planner's plan (hetpipe.core.planning.plan.Plan) as a setup; `batch`: the config's minibatch size
        (a plan whose VWs all run it at one Nm needs no per-VW work)."""
        vws = tuple((tuple(vw.gpus), tuple(vw.split)) for vw in plan.vws)
        work = tuple((vw.nm, vw.batch(plan.batch_size)) for vw in plan.vws)
        uniform = len(set(work)) == 1 and work[0][1] == batch
        return cls(
            vws,
            plan.vws[0].nm,
            plan.staleness,
            source,
            predicted,
            plan.schedule,
            () if uniform else work,
            tuple(bounds),
        )

    def samples_per_wave(self, batch: int) -> int:
        """Samples all VWs train in one wave each (`batch`: the config's minibatch size)."""
        if not self.work:
            return self.nm * batch * len(self.vws)
        return sum(nm * b for nm, b in self.work)

    def describe(self, row: str) -> str:
        """The setup as the script prints it for `row`: its label, source and prediction, then a line per
        bound the planner names."""
        said = f", predicted {self.predicted:.0f} samples/s" if self.predicted else ""
        return f"{row}: {self.label} ({self.source}{said})" + "".join(f"\n  bound: {b}" for b in self.bounds)

    @property
    def label(self) -> str:
        schedule = f", {self.schedule}" if self.schedule else ""
        own = [f" Nm {nm} x {b}" for nm, b in self.work] if self.work else [""] * len(self.vws)
        return (
            f"{len(self.vws)} VWs "
            + " | ".join(
                "-".join(g) + " " + "/".join(map(str, s)) + o for (g, s), o in zip(self.vws, own, strict=True)
            )
            + (f", Nm={self.nm}" if not self.work else "")
            + f", D={self.staleness}{schedule}"
        )


def planner_links(testbed: Topology | None) -> tuple[float, Callable[[str, str], float], PsNetwork | None]:
    """(the PS's own rate, the link between two GPUs, the node links the PS traffic crosses) as the planner
    should see them: loopback figures on the free network; in the testbed, each node's shaped egress between
    nodes and to or from the PS, its shaped loopback inside a node (its GPUs' own VW traffic to a PS on it
    included)."""
    from hetpipe.core.planning import planner

    if testbed is None:
        return planner.EMULATED_PS_GBPS, lambda a, b: planner.EMULATED_P2P_GBPS, None
    return planner.EMULATED_PS_GBPS, testbed.link_gbps, testbed.ps_network()


def hetpipe_setup(
    config: ClusterConfig,
    profile: ModelProfile,
    use_planner: bool,
    nm: int | None = None,
    staleness: int | None = None,
    testbed: Topology | None = None,
    policies: Sequence[str] | None = None,
) -> HetpipeSetup:
    """The planner's best plan (hetpipe.core.planning.planner) when asked and installed, else the config's own
    VWs.

    `nm` caps the planner's Nm (None: the planner's default cap); `staleness` fixes D (None: the plan's); with
    a testbed the planner sees its shaped links; `policies`: the allocation policies it may use (None: all).
    """
    if use_planner and importlib.util.find_spec("hetpipe.core.planning.planner") is not None:
        from hetpipe.core.planning import planner

        profiles = planner.emulated_profiles(config, profile, peers.cpu_cores())
        ps_gbps, link, network = planner_links(testbed)
        candidates = planner.plan_candidates(
            config,
            profiles,
            ps_gbps=ps_gbps,
            link_gbps=link,
            nm_max=nm,
            ps_network=network,
            d_values=planner.D_VALUES if staleness is None else (staleness,),
            policies=policies,
        )
        if staleness is not None:
            candidates = [c for c in candidates if c.staleness in (None, staleness)]
        top = planner.best(candidates)
        return HetpipeSetup.of_plan(
            top.plan, config.train.batch_size, f"planner: {top.label}", top.samples_per_s, top.bounds
        )
    from hetpipe.compute.build import model_of, vw_layouts

    vws = tuple((lay.gpus, lay.split) for lay in vw_layouts(config, model_of(config)))
    d = config.wsp.staleness if staleness is None else staleness
    return HetpipeSetup(vws, nm or config.wsp.nm, d, "config", None)


def fastest_overrides(config: ClusterConfig, devs: Sequence[peers.Device]) -> list[str]:
    """--set overrides that give `config` one VW per GPU of its fastest type and no other (policy dp on those
    GPUs, listed as explicit VWs) at the slowdowns they have in the whole cluster (emulation.time_scale pinned
    to the whole cluster's: the runtime derives slowdowns from its VWs' GPUs alone); [] when every GPU is of
    one type (the same as hetpipe on all GPUs). A placement with a shard on every node ("local", "spread") is
    set back to one balanced shard when those GPUs all sit on one node: shards on the other nodes would send
    their traffic over the node's link, which one shard on the PS node keeps off it."""
    top = max(d.speed for d in devs)
    fastest = [d for d in devs if d.speed == top]
    if len(fastest) == len(devs):
        return []
    vws = ", ".join(f'{{ gpus = ["{d.gpu}"] }}' for d in fastest)
    pinned = [f"emulation.time_scale={min(d.slowdown for d in devs)!r}"] if config.emulation.enabled else []
    one_node = len({d.gpu.rsplit(":", 1)[0] for d in fastest}) == 1
    placed = ['ps.placement="balanced"', "ps.shards=1"] if config.ps.shard_per_node and one_node else []
    return ['allocation.policy="explicit"', f"virtual_workers=[{vws}]", *pinned, *placed]


def hetpipe_config(
    config: ClusterConfig, setup: HetpipeSetup, waves: int, run_dir: Path, extra: Sequence[str] = ()
) -> ClusterConfig:
    """The config that runs `setup`'s Nm and D for `waves` waves, through --set overrides alone (no
    checkpoints unless `extra` asks); its VWs and splits go to the launcher as layouts (setup.layouts)."""
    schedule = [f'train.schedule="{setup.schedule}"'] if setup.schedule else []
    return apply_overrides(
        config,
        [
            f"wsp.nm={setup.nm}",
            f"wsp.staleness={setup.staleness}",
            f"train.waves={waves}",
            f"train.out_dir={json.dumps(str(run_dir))}",
            'checkpoint.dir=""',
            *schedule,
            *extra,
        ],
    )


def trace_streams(run_dir: Path) -> dict[int, list[float]]:
    """Per VW, the Unix end times (s) of the backward spans on its last stage, in order."""
    last: dict[int, int] = {}
    for path in (run_dir / "trace").glob("vw*-s*.json"):
        vw, stage = (int(part) for part in path.stem[2:].split("-s"))
        last[vw] = max(last.get(vw, -1), stage)
    streams = {}
    for vw, stage in last.items():
        events = json.loads((run_dir / "trace" / f"vw{vw}-s{stage}.json").read_text())["traceEvents"]
        streams[vw] = sorted(
            (e["ts"] + e["dur"]) / 1e6 for e in events if e["ph"] == "X" and e["name"].startswith("B")
        )
    return streams


def trace_start(run_dir: Path) -> float:
    """Unix time (s) of the first span of any stage: when training began, after every process was up."""
    starts = []
    for path in (run_dir / "trace").glob("vw*-s*.json"):
        events = json.loads(path.read_text())["traceEvents"]
        starts += [e["ts"] / 1e6 for e in events if e["ph"] == "X"]
    return min(starts)


def warmup_waves(staleness: int, vws: int) -> int:
    """Waves each VW runs before hetpipe's rate starts. One VW: its first (the pipeline fills). Several: the
    D + 2 waves the gate lets run free (wsp.md#gate), since a fast VW runs them while a slow one still starts
    (over a slow link its registration takes tens of seconds), then stalls at its first gate until the
    slowest VW's first push has arrived; that one-off stall is start-up, not the rate the run keeps."""
    return WARMUP_WAVES if vws == 1 else staleness + 2


def window_rate(
    streams: dict[int, list[float]], batch: int | Mapping[int, int], warmup: int | Mapping[int, int]
) -> float:
    """Samples/s of all VWs together while all of them run: from the latest end of a VW's warm-up to the
    earliest end of a VW's last minibatch, counting the samples every VW finished in between (`batch`,
    `warmup` in minibatches: alike for every VW, or per VW)."""

    def of(value: int | Mapping[int, int], vw: int) -> int:
        return value if isinstance(value, int) else value[vw]

    short = [v for v, s in streams.items() if len(s) <= of(warmup, v) + 1]
    if short:
        raise HetpipeError(
            f"vw {short[0]} finished {len(streams[short[0]])} minibatches, not more than the "
            f"{of(warmup, short[0])} of warm-up: run more waves"
        )
    t0 = max(s[of(warmup, v) - 1] for v, s in streams.items())
    t1 = min(s[-1] for s in streams.values())
    if t1 <= t0:
        raise HetpipeError(
            "one VW finished before another was past its warm-up, so they never ran together: run more waves"
        )
    samples = sum(of(batch, v) * sum(1 for t in s if t0 < t <= t1) for v, s in streams.items())
    return samples / (t1 - t0)


def run_hetpipe(
    config: ClusterConfig, setup: HetpipeSetup, run_dir: Path, testbed: Topology | None = None
) -> tuple[dict[str, Any], float]:
    """One hetpipe training run of `setup` (progress off); (summary, steady samples/s after WARMUP_WAVES
    waves). In a testbed: `hetpipe server` and `hetpipe worker`s in the nodes' namespaces; the summary is then
    the run's wall time and the bytes each node sent. The rate and the summary's `wave_breakdown_ms` (where
    each VW's waves went, by part) come from the stages' traces either way."""
    if testbed is None:
        from hetpipe.app.train import TrainOptions, train

        summary = train(config, TrainOptions(run_dir=run_dir, progress=False, layouts=setup.layouts))
    else:
        from hetpipe.app.testbed_train import train_in_testbed

        run = train_in_testbed(config, testbed, run_dir, layouts=setup.layouts)
        summary = {"wall_s": run.wall_s, "egress_bytes": run.egress_bytes}
    times = {k: t["times_s"] for k, t in stage_totals(run_dir / "trace").items()}
    summary["wave_breakdown_ms"] = wave_breakdown_ms(times, config.train.waves)
    summary["stage_breakdown_ms"] = {
        f"vw{v}-s{j}": parts for (v, j), parts in stage_breakdown_ms(times, config.train.waves).items()
    }
    work = [lay.work(config) for lay in setup.layouts]
    streams = trace_streams(run_dir)
    rate = window_rate(
        streams,
        {v: w.batch for v, w in enumerate(work)},
        {v: warmup_waves(setup.staleness, len(work)) * w.nm for v, w in enumerate(work)},
    )
    # start-up, left out of the rate: from the first span of any stage to the last VW's first minibatch
    summary["start_s"] = round(max(s[0] for s in streams.values()) - trace_start(run_dir), 1)
    return summary, rate


# ---------------------------------------------------------------------------------------------- settings


def fastest_peers(
    config: ClusterConfig,
    devs: Sequence[peers.Device],
    profile: ModelProfile,
    use_planner: bool,
    nms: Sequence[int | None],
    ds: Sequence[int | None],
    capacity: float,
    work: Path,
    testbed: Topology | None = None,
) -> tuple[list[Peer], list[HetpipeSetup]]:
    """The hetpipe-fastest row's settings (fastest_overrides: one VW per GPU of the fastest type), each (Nm
    cap, D) as for hetpipe, their plans printed, and the setups; none, with the reason printed, when all GPUs
    are of one type or no plan fits."""
    overrides = fastest_overrides(config, devs)
    if not overrides:
        print("hetpipe-fastest: every GPU is of one type, so it is hetpipe's own row; left out")
        return [], []
    fast = apply_overrides(config, overrides)
    try:
        options, setups = hetpipe_peers(
            fast, profile, use_planner, nms, ds, capacity, work, testbed, "hetpipe-fastest", ("explicit",)
        )
    except HetpipeError as exc:
        print(f"hetpipe-fastest: left out: {exc}")
        return [], []
    for setup in setups:
        print(setup.describe("hetpipe-fastest"), flush=True)
    return options, setups


def largest_batch(setups: Sequence[HetpipeSetup], wanted: Sequence[tuple[str, list[int]]], base: int) -> int:
    """The largest per-GPU minibatch any row runs: hetpipe's VWs' (a setup without per-VW work runs the
    config's `base`) and DDP's per GPU (fit and fastest; prop splits its global batch, so each GPU runs less
    than the batch it is given)."""
    hetpipe = [b for s in setups for _, b in (s.work or [(s.nm, base)])]
    ddp = [b for name, sizes in wanted if name != "prop" for b in sizes]
    return max([base, *hetpipe, *ddp])


def parse_micro(text: str) -> list[tuple[int, int]]:
    """ "256x12,128x24" -> [(256, 12), (128, 24)]: microbatch x microbatches per minibatch; "none" -> []
    (no pipeline row)."""
    if text.strip().lower() == "none":
        return []
    try:
        pairs = [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise click.BadParameter(f"{text!r}: write MICROBATCHxCOUNT[,...], e.g. 256x12,128x24")
    return [(p[0], p[1]) for p in pairs]


@dataclass
class Peer:
    """One row of the table: a system with one setting and how to run it for about `seconds`; `details`
    collects what each run reports beside its rate (hetpipe: its wave breakdown), in run order."""

    name: str
    setting: str
    run: Callable[[float, Path], float]  # (seconds, log dir) -> samples/s
    details: list[dict[str, Any]] = field(default_factory=list)


def hetpipe_peers(
    config: ClusterConfig,
    profile: ModelProfile,
    use_planner: bool,
    nms: Sequence[int | None],
    ds: Sequence[int | None],
    capacity: float,
    work: Path,
    testbed: Topology | None = None,
    name: str = "hetpipe",
    policies: Sequence[str] | None = None,
) -> tuple[list[Peer], list[HetpipeSetup]]:
    """hetpipe with each (Nm cap, D) asked for, as the row `name` (planned with `policies`, default all);
    each run gets its own run directory under work."""
    options, setups = [], []
    runs = iter(range(10**6))
    for nm in nms:
        for d in ds:
            setup = hetpipe_setup(config, profile, use_planner, nm, d, testbed, policies)
            setups.append(setup)

            details: list[dict[str, Any]] = []

            def run(
                seconds: float, logs: Path, setup: HetpipeSetup = setup, details: list = details
            ) -> float:
                per_wave = setup.samples_per_wave(config.train.batch_size)
                guess = min(setup.predicted or capacity, capacity) * 0.6  # emulated runs fall short of plans
                warmup = warmup_waves(setup.staleness, len(setup.vws))
                waves = warmup + max(5, math.ceil(seconds * guess / per_wave))
                run_dir = work / f"{name}-{next(runs)}"
                try:
                    summary, rate = run_hetpipe(
                        hetpipe_config(config, setup, waves, run_dir), setup, run_dir, testbed
                    )
                except HetpipeError as exc:  # this row's run failed: say why, not a traceback
                    print(f"{name}: the run in {run_dir} failed: {exc}", flush=True)
                    details.append({"run_dir": str(run_dir), "waves": waves, "error": str(exc)})
                    details[-1].update(wave_breakdown_ms={}, stage_breakdown_ms={})
                    return float("nan")
                details.append(
                    {
                        "run_dir": str(run_dir),
                        "waves": waves,
                        "samples_per_s": round(rate, 1),
                        "predicted": setup.predicted,
                        "bounds": list(setup.bounds),
                        "start_s": summary["start_s"],
                        "wave_breakdown_ms": summary["wave_breakdown_ms"],
                        "stage_breakdown_ms": summary["stage_breakdown_ms"],
                    }
                )
                return rate

            options.append(Peer(name, f"{setup.label} [{setup.source}]", run, details))
    return options, setups


def parse_ddp(text: str, default_batch: int, fit_gpus: int = 1) -> list[tuple[str, list[int]]]:
    """ "fit@256,fastest@256/512,prop@1024" -> [("fit", [256]), ("fastest", [256, 512]), ("prop", [1024])]:
    per-GPU batches for fit and fastest, global batches for prop. Without @: fit and fastest the default
    batch, prop the default batch x fit_gpus (the global batch of fit at the default batch)."""
    out = []
    for item in text.split(","):
        name, _, batches = item.strip().partition("@")
        if name not in DDP_SETS:
            raise click.BadParameter(
                f"--ddp {item!r}: the GPU set is fit (every GPU that holds the model) or fastest (the "
                "fastest type that holds it), each at BATCH per GPU, or prop (every GPU that holds it, a "
                "global batch split by speed), e.g. fit@256,fastest@256/512,prop@1024"
            )
        default = default_batch * max(1, fit_gpus) if name == "prop" else default_batch
        out.append((name, parse_ints(batches.replace("/", ","), "batches") if batches else [default]))
    return out


def allreduce_s(param_bytes: int, members: Sequence[peers.Device], testbed: Topology | None) -> float:
    """A ring all-reduce's time over the testbed's shaped links: each rank sends 2 (n - 1) / n of the
    parameters, at one GPU's inside rate when the ranks share a node, else at a node's egress (0 without a
    testbed)."""
    if testbed is None or len(members) < 2:
        return 0.0
    n = len(members)
    one_node = len({testbed.of_gpu(d.gpu).node for d in members}) == 1
    gbps = testbed.shaped_intra_gbps if one_node else testbed.shaped_gbps
    return 2 * (n - 1) / n * param_bytes * 8 / (gbps * 1e9)


def ddp_members_of(name: str, subsets: dict[str, list[peers.Device]]) -> tuple[list[peers.Device], str]:
    """The GPUs of a --ddp set (fit and prop: every GPU that fits; fastest: the fastest type's) and their
    description."""
    key = next((k for k in subsets if k != "fit"), "fit") if name == "fastest" else "fit"
    what = "all that fit" if key == "fit" else "the fastest type, " + key
    return subsets.get(key, []), what


def ddp_batches(name: str, batch: int, members: Sequence[peers.Device]) -> list[int]:
    """Each rank's batch for a --ddp set at `batch`: per GPU for fit and fastest, split by speed for prop
    (none without members: peers.run_ddp says what to change)."""
    if name == "prop" and members:
        if batch < len(members):
            raise click.BadParameter(
                f"--ddp prop@{batch}: a global batch of {batch} cannot give each of the {len(members)} GPUs "
                f"a sample; use prop@{len(members)} or more"
            )
        return peers.speed_batches(members, batch)
    return [batch] * len(members)


def ddp_setting(
    name: str, batch: int, members: Sequence[peers.Device], what: str, batches: Sequence[int]
) -> str:
    """A DDP row's description: its GPUs and how the batch (`batch` from --ddp, `batches` per rank) is
    shared."""
    if name == "prop":
        split = "/".join(map(str, batches))
        return f"{len(members)} GPUs ({what}), global batch {batch} {peers.SPLIT_BY}: {split}"
    return f"{len(members)} GPUs ({what}), batch {batch}/GPU"


def ddp_peers(
    config: ClusterConfig,
    subsets: dict[str, list[peers.Device]],
    wanted: Sequence[tuple[str, list[int]]],
    solo_step_s: float,
    testbed: Topology | None = None,
    param_bytes: int = 0,
) -> list[list[Peer]]:
    """Per GPU set asked for: the DDP settings to try (one per batch); with a testbed, each rank in its node's
    namespace, and its steps' all-reduce counted in how many steps fill the seconds asked for."""
    groups = []
    for name, sizes in wanted:
        members, what = ddp_members_of(name, subsets)
        options = []
        for size in sizes:
            batches = ddp_batches(name, size, members)

            def run(
                seconds: float, logs: Path, members: list[peers.Device] = members, batches: list = batches
            ) -> float:
                slowest = max((b * d.slowdown for b, d in zip(batches, members, strict=True)), default=0.0)
                step_s = solo_step_s * slowest / config.train.batch_size + allreduce_s(
                    param_bytes, members, testbed
                )
                result = peers.run_ddp(
                    config,
                    members,
                    batches,
                    peers.predicted_steps(seconds, step_s, WARMUP_STEPS),
                    logs,
                    testbed=testbed,
                )
                return result.rate(WARMUP_STEPS)

            options.append(Peer(f"ddp-{name}", ddp_setting(name, size, members, what, batches), run))
        groups.append(options)
    return groups


def pipeline_peers(
    config: ClusterConfig,
    devs: list[peers.Device],
    micro: Sequence[tuple[int, int]],
    schedule: str,
    cache: Path,
    testbed: Topology | None = None,
) -> list[Peer]:
    """The pipeline settings to try: one per (microbatch, count), each split for its microbatch (with a
    testbed, for its shaped links, each stage in its node's namespace)."""
    options = []
    n_train = len(dataset_of(config).train.y)
    for microbatch, n_micro in micro:
        if microbatch * n_micro > n_train:
            raise click.BadParameter(
                f"--micro {microbatch}x{n_micro}: a minibatch of {microbatch * n_micro} is more "
                f"than the {n_train} training samples; use fewer or smaller microbatches"
            )
        link = 27.0 if testbed is None else testbed.link_gbps
        layout = peers.pipeline_layout(devs, peers.model_profile(config, microbatch, cache), link)

        def run(
            seconds: float,
            logs: Path,
            layout: peers.PipelineLayout = layout,
            mb: int = microbatch,
            n: int = n_micro,
        ) -> float:
            step_s = layout.bottleneck_s * (n + len(layout.gpus) - 1)
            result = peers.run_pipeline(
                config,
                layout,
                mb,
                n,
                peers.predicted_steps(seconds, step_s, WARMUP_STEPS),
                logs,
                schedule=schedule,
                testbed=testbed,
            )
            return result.rate(WARMUP_STEPS)

        label = f"{len(devs)} stages {'/'.join(map(str, layout.split))}, {n_micro} x {microbatch}, {schedule}"
        options.append(Peer("pipeline", label, run))
    return options


# ---------------------------------------------------------------------------------------------- report


def summarize(values: Sequence[float], digits: int = 1) -> dict[str, float]:
    return {
        k: round(f(values), digits) for k, f in (("median", statistics.median), ("min", min), ("max", max))
    }


def table(rows: list[dict[str, Any]], capacity: float) -> str:
    lines = [f"{'system':<16} {'samples/s':>9} {'min-max':>13} {'eff.':>5} {'hetpipe x':>9}  setting"]
    top = next(r for r in rows if r["system"] == "hetpipe")["samples_per_s"]["median"]
    for row in rows:
        s = row["samples_per_s"]
        lines.append(
            f"{row['system']:<16} {s['median']:>9.0f} {s['min']:>6.0f}-{s['max']:<6.0f} "
            f"{s['median'] / capacity:>5.0%} {top / s['median']:>9.2f}  {row['setting']}"
        )
    lines.append(
        f"{'capacity':<16} {capacity:>9.0f} {'':>13} {1:>5.0%} {top / capacity:>9.2f}  "
        "sum over GPUs of their type's standalone samples/s (alone at its slowdown, best batch)"
    )
    return "\n".join(lines)


def format_breakdown(runs: Sequence[dict[str, Any]]) -> str:
    """Where hetpipe's waves went in its repeats, stage by stage (median over the repeats, ms per wave;
    docs/testbed.md#reading-a-breakdown): the training loop, the parts of the stage's own thread, the rest
    (Python, the data), and, overlapped with them on its PS thread, push and pull."""
    if not runs:
        return "hetpipe: no wave breakdown (no run)"
    lines = ["hetpipe: where each stage's waves went (ms per wave, median of the repeats)"]
    for stage in runs[0]["stage_breakdown_ms"]:
        parts = [r["stage_breakdown_ms"].get(stage, {}) for r in runs]

        def med(part: str, parts: list = parts) -> float:
            return statistics.median(p.get(part, 0.0) for p in parts)

        own = {part: med(part) for part in STAGE_PARTS}
        train = med("train")
        shown = ", ".join(f"{part} {ms:.0f}" for part, ms in own.items() if ms >= 0.5)
        lines.append(
            f"  {stage}: wave {train:.0f} = {shown}, other {train - sum(own.values()):.0f}; PS thread: push "
            f"{med('push'):.0f}, pull {med('pull'):.0f} (parked at the gate {med('parked'):.0f})"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main


@dataclass
class Network:
    """Where the systems run: the free network (testbed None) or the testbed, whose nodes' sent bytes it
    records for every run (system -> one {node: bytes} per run)."""

    testbed: Topology | None = None
    egress: dict[str, list[dict[str, int]]] | None = None

    def run(self, peer: Peer, seconds: float, logs: Path) -> float:
        if self.testbed is None:
            return peer.run(seconds, logs)
        from hetpipe.app.testbed import egress_bytes

        before = egress_bytes(self.testbed)
        rate = peer.run(seconds, logs)
        after = egress_bytes(self.testbed)
        self.egress = self.egress or {}
        self.egress.setdefault(peer.name, []).append({n: after[n] - before[n] for n in after})
        return rate


def speed_drift(config: ClusterConfig, cache: Path, record: dict[str, Any]) -> dict[str, float]:
    """At the end of a testbed run: the CPU profile measured again and set against the one the run's link
    scale came from (LinkScale.drift), printed; for the JSON's testbed record."""
    from hetpipe.app import testbed as tb

    start = LinkScale.from_dict(record["scale_derived"])
    end = tb.derive_link_scale(config, cache, start.efficiency, refresh=True)
    drift = start.drift(end.cpu_step_s, record["scale"])
    print(describe_drift(drift), flush=True)
    return drift


def open_testbed(
    config: ClusterConfig, cache: Path, scale: float | None, probe_s: float, stack: contextlib.ExitStack
) -> tuple[Topology, dict[str, Any]]:
    """Build the testbed for the rest of the run (torn down when `stack` closes), measure every node's egress,
    print it against the configured rate; (topology, its record for the JSON)."""
    from hetpipe.app import testbed as tb

    derived = tb.derive_link_scale(config, cache)
    print(derived.describe() + (f"; --testbed-scale {scale:g} used instead" if scale else ""), flush=True)
    topology = plan_topology(config, f"{os.getpid():x}", scale or derived.scale)
    stack.enter_context(tb.testbed(topology, config))
    measured = tb.probe_egress(topology, probe_s)
    inside = tb.probe_inside(topology, probe_s)
    print(
        f"testbed {topology.run}: egress and inside (loopback) rates measured for {probe_s:g} s per node "
        "(link-level bytes)"
    )
    print(format_nodes(topology, measured, EGRESS_TOLERANCE, inside))
    ok = all(m is None or within(m, topology.shaped_gbps, EGRESS_TOLERANCE) for m in measured.values())
    inside_ok = all(within(inside[n.node], n.inside_gbps, EGRESS_TOLERANCE) for n in topology.nodes)
    print(
        f"every node's egress within {EGRESS_TOLERANCE:.0%} of its configured rate: {'yes' if ok else 'NO'}; "
        f"inside: {'yes' if inside_ok else 'NO'}",
        flush=True,
    )
    record = {
        "scale": topology.scale,
        "scale_derived": derived.to_dict(),
        "scale_given": scale,
        "inter_node_gbps": topology.inter_node_gbps,
        "intra_node_gbps": topology.intra_node_gbps,
        "ps_node": topology.ps_node,
        "egress_within_tolerance": ok,
        "inside_within_tolerance": inside_ok,
        "tolerance": EGRESS_TOLERANCE,
        "nodes": [
            {
                "node": n.node,
                "address": n.address,
                "configured_gbps": n.egress_gbps,
                "measured_gbps": measured[n.node],
                "inside_configured_gbps": n.inside_gbps,
                "inside_measured_gbps": inside[n.node],
            }
            for n in topology.nodes
        ],
    }
    return topology, record


def _best(
    options: list[Peer],
    seconds: float,
    logs: Path,
    sweep: list[dict[str, Any]],
    network: Network | None = None,
) -> Peer:
    """The option with the highest rate when several are given (each measured once), else the only one."""
    if len(options) == 1:
        return options[0]
    network = network or Network()
    scored = []
    for option in options:
        rate = network.run(option, seconds, logs)
        sweep.append({"system": option.name, "setting": option.setting, "samples_per_s": round(rate, 1)})
        print(f"  sweep {option.name:<15} {rate:>8.0f} samples/s  {option.setting}", flush=True)
        scored.append((rate, option))
    return max(scored, key=lambda item: item[0])[1]


@click.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=DEFAULT_CONFIG,
    show_default=True,
    help="Cluster config (the emulated cluster and the model).",
)
@click.option(
    "--repeats",
    default=3,
    show_default=True,
    type=click.IntRange(min=1),
    help="Runs of every system; the table shows median and spread.",
)
@click.option(
    "--seconds",
    default=10.0,
    show_default=True,
    help="Measured seconds per system per repeat, after warm-up.",
)
@click.option(
    "--ddp",
    "ddp_spec",
    default=DEFAULT_DDP,
    show_default=True,
    help="DDP rows, SET@BATCH[/BATCH..] each: fit (every GPU that holds the model) or fastest (the fastest "
    "type that does); several batches are swept and the best kept. @ omitted: the config's batch.",
)
@click.option(
    "--micro",
    default=DEFAULT_MICRO,
    show_default=True,
    help="Pipeline settings to try, MICROBATCHxCOUNT[,..] (a minibatch of COUNT microbatches per flush); "
    "'none': no pipeline row.",
)
@click.option("--schedule", type=click.Choice(["1f1b", "gpipe"]), default="1f1b", show_default=True)
@click.option(
    "--planner/--no-planner",
    default=True,
    show_default=True,
    help="hetpipe: run the planner's best plan (else the config's virtual workers).",
)
@click.option(
    "--nm",
    default=DEFAULT_NM,
    show_default=True,
    help="hetpipe: Nm caps to try (comma list; '' for the planner's own cap).",
)
@click.option("--staleness", default=None, help="hetpipe: D values to try (comma list); default: the plan's.")
@click.option(
    "--hetpipe-fastest/--no-hetpipe-fastest",
    "with_fastest",
    default=True,
    show_default=True,
    help="Also the row hetpipe-fastest: hetpipe with one VW per GPU of the fastest type only (same --nm and "
    "--staleness), beside hetpipe on all GPUs.",
)
@click.option(
    "--set", "settings", multiple=True, help="Config override SECTION.KEY=VALUE (TOML value), repeatable."
)
@testbed_options
@profile_option
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("runs/bench/throughput"),
    show_default=True,
    help="Run directories, logs and the profile cache.",
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write JSON here.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="PNG plot (needs matplotlib, the `bench` extra); default: --out with .png.",
)
def main(
    config_path: Path,
    repeats: int,
    seconds: float,
    ddp_spec: str,
    micro: str,
    schedule: str,
    planner: bool,
    nm: str | None,
    staleness: str | None,
    with_fastest: bool,
    settings: tuple[str, ...],
    use_testbed: bool,
    testbed_scale: float | None,
    probe_seconds: float,
    cached_profile: bool,
    work_dir: Path,
    out: Path | None,
    plot_path: Path | None,
) -> None:
    with contextlib.ExitStack() as stack:
        _main(
            config_path,
            repeats,
            seconds,
            ddp_spec,
            micro,
            schedule,
            planner,
            nm,
            staleness,
            with_fastest,
            settings,
            use_testbed,
            testbed_scale,
            probe_seconds,
            cached_profile,
            work_dir,
            out,
            plot_path,
            stack,
        )


def _main(
    config_path: Path,
    repeats: int,
    seconds: float,
    ddp_spec: str,
    micro: str,
    schedule: str,
    planner: bool,
    nm: str | None,
    staleness: str | None,
    with_fastest: bool,
    settings: tuple[str, ...],
    use_testbed: bool,
    testbed_scale: float | None,
    probe_seconds: float,
    cached_profile: bool,
    work_dir: Path,
    out: Path | None,
    plot_path: Path | None,
    stack: contextlib.ExitStack,
) -> None:
    torch.set_num_threads(1)
    work = work_dir / time.strftime("%Y%m%d-%H%M%S")
    config = apply_overrides(load_config(config_path), settings)
    load_before = peers.env_note()["loadavg_1_5_15"]
    batch = config.train.batch_size
    cache = work_dir / "profiles"
    devs = peers.devices(config)
    profile = peers.model_profile(config, batch, cache, refresh=not cached_profile)
    need = peers.whole_model_bytes(profile)
    fit, left_out = peers.ddp_members(devs, need)
    subsets = peers.ddp_subsets(fit)
    wanted = parse_ddp(ddp_spec, batch, len(fit))
    print(
        f"{config.name}: {len(devs)} emulated GPUs, model {config.model.name}, batch {batch}; slowdowns "
        + ", ".join(f"{d.gpu} {d.gpu_type} x{d.slowdown:.2f}" for d in devs),
        flush=True,
    )
    for line in peers.describe_members(fit, left_out, need):
        print(line)
    topology, testbed_record = (
        open_testbed(config, cache, testbed_scale, probe_seconds, stack) if use_testbed else (None, None)
    )
    network = Network(topology)
    print(
        "network: "
        + ("the testbed's shaped links" if topology else "free (loopback; no link costs anything)")
    )

    first = bound.measure(config, devs, work / "logs")
    solo_rate, capacity = first.solo_rate, first.total
    solo_step_s = batch / solo_rate
    print(first.describe(), flush=True)

    nms = parse_ints(nm, "Nm caps") if nm else [None]
    ds = [int(v) for v in staleness.split(",")] if staleness else [None]
    hetpipe_options, setups = hetpipe_peers(config, profile, planner, nms, ds, capacity, work, topology)
    for setup in setups:
        print(setup.describe("hetpipe"), flush=True)
    fastest, fastest_setups = (
        fastest_peers(config, devs, profile, planner, nms, ds, capacity, work, topology)
        if with_fastest
        else ([], [])
    )
    larger = largest_batch([*setups, *fastest_setups], wanted, batch)
    param_bytes = sum(layer.param_bytes for layer in profile.layers)
    pairs = parse_micro(micro)
    groups = [
        hetpipe_options,
        *([fastest] if fastest else []),
        *ddp_peers(config, subsets, wanted, solo_step_s, topology, param_bytes),
        *([pipeline_peers(config, devs, pairs, schedule, cache, topology)] if pairs else []),
    ]
    sweep: list[dict[str, Any]] = []
    chosen = [_best(group, seconds, work / "logs", sweep, network) for group in groups]

    rates: dict[str, list[float]] = {p.name: [] for p in chosen}
    measured: list[bound.Capacity] = []  # again in each repeat, beside its runs: the CPU's speed drifts
    for r in range(repeats):
        measured.append(bound.measure(config, devs, work / "logs", [larger]))
        print(f"repeat {r + 1}/{repeats}: {measured[-1].describe()}", flush=True)
        for peer in chosen:
            rates[peer.name].append(network.run(peer, seconds, work / "logs"))
        print(
            f"repeat {r + 1}/{repeats}: "
            + ", ".join(f"{n} {v[-1]:.0f}" for n, v in rates.items())
            + f" samples/s; capacity {measured[-1].total:.0f}",
            flush=True,
        )
    capacities = [c.total for c in measured]
    at_start, capacity = capacity, statistics.median(capacities)
    shares = summarize([h / c for h, c in zip(rates["hetpipe"], capacities, strict=True)], 3)

    settings = {p.name: p.setting for p in chosen}
    rows = [
        {"system": name, "setting": settings[name], "samples_per_s": summarize(values), "runs": values}
        for name, values in rates.items()
    ]
    ours = next(p for p in chosen if p.name == "hetpipe")
    repeated = ours.details[-repeats:]  # the repeats' runs (a sweep's come before them)
    rows[0]["wave_breakdown_ms"] = [d["wave_breakdown_ms"] for d in repeated]
    rows[0]["stage_breakdown_ms"] = [d["stage_breakdown_ms"] for d in repeated]
    rows[0]["start_s"] = [d.get("start_s") for d in repeated]  # left out of the rate (docs/testbed.md)
    rows[0]["predicted"] = repeated[0].get("predicted") if repeated else None
    rows[0]["bounds"] = repeated[0].get("bounds", []) if repeated else []
    ratios = {
        name: summarize([h / v for h, v in zip(rates["hetpipe"], values, strict=True)], 2)
        for name, values in rates.items()
        if name != "hetpipe"
    }
    print()
    print(table(rows, capacity))
    print(
        "hetpipe / peer in the same repeat (median, min-max): "
        + ", ".join(f"{n} {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})" for n, s in ratios.items())
    )
    print(
        f"capacity in each repeat {', '.join(f'{c:.0f}' for c in capacities)} (at the start {at_start:.0f}); "
        f"hetpipe / capacity in the same repeat: {shares['median']:.0%} "
        f"({shares['min']:.0%}-{shares['max']:.0%})"
    )
    print(format_breakdown(repeated))
    note = peers.env_note()
    print(
        f"load average (1, 5, 15 min) before {load_before}, after {note['loadavg_1_5_15']}, "
        f"{note['cores']} cores"
    )
    if network.egress:
        print(
            "MB each node sent per run (median over the runs): "
            + "; ".join(
                f"{name} "
                + ", ".join(
                    f"{node} {statistics.median(r[node] for r in runs) / 1e6:.3g}" for node in runs[0]
                )
                for name, runs in network.egress.items()
            )
        )
    if testbed_record is not None:
        testbed_record["speed_drift"] = speed_drift(config, cache, testbed_record)
    if out is not None:
        document = {
            "config": str(config_path),
            "meta": {**note, "loadavg_before": load_before},
            "batch": batch,
            "capacity_samples_per_s": round(capacity, 1),
            "capacity_per_repeat": [round(c, 1) for c in capacities],
            "capacity_at_start": round(at_start, 1),
            "capacity_measured": [c.record() for c in [first, *measured]],  # at the start, then each repeat
            "capacity_ideal_per_repeat": [round(c.ideal, 1) for c in measured],
            "share_of_capacity_same_repeat": shares,
            "solo_samples_per_s": round(solo_rate, 1),
            "ddp_memory_need_bytes": need,
            "ddp_left_out": [d.gpu for d in left_out],
            "rows": rows,
            "ratios_same_repeat": ratios,
            "sweep": sweep,
            "slowdowns": {d.gpu: round(d.slowdown, 3) for d in devs},
            "repeats": repeats,
            "seconds": seconds,
            "network": "testbed" if topology else "free",
        }
        if testbed_record is not None:
            document["testbed"] = {**testbed_record, "egress_bytes_per_run": network.egress}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(document, indent=1))
        print(f"wrote {out}")
    png = plot_path or (out.with_suffix(".png") if out else None)
    if png is not None:
        print(plots.throughput_bars(rows, capacity, png, f"{config.name}: samples/s, median of {repeats}"))


if __name__ == "__main__":
    main()

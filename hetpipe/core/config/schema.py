"""What a parsed cluster config is: frozen dataclasses, one per TOML section, and the keys each table allows.
No parsing or I/O."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from hetpipe.core.pipeline.lr_schedule import LrSchedule, LrScheduleName
from hetpipe.core.pipeline.mitigation import parse_mitigation
from hetpipe.core.pipeline.schedule import DEFAULT_SCHEDULE
from hetpipe.core.wsp.aggregation import DEFAULT_AGGREGATION
from hetpipe.core.wsp.autofreeze import AutoFreeze
from hetpipe.core.wsp.freezing import FreezeSchedule

__all__ = [
    "AllocationConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "DataConfig",
    "EmulationConfig",
    "FrozenMap",
    "GpuRef",
    "GpuType",
    "ModelConfig",
    "NetworkConfig",
    "Node",
    "PsConfig",
    "TrainConfig",
    "VirtualWorkerSpec",
    "WspConfig",
]

Placement = Literal["balanced", "local", "spread"]
Aggregation = str  # a name of hetpipe.core.wsp.aggregation.AGGREGATIONS (the rules live there alone)
BufferPolicy = Literal["average", "local"]
Precision = Literal["fp32", "bf16"]
EmulatedDevice = Literal["cpu", "cuda"]
PullMode = Literal["exact", "latest"]
OptimizerName = Literal["sgd", "momentum", "adam"]
PsAuth = Literal["none", "curve"]
OnNan = Literal["stop", "skip"]
OnVwFailure = Literal["stop", "evict"]
WireDtype = Literal["float32", "bfloat16"]
# bytes one float32 weight takes on the PS's wire ([ps] wire_dtype, docs/ps-protocol.md#frames)
WIRE_BYTES_PER_VALUE: dict[str, int] = {"float32": 4, "bfloat16": 2}
PsAgent = Literal["auto", "thread", "process"]
AllocationPolicy = Literal["explicit", "np", "ed", "hd", "dp"]
BUILTIN_LOSSES = (
    "cross_entropy",
    "mse",
    "nll",
)  # train.loss's names (hetpipe.compute.losses), else "pkg.mod:fn"

_GPU_REF = re.compile(r"(?P<node>[A-Za-z0-9_-]+):(?P<index>[0-9]+)")


# ---------------------------------------------------------------------------------------------- values


class FrozenMap(Mapping[str, Any]):
    """An immutable, hashable mapping for free-form TOML tables; nested tables and arrays are frozen too."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data = {key: _freeze(value) for key, value in (data or {}).items()}

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"

    def to_dict(self) -> dict[str, Any]:
        """A plain, mutable copy (nested FrozenMaps become dicts, tuples become lists), e.g. for **kwargs."""
        return {key: _thaw(value) for key, value in self._data.items()}


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return value if isinstance(value, FrozenMap) else FrozenMap(value)
    if isinstance(value, list | tuple):
        return tuple(_freeze(item) for item in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, FrozenMap):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_thaw(item) for item in value]
    return value


@dataclass(frozen=True)
class GpuType:
    """A kind of device: relative speed (only ratios matter, e.g. FP32 TFLOPS) and memory."""

    name: str
    speed: float
    memory_gib: float


@dataclass(frozen=True)
class Node:
    """A machine and its GPUs, listed by type name; a GPU's position in `gpus` is its index."""

    name: str
    host: str
    gpus: tuple[str, ...]
    devices: tuple[str, ...] | None = None  # where each GPU computes ("cuda:1", "cpu"); None: GPU i is cuda:i


@dataclass(frozen=True, order=True)
class GpuRef:
    """One GPU of the cluster: node name and index on that node; written "n0:1"."""

    node: str
    index: int

    def __str__(self) -> str:
        return f"{self.node}:{self.index}"

    @classmethod
    def parse(cls, text: str) -> GpuRef:
        """Parse "node-name:gpu-index"; ValueError names the expected form."""
        match = _GPU_REF.fullmatch(text)
        if match is None:
            raise ValueError(f'"{text}" is not a GPU reference: write "node-name:gpu-index", e.g. "n0:1"')
        return cls(match["node"], int(match["index"]))


@dataclass(frozen=True)
class NetworkConfig:
    """Link bandwidths in Gbit/s: between GPUs of one node and between nodes."""

    intra_node_gbps: float = 100.0
    inter_node_gbps: float = 10.0

    def link_gbps(self, a: str, b: str) -> float:
        """Bandwidth between GPUs "node:i" a and b: intra-node on one node, else inter-node."""
        same = a.rsplit(":", 1)[0] == b.rsplit(":", 1)[0]
        return self.intra_node_gbps if same else self.inter_node_gbps


@dataclass(frozen=True)
class PsConfig:
    """Parameter server: shard i listens on port + i; a client waits timeout_s for a reply.

    auth = "curve": every PS socket is a CurveZMQ server that admits only the run's key pairs, each VW's
    key acting only as that VW (hetpipe.core.protocol.access); keys_dir holds them ("": `hetpipe train` makes
    a fresh set in <run dir>/keys; `hetpipe server` and `hetpipe worker` need one, see `hetpipe keys`).
    """

    host: str = "127.0.0.1"
    port: int = 7400
    shards: int = 1
    placement: Placement = "balanced"
    timeout_s: float = 60.0
    aggregation: Aggregation = DEFAULT_AGGREGATION  # how a wave's pushes fold into the weights (docs/wsp.md)
    buffers: BufferPolicy = (
        "average"  # BatchNorm statistics: averaged at the PS, or kept per VW (docs/buffers.md)
    )
    auth: PsAuth = "none"
    keys_dir: str = ""
    # failures (docs/recovery.md): a VW whose stage died or hung stops the run, or is evicted and the others
    # go on; stages send heartbeats every heartbeat_s, a stage silent for hung_after_s (0: never) has failed;
    # `hetpipe train` restarts a dead shard from its checkpoint up to max_restarts times
    # (checkpoint.every >= 1)
    on_vw_failure: OnVwFailure = "stop"
    heartbeat_s: float = 2.0
    hung_after_s: float = 60.0
    max_restarts: int = 10
    # weights ("param" keys) in pushes and pulls on the wire: float32, or bfloat16 (half the bytes; the PS
    # still adds and keeps float32; docs/ps-protocol.md#frames): a run is then repeatable but not equal to a
    # float32 one
    wire_dtype: WireDtype = "float32"
    # where a stage's PS traffic runs beside its compute: a thread of the stage process, or a process of its
    # own (shared buffers, no copies; an agent thread's GIL use slows a CUDA stage's issuing thread); auto: a
    # process for a CUDA stage, a thread for a CPU one (docs/architecture.md#the-ps-path)
    agent: PsAgent = "auto"
    # node-local aggregation (docs/wsp.md#node-local-aggregation): the VWs that sit wholly on one node push
    # and pull through one relay on that node, which adds their wave updates and pulls once for them all, so
    # one update and one copy of the weights cross the node's link each wave instead of one per VW
    node_aggregation: bool = False

    @property
    def shard_per_node(self) -> bool:
        """Placement "local" (each layer's keys where the first VW runs it) and "spread" (whole layers dealt
        evenly by bytes) run shard i on node i, so the PS's traffic crosses every node's link."""
        return self.placement in ("local", "spread")


@dataclass(frozen=True)
class WspConfig:
    """Wave Synchronous Parallel: D (staleness, in waves), Nm (minibatches in flight), pull mode."""

    staleness: int = 0
    nm: int = 2
    pull: PullMode = "exact"


@dataclass(frozen=True)
class CheckpointConfig:
    """PS checkpoints: where, every how many clocks of c_global (0: only on SIGTERM), how many to keep; with
    `stages`, every stage also saves its state at those waves under <run dir>/stages, for `train --resume`."""

    dir: str = "runs/local/ps"
    every: int = 0
    keep: int = 3
    stages: bool = True

    @property
    def enabled(self) -> bool:
        """An empty dir disables checkpoints."""
        return self.dir != ""


@dataclass(frozen=True)
class ModelConfig:
    """Model name and the options passed to its builder."""

    name: str = "mnist-cnn"
    options: FrozenMap = field(default_factory=FrozenMap)
    init: str = ""  # a state dict (a run's model.pt) to start from; "": the builder's seeded weights


@dataclass(frozen=True)
class DataConfig:
    """Dataset name, its options, and the fraction held out for testing."""

    name: str = "mnist"
    options: FrozenMap = field(default_factory=FrozenMap)
    test_fraction: float = 0.2


@dataclass(frozen=True)
class TrainConfig:
    """What each virtual worker trains: batch, waves, optimizer, schedule, output directory."""

    batch_size: int = 32
    waves: int = 20
    optimizer: OptimizerName = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    weight_stashing: bool = True
    schedule: str = DEFAULT_SCHEDULE
    recompute: bool = False  # activation recomputation (flush schedules only)
    precision: Precision = "fp32"
    eval_every: int = (
        0  # waves between evaluations of the global weights during training (0: only at the end)
    )
    eval_samples: int = 4096  # held-out samples an evaluation scores (0: all of them)
    out_dir: str = "runs/local"
    on_nan: OnNan = "stop"  # a NaN or inf loss: "stop" the run naming stage and wave, or "skip" the minibatch
    mitigation: str = (
        "none"  # staleness mitigations, "+"-joined (hetpipe.core.pipeline.mitigation, docs/convergence.md)
    )
    warmup_waves: int = 10  # waves of the "warmup" ramp and of PipeMare's learning-rate annealing
    # the learning rate by wave (hetpipe.core.pipeline.lr_schedule; a step is a wave)
    lr_schedule: LrScheduleName = "constant"
    warmup_steps: int = 0  # cosine: waves of linear warm-up
    total_steps: int = 0  # cosine: waves to decay over (0: the run's waves)
    min_lr: float = 0.0  # cosine: the learning rate it decays to
    lr_step_every: int = 0  # step: waves between decays
    lr_step_gamma: float = 0.1  # step: the factor of each decay
    clip_grad_norm: float = 0.0  # each local update's gradient clipped to this norm, per stage (0: off)
    loss: str = (
        "cross_entropy"  # cross_entropy, mse, nll or "package.module:function" (hetpipe.compute.losses)
    )
    # freeze points [[wave, layers], ...]: from `wave` on the first `layers` layers are frozen (docs/wsp.md)
    freeze: tuple[tuple[int, int], ...] = ()
    # MiB a stage may keep of its frozen layers' outputs by sample, reused where the data repeat (0: off;
    # hetpipe.compute.frozen_cache, docs/wsp.md#the-frozen-layers-cache)
    freeze_cache_mib: int = 0
    # adaptive freezing (docs/wsp.md#adaptive-freezing): decide every `autofreeze_every` waves (0: off), at
    # most `autofreeze_rate` of the trainable layers at once and `autofreeze_ceiling` of all layers
    autofreeze_every: int = 0
    autofreeze_rate: float = 0.5
    autofreeze_ceiling: float = 0.75

    @property
    def autofreeze(self) -> AutoFreeze | None:
        """The adaptive rule (hetpipe.core.wsp.autofreeze); None: off."""
        if not self.autofreeze_every:
            return None
        return AutoFreeze(self.autofreeze_every, self.autofreeze_rate, self.autofreeze_ceiling)

    @property
    def freezes(self) -> bool:
        """Some layers may freeze: a fixed schedule or the adaptive rule."""
        return bool(self.freeze) or bool(self.autofreeze_every)

    @property
    def mitigations(self) -> tuple[str, ...]:
        """The mitigations in canonical order; () for "none"."""
        return parse_mitigation(self.mitigation)

    @property
    def freeze_schedule(self) -> FreezeSchedule:
        """The freeze points as the pure rule (hetpipe.core.wsp.freezing); empty: nothing freezes."""
        return FreezeSchedule.at(self.freeze)

    @property
    def schedule_of_lr(self) -> LrSchedule:
        """The learning-rate schedule with its total resolved (total_steps, else the run's waves)."""
        return LrSchedule(
            name=self.lr_schedule,
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            total=self.total_steps or self.waves,
            min_lr=self.min_lr,
            every=max(1, self.lr_step_every),
            gamma=self.lr_step_gamma,
        )


@dataclass(frozen=True)
class EmulationConfig:
    """Heterogeneous GPUs emulated on CPU; time_scale None means "auto"."""

    enabled: bool = True
    time_scale: float | None = None
    link_bandwidth: bool = False
    device: EmulatedDevice = "cpu"  # where emulated GPUs compute: the CPU, or the node's CUDA devices


@dataclass(frozen=True)
class AllocationConfig:
    """How GPUs are grouped into virtual workers (docs/planning.md#allocation-policies)."""

    policy: AllocationPolicy = "np"


@dataclass(frozen=True)
class VirtualWorkerSpec:
    """A virtual worker listed by hand: its GPUs in stage order, optionally layers per stage and its own work
    per wave (Nm and minibatch size; None: [wsp] nm and [train] batch_size; docs/wsp.md#per-vw-work)."""

    gpus: tuple[GpuRef, ...]
    layers: tuple[int, ...] | None = None
    nm: int | None = None
    batch_size: int | None = None
    # the waves [start, end) it trains (None: all of the run's): a planned re-plan, docs/wsp.md#planned-spans
    waves: tuple[int, int] | None = None


@dataclass(frozen=True)
class ClusterConfig:
    """A validated cluster config; `path` is the file it came from, as given."""

    path: Path
    name: str
    seed: int
    gpu_types: Mapping[str, GpuType]
    nodes: tuple[Node, ...]
    network: NetworkConfig
    ps: PsConfig
    wsp: WspConfig
    checkpoint: CheckpointConfig
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    emulation: EmulationConfig
    allocation: AllocationConfig
    virtual_workers: tuple[VirtualWorkerSpec, ...]

    @property
    def num_vws(self) -> int:
        """Number of virtual workers listed in the config (0 when a policy builds them)."""
        return len(self.virtual_workers)

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node named {name!r} in {self.path}")

    def gpu(self, ref: GpuRef | str) -> GpuType:
        """The type of one GPU, by reference ("n0:1" or GpuRef)."""
        ref = GpuRef.parse(ref) if isinstance(ref, str) else ref
        node = self.node(ref.node)
        if not 0 <= ref.index < len(node.gpus):
            raise KeyError(f"node {node.name!r} has {len(node.gpus)} GPUs, no GPU {ref.index}")
        return self.gpu_types[node.gpus[ref.index]]

    def all_gpus(self) -> list[GpuRef]:
        """Every GPU of the cluster, in node order then index order."""
        return [GpuRef(node.name, index) for node in self.nodes for index in range(len(node.gpus))]

    def shard_host(self, shard: int) -> str:
        """Where shard `shard` listens: ps.host, or with placement "local" or "spread" the host of node
        `shard` (one shard a node)."""
        return self.nodes[shard].host if self.ps.shard_per_node else self.ps.host

    def ps_endpoints(self) -> list[str]:
        """ZeroMQ endpoints of the PS shards, shard i at port + i on shard_host(i)."""
        return [f"tcp://{self.shard_host(i)}:{self.ps.port + i}" for i in range(self.ps.shards)]

    def relay_endpoints(self, node: str) -> list[str]:
        """Where node `node`'s relays listen under node aggregation, one per shard, on a multi-machine run
        (`hetpipe relay`): its host at ps.port + 50 + the node's index x shards + the shard."""
        index = [n.name for n in self.nodes].index(node)
        base = self.ps.port + 50 + index * self.ps.shards
        return [f"tcp://{self.node(node).host}:{base + i}" for i in range(self.ps.shards)]

    def to_dict(self) -> dict[str, Any]:
        """The config as a TOML-shaped document: parse_config(config.to_dict(), config.path) == config."""
        doc: dict[str, Any] = {
            "name": self.name,
            "seed": self.seed,
            "gpu_types": {
                n: {"speed": t.speed, "memory_gib": t.memory_gib} for n, t in self.gpu_types.items()
            },
            "nodes": [
                {
                    "name": n.name,
                    "host": n.host,
                    "gpus": list(n.gpus),
                    **({"devices": list(n.devices)} if n.devices else {}),
                }
                for n in self.nodes
            ],
        }
        for section in _SECTIONS:
            doc[section] = {
                f.name: _plain(getattr(getattr(self, section), f.name))
                for f in fields(getattr(self, section))
            }
        if self.emulation.time_scale is None:
            doc["emulation"]["time_scale"] = "auto"
        if self.virtual_workers:
            doc["virtual_workers"] = [
                {
                    "gpus": [str(g) for g in vw.gpus],
                    **({"layers": list(vw.layers)} if vw.layers else {}),
                    **({"nm": vw.nm} if vw.nm is not None else {}),
                    **({"batch_size": vw.batch_size} if vw.batch_size is not None else {}),
                    **({"waves": list(vw.waves)} if vw.waves is not None else {}),
                }
                for vw in self.virtual_workers
            ]
        return doc


def _plain(value: Any) -> Any:
    """A field value as TOML holds it: tables as dicts, tuples as lists."""
    if isinstance(value, FrozenMap):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value


# ----------------------------------------------------------------------------------------------- keys allowed

_SECTIONS: dict[str, tuple[str, ...]] = {
    "network": ("intra_node_gbps", "inter_node_gbps"),
    "ps": (
        "host",
        "port",
        "shards",
        "placement",
        "timeout_s",
        "aggregation",
        "buffers",
        "auth",
        "keys_dir",
        "on_vw_failure",
        "heartbeat_s",
        "hung_after_s",
        "max_restarts",
        "wire_dtype",
        "agent",
        "node_aggregation",
    ),
    "wsp": ("staleness", "nm", "pull"),
    "checkpoint": ("dir", "every", "keep", "stages"),
    "model": ("name", "options", "init"),
    "data": ("name", "options", "test_fraction"),
    "train": (
        "batch_size",
        "waves",
        "optimizer",
        "lr",
        "momentum",
        "weight_decay",
        "weight_stashing",
        "schedule",
        "recompute",
        "precision",
        "eval_every",
        "eval_samples",
        "out_dir",
        "on_nan",
        "mitigation",
        "warmup_waves",
        "lr_schedule",
        "warmup_steps",
        "total_steps",
        "min_lr",
        "lr_step_every",
        "lr_step_gamma",
        "clip_grad_norm",
        "loss",
        "freeze",
        "freeze_cache_mib",
        "autofreeze_every",
        "autofreeze_rate",
        "autofreeze_ceiling",
    ),
    "emulation": ("enabled", "time_scale", "link_bandwidth", "device"),
    "allocation": ("policy",),
}
_TOP_KEYS = ("name", "seed", "gpu_types", "nodes", *_SECTIONS, "virtual_workers")
_GPU_TYPE_KEYS = ("speed", "memory_gib")
_NODE_KEYS = ("name", "host", "gpus", "devices")
_VW_KEYS = ("gpus", "layers", "nm", "batch_size", "waves")

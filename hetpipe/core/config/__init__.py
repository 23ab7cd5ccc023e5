"""Cluster config: one TOML file per cluster -> frozen dataclasses; every error names file, field, bad value,
fix."""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, NoReturn, get_args

import msgpack

from hetpipe.core.errors import ConfigError, UsageError, did_you_mean
from hetpipe.core.pipeline.mitigation import mitigation_conflicts, parse_mitigation
from hetpipe.core.pipeline.schedule import DEFAULT_SCHEDULE, SCHEDULES
from hetpipe.core.registry import Registry
from hetpipe.core.wsp.aggregation import AGGREGATIONS

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
    "apply_overrides",
    "config_toml",
    "default_config_path",
    "load_config",
    "pack_config",
    "parse_config",
    "unpack_config",
]

Placement = Literal["balanced", "local"]
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
PsAgent = Literal["auto", "thread", "process"]
AllocationPolicy = Literal["explicit", "np", "ed", "hd", "dp"]

_NAME = re.compile(r"[A-Za-z0-9_-]+")
_GPU_REF = re.compile(r"(?P<node>[A-Za-z0-9_-]+):(?P<index>[0-9]+)")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_DEVICE = re.compile(r"cpu|cuda:[0-9]+")
_MAX_PORT = 65535
_MAX_SEED = 2**32 - 1  # numpy's legacy seeding rejects larger seeds


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
    aggregation: Aggregation = "sum"  # how a wave's pushes fold into the weights (docs/wsp.md)
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

    @property
    def mitigations(self) -> tuple[str, ...]:
        """The mitigations in canonical order; () for "none"."""
        return parse_mitigation(self.mitigation)


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
    """A virtual worker listed by hand: its GPUs in stage order, optionally layers per stage."""

    gpus: tuple[GpuRef, ...]
    layers: tuple[int, ...] | None = None


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
        """Where shard `shard` listens: ps.host, or with placement "local" the host of node `shard` (one shard
        a node)."""
        return self.nodes[shard].host if self.ps.placement == "local" else self.ps.host

    def ps_endpoints(self) -> list[str]:
        """ZeroMQ endpoints of the PS shards, shard i at port + i on shard_host(i)."""
        return [f"tcp://{self.shard_host(i)}:{self.ps.port + i}" for i in range(self.ps.shards)]

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
                {"gpus": [str(g) for g in vw.gpus], **({"layers": list(vw.layers)} if vw.layers else {})}
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


# ---------------------------------------------------------------------------------------------- schema

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
    ),
    "wsp": ("staleness", "nm", "pull"),
    "checkpoint": ("dir", "every", "keep", "stages"),
    "model": ("name", "options"),
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
    ),
    "emulation": ("enabled", "time_scale", "link_bandwidth", "device"),
    "allocation": ("policy",),
}
_TOP_KEYS = ("name", "seed", "gpu_types", "nodes", *_SECTIONS, "virtual_workers")
_GPU_TYPE_KEYS = ("speed", "memory_gib")
_NODE_KEYS = ("name", "host", "gpus", "devices")
_VW_KEYS = ("gpus", "layers")


# ---------------------------------------------------------------------------------------------- loading


def default_config_path() -> Path:
    """The packaged default config (2 virtual workers x 2 emulated GPUs on 127.0.0.1)."""
    return Path(__file__).resolve().parents[2] / "clusters" / "local.toml"


def load_config(path: str | Path) -> ClusterConfig:
    """Read and validate one cluster config; any problem raises ConfigError naming the fix."""
    path = Path(path)
    return parse_config(_read_toml(path), path)


def run_dir_config(run_dir: Path, settings: Sequence[str] = ()) -> ClusterConfig:
    """The config a `hetpipe train` run in `run_dir` was started with (its config.toml), `settings`
    applied."""
    from hetpipe.core.errors import UsageError

    path = Path(run_dir) / "config.toml"
    if not path.exists():
        raise UsageError(
            f"{run_dir}: no config.toml there; is it the run dir of a `hetpipe train` run? "
            "Give the cluster config too (the CONFIG argument)"
        )
    return apply_overrides(load_config(path), settings)


def apply_overrides(config: ClusterConfig, settings: Sequence[str]) -> ClusterConfig:
    """The config with `--set KEY.PATH=VALUE` overrides applied and validated like the file.

    VALUE is read as a TOML value (4, 0.01, true, [2, 3], { hidden = [64] }) and otherwise taken as a
    string (gpipe, latest); KEY.PATH walks tables by name and arrays by index (virtual_workers.0.layers).
    Errors name the file, the key and the fix, as for the file itself.
    """
    if not settings:
        return config
    doc = config.to_dict()
    for item in settings:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(
                f"--set {item!r}: write KEY.PATH=VALUE, e.g. --set wsp.nm=4 or --set train.lr=0.01"
            )
        _set_path(doc, parts, _override_value(text.strip()), item)
    shown = " ".join(f"--set {item}" for item in settings)
    return parse_config(doc, config.path, source=f"{config.path} with {shown}")


def _override_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(doc: dict[str, Any], parts: list[str], value: Any, item: str) -> None:
    node: Any = doc
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[_index(node, part, parts[:depth], item)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            raise ConfigError(f"--set {item!r}: {'.'.join(parts[: depth + 1])} is a value, not a table")
    last = parts[-1]
    if isinstance(node, list):
        node[_index(node, last, parts[:-1], item)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"--set {item!r}: {'.'.join(parts[:-1])} is a value, not a table")


def _index(items: list[Any], part: str, where: list[str], item: str) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(
            f"--set {item!r}: {'.'.join(where)} has {len(items)} entries; "
            f"index them 0..{len(items) - 1}, e.g. {'.'.join(where)}.0"
        )
    return int(part)


def pack_config(config: ClusterConfig) -> bytes:
    """The parsed config for a child process (msgpack of its dict form); unpack_config reverses it."""
    return msgpack.packb({"path": str(config.path), "config": config.to_dict()})


def config_toml(config: ClusterConfig) -> str:
    """The config as TOML text (every field, inline tables): load_config of it equals `config` but for `path`.

    For a run directory's record of the effective config that processes on other hosts or namespaces read
    (the testbed's `hetpipe server`/`hetpipe worker`); not for making variants of a config (use --set).
    """
    return "".join(f"{_key(key)} = {_toml_value(value)}\n" for key, value in config.to_dict().items())


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def unpack_config(packed: bytes) -> ClusterConfig:
    """The config a parent packed with pack_config, validated again (cheap) on this side."""
    doc = msgpack.unpackb(packed)
    return parse_config(doc["config"], Path(doc["path"]))


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        _fail(path, "", "no such config file", _missing_file_hint(path))
    except IsADirectoryError:
        _fail(path, "", "is a directory, not a config file", _missing_file_hint(path / "x.toml"))
    except OSError as exc:
        _fail(path, "", f"cannot read: {exc.strerror or exc}", "check that the file is readable by this user")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        _fail(path, "", f"not UTF-8 text (bad byte at offset {exc.start})", "save the file as UTF-8")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        _fail(path, "", f"invalid TOML: {exc}", _syntax_hint(str(exc), text))


def _missing_file_hint(path: Path) -> str:
    folder = path.parent
    known = sorted(p.name for p in folder.glob("*.toml")) if folder.is_dir() else []
    if not known:
        return f"check the path; the packaged default config is {default_config_path()}"
    return f"configs in {folder}: {', '.join(known)}{did_you_mean(path.name, known)}"


def _syntax_hint(message: str, text: str) -> str:
    general = "strings need quotes, sections are [name], repeated tables are [[name]]"
    match = re.search(r"at line (\d+)", message)
    lines = text.splitlines()
    if match is None or not 1 <= int(match[1]) <= len(lines):
        return f"fix the syntax there ({general})"
    return f"line {match[1]} reads `{lines[int(match[1]) - 1].strip()}`; fix its syntax ({general})"


# ---------------------------------------------------------------------------------------------- parsing


def parse_config(data: Mapping[str, Any], path: Path, *, source: str | None = None) -> ClusterConfig:
    """Validate a decoded TOML document; `path` names the file in errors (or `source`, e.g.
    "x.toml with --set")."""
    top = _Table(source or str(path), "", "at the top of the file", data)
    top.only(_TOP_KEYS)
    name = top.name("name")
    seed = top.integer("seed", 0, ge=0, le=_MAX_SEED)
    gpu_types = _gpu_types(top)
    nodes = _nodes(top, gpu_types)
    sections = {key: top.section(key, allowed) for key, allowed in _SECTIONS.items()}
    network = _network(sections["network"])
    ps = _ps(sections["ps"])
    wsp = _wsp(sections["wsp"])
    model = _model(sections["model"])
    data_config = _data(sections["data"])
    train = _train(sections["train"], name)
    checkpoint = _checkpoint(sections["checkpoint"], f"{train.out_dir.rstrip('/')}/ps")
    emulation = _emulation(sections["emulation"])
    allocation = _allocation(sections["allocation"], listed=bool(data.get("virtual_workers")))
    virtual_workers = _virtual_workers(top, allocation, nodes)
    if ps.placement == "local" and ps.shards != len(nodes):
        sections["ps"].fail(
            "shards",
            f'is {ps.shards} but placement = "local" runs one shard on each of the {len(nodes)} nodes',
            f'set shards = {len(nodes)}, or placement = "balanced"',
        )
    for what, fix in mitigation_conflicts(
        train.mitigations,
        aggregation=ps.aggregation,
        schedule_stashing=SCHEDULES[train.schedule].stashing,
        weight_stashing=train.weight_stashing,
    ):
        sections["train"].fail("mitigation", what, fix)
    return ClusterConfig(
        path=path,
        name=name,
        seed=seed,
        gpu_types=gpu_types,
        nodes=nodes,
        network=network,
        ps=ps,
        wsp=wsp,
        checkpoint=checkpoint,
        model=model,
        data=data_config,
        train=train,
        emulation=emulation,
        allocation=allocation,
        virtual_workers=virtual_workers,
    )


def _gpu_types(top: _Table) -> FrozenMap:
    example = "e.g. [gpu_types.titan-v] with speed = 14.9 and memory_gib = 12.0"
    if "gpu_types" not in top.data:
        top.fail("gpu_types", "required section is missing", f"declare at least one GPU type, {example}")
    table = top.section("gpu_types")
    if not table.data:
        top.fail("gpu_types", "no GPU types declared", f"declare at least one GPU type, {example}")
    types = {}
    for type_name in table.data:
        if not _NAME.fullmatch(type_name):
            table.fail(_key(type_name), f"invalid GPU type name {_show(type_name)}", _NAME_FIX)
        entry = table.section(type_name, _GPU_TYPE_KEYS)
        types[type_name] = GpuType(
            name=type_name,
            speed=entry.number("speed", gt=0),
            memory_gib=entry.number("memory_gib", gt=0),
        )
    return FrozenMap(types)


def _nodes(top: _Table, gpu_types: Mapping[str, GpuType]) -> tuple[Node, ...]:
    first_type = next(iter(gpu_types))
    example = f'add at least one [[nodes]] table with name = "n0" and gpus = ["{first_type}"]'
    if "nodes" not in top.data:
        top.fail("nodes", "required section is missing", example)
    tables = top.array("nodes")
    if not tables:
        top.fail("nodes", "no nodes declared", example)
    seen: dict[str, int] = {}
    nodes = []
    for i, table in enumerate(tables):
        table.only(_NODE_KEYS)
        name = table.name("name")
        if name in seen:
            table.fail(
                "name",
                f'duplicate node name "{name}" (also nodes[{seen[name]}].name)',
                "give each node a unique name",
            )
        seen[name] = i
        host = table.string("host", "127.0.0.1", nonempty=True)
        gpus = table.strings("gpus", placeholder=f'["{first_type}", ...]', nonempty=True)
        for j, gpu in enumerate(gpus):
            if gpu not in gpu_types:
                known = list(gpu_types)
                table.fail(
                    f"gpus[{j}]",
                    f'unknown GPU type "{gpu}"',
                    f"known types: {', '.join(known)}{did_you_mean(gpu, known)}",
                )
        devices = None
        if "devices" in table.data:
            devices = table.strings("devices", placeholder='["cuda:0", "cuda:0", ...]')
            if len(devices) != len(gpus):
                table.fail(
                    "devices",
                    f"has {len(devices)} entries but gpus has {len(gpus)}",
                    "give one device per GPU, in the same order (drop devices for GPU i = cuda:i)",
                )
            for j, device in enumerate(devices):
                if not _DEVICE.fullmatch(device):
                    table.fail(
                        f"devices[{j}]",
                        f"unknown device {_show(device)}",
                        'write "cuda:<index>" (a CUDA device of this node) or "cpu"',
                    )
        nodes.append(Node(name=name, host=host, gpus=gpus, devices=devices))
    return tuple(nodes)


def _network(t: _Table) -> NetworkConfig:
    d = NetworkConfig()
    return NetworkConfig(
        intra_node_gbps=t.number("intra_node_gbps", d.intra_node_gbps, gt=0),
        inter_node_gbps=t.number("inter_node_gbps", d.inter_node_gbps, gt=0),
    )


def _ps(t: _Table) -> PsConfig:
    d = PsConfig()
    host = t.string("host", d.host, nonempty=True)
    port = t.integer("port", d.port, ge=1024, le=_MAX_PORT)
    shards = t.integer("shards", d.shards, ge=1)
    last = port + shards - 1
    if last > _MAX_PORT:
        t.fail(
            "port",
            f"{shards} shards from port {port} need ports up to {last}, above {_MAX_PORT}",
            f"set port to at most {_MAX_PORT + 1 - shards}, or use fewer shards",
        )
    heartbeat = t.number("heartbeat_s", d.heartbeat_s, ge=0)
    hung = t.number("hung_after_s", d.hung_after_s, ge=0)
    if hung and (not heartbeat or hung < 2 * heartbeat):
        t.fail(
            "hung_after_s",
            f"{hung:g} s with heartbeat_s = {heartbeat:g}: a stage would be declared hung "
            "between two heartbeats",
            "set hung_after_s to at least twice heartbeat_s (or 0 to never declare a stage hung)",
        )
    return PsConfig(
        host=host,
        port=port,
        shards=shards,
        placement=t.choice("placement", d.placement, get_args(Placement)),
        timeout_s=t.number("timeout_s", d.timeout_s, gt=0),
        aggregation=t.registered("aggregation", d.aggregation, AGGREGATIONS),
        buffers=t.choice("buffers", d.buffers, get_args(BufferPolicy)),
        auth=t.choice("auth", d.auth, get_args(PsAuth)),
        keys_dir=t.string("keys_dir", d.keys_dir),
        on_vw_failure=t.choice("on_vw_failure", d.on_vw_failure, get_args(OnVwFailure)),
        heartbeat_s=heartbeat,
        hung_after_s=hung,
        max_restarts=t.integer("max_restarts", d.max_restarts, ge=0),
        wire_dtype=t.choice("wire_dtype", d.wire_dtype, get_args(WireDtype)),
        agent=t.choice("agent", d.agent, get_args(PsAgent)),
    )


def _wsp(t: _Table) -> WspConfig:
    d = WspConfig()
    return WspConfig(
        staleness=t.integer("staleness", d.staleness, ge=0),
        nm=t.integer("nm", d.nm, ge=1),
        pull=t.choice("pull", d.pull, get_args(PullMode)),
    )


def _checkpoint(t: _Table, default_dir: str) -> CheckpointConfig:
    d = CheckpointConfig()
    return CheckpointConfig(
        dir=t.string("dir", default_dir),
        every=t.integer("every", d.every, ge=0),
        keep=t.integer("keep", d.keep, ge=1),
        stages=t.boolean("stages", d.stages),
    )


def _model(t: _Table) -> ModelConfig:
    d = ModelConfig()
    return ModelConfig(name=t.string("name", d.name, nonempty=True), options=t.options("options"))


def _data(t: _Table) -> DataConfig:
    d = DataConfig()
    return DataConfig(
        name=t.string("name", d.name, nonempty=True),
        options=t.options("options"),
        test_fraction=t.number("test_fraction", d.test_fraction, gt=0, lt=1),
    )


def _train(t: _Table, run_name: str) -> TrainConfig:
    d = TrainConfig()
    train = TrainConfig(
        batch_size=t.integer("batch_size", d.batch_size, ge=1),
        waves=t.integer("waves", d.waves, ge=1),
        optimizer=t.choice("optimizer", d.optimizer, get_args(OptimizerName)),
        lr=t.number("lr", d.lr, gt=0),
        momentum=t.number("momentum", d.momentum, ge=0, lt=1),
        weight_decay=t.number("weight_decay", d.weight_decay, ge=0),
        weight_stashing=t.boolean("weight_stashing", d.weight_stashing),
        schedule=t.registered("schedule", d.schedule, SCHEDULES),
        recompute=t.boolean("recompute", d.recompute),
        precision=t.choice("precision", d.precision, get_args(Precision)),
        eval_every=t.integer("eval_every", d.eval_every, ge=0),
        eval_samples=t.integer("eval_samples", d.eval_samples, ge=0),
        out_dir=t.string("out_dir", f"runs/{run_name}", nonempty=True),
        on_nan=t.choice("on_nan", d.on_nan, get_args(OnNan)),
        mitigation=t.string("mitigation", d.mitigation, nonempty=True),
        warmup_waves=t.integer("warmup_waves", d.warmup_waves, ge=0),
    )
    try:
        train = replace(train, mitigation="+".join(train.mitigations) or "none")
    except UsageError as exc:
        t.fail("mitigation", f"cannot read {_show(train.mitigation)}", str(exc))
    kind = SCHEDULES[train.schedule]
    if kind.stashing == "required" and not train.weight_stashing:
        optional = " or ".join(f'"{n}"' for n, k in SCHEDULES.items() if k.stashing == "optional")
        t.fail(
            "weight_stashing",
            f'is false, but schedule "{train.schedule}" keeps two weight versions by design',
            f"set weight_stashing = true {t.under}, or choose schedule = {optional} (stashing optional)",
        )
    if train.recompute and not kind.recompute:
        able = ", ".join(n for n, k in SCHEDULES.items() if k.recompute)
        t.fail(
            "recompute",
            f'is true, but schedule "{train.schedule}" updates weights between a forward and its '
            "backward, so a recomputed forward would not match the first",
            f"set recompute = false {t.under}, or choose a schedule that flushes: {able}",
        )
    return train


def _emulation(t: _Table) -> EmulationConfig:
    d = EmulationConfig()
    enabled = t.boolean("enabled", d.enabled)
    raw = t.data.get("time_scale", "auto")
    if isinstance(raw, str):
        if raw != "auto":
            t.fail(
                "time_scale",
                f"unknown value {_show(raw)}",
                f'write time_scale = "auto" or a number > 0{did_you_mean(raw, ["auto"])}',
            )
        time_scale = None
    else:
        time_scale = t.number(
            "time_scale", placeholder='"auto" or <float > 0>', kind='"auto" or a number', gt=0
        )
    return EmulationConfig(
        enabled=enabled,
        time_scale=time_scale,
        link_bandwidth=t.boolean("link_bandwidth", d.link_bandwidth),
        device=t.choice("device", d.device, get_args(EmulatedDevice)),
    )


def _allocation(t: _Table, listed: bool) -> AllocationConfig:
    policy = t.choice("policy", "explicit" if listed else "np", get_args(AllocationPolicy))
    if policy == "explicit" and not listed:
        t.fail(
            "policy",
            'is "explicit" but no [[virtual_workers]] are listed',
            'add [[virtual_workers]] tables with gpus = ["n0:0", ...], or set policy = "np", "ed", "hd" '
            'or "dp"',
        )
    return AllocationConfig(policy=policy)


def _virtual_workers(
    top: _Table, allocation: AllocationConfig, nodes: Sequence[Node]
) -> tuple[VirtualWorkerSpec, ...]:
    tables = top.array("virtual_workers")
    if tables and allocation.policy != "explicit":
        top.fail(
            "virtual_workers",
            f'listed, but allocation.policy = "{allocation.policy}" builds its own',
            'remove the [[virtual_workers]] tables, or set policy = "explicit" under [allocation]',
        )
    by_name = {node.name: node for node in nodes}
    owner: dict[GpuRef, str] = {}
    specs = []
    for i, table in enumerate(tables):
        table.only(_VW_KEYS)
        refs = []
        texts = table.strings("gpus", placeholder='["<node>:<gpu index>", ...]', nonempty=True)
        for j, text in enumerate(texts):
            ref = _gpu_ref(table, f"gpus[{j}]", text, by_name)
            if ref in owner:
                where = owner[ref]
                if where == f"virtual_workers[{i}]":
                    table.fail(
                        f"gpus[{j}]",
                        f'GPU "{ref}" appears twice in this virtual worker',
                        "list each GPU once",
                    )
                table.fail(
                    f"gpus[{j}]",
                    f'GPU "{ref}" is already in {where}',
                    "a GPU can belong to only one virtual worker: remove it from one of them",
                )
            owner[ref] = f"virtual_workers[{i}]"
            refs.append(ref)
        layers = table.ints("layers", None, placeholder="[<int >= 1>, ...]", ge=1)
        if layers is not None and len(layers) != len(refs):
            table.fail(
                "layers",
                f"has {len(layers)} entries but gpus has {len(refs)}",
                "give one layer count per GPU, in the same order as gpus (or drop layers to let "
                "the partitioner choose)",
            )
        specs.append(VirtualWorkerSpec(gpus=tuple(refs), layers=layers))
    return tuple(specs)


def _gpu_ref(table: _Table, key: str, text: str, nodes: Mapping[str, Node]) -> GpuRef:
    try:
        ref = GpuRef.parse(text)
    except ValueError:
        table.fail(key, f"{_show(text)} is not a GPU reference", 'write "node-name:gpu-index", e.g. "n0:1"')
    if ref.node not in nodes:
        known = list(nodes)
        table.fail(
            key,
            f'unknown node "{ref.node}" in "{text}"',
            f"known nodes: {', '.join(known)}{did_you_mean(ref.node, known)}",
        )
    count = len(nodes[ref.node].gpus)
    if ref.index >= count:
        table.fail(
            key,
            f'node "{ref.node}" has no GPU {ref.index}',
            f'node "{ref.node}" has {count} GPU{"s" if count != 1 else ""}: use index 0..{count - 1}',
        )
    return ref


# ---------------------------------------------------------------------------------------------- tables

_REQUIRED: Any = object()
_NAME_FIX = "use only letters, digits, '-' and '_'"


@dataclass(frozen=True)
class _Table:
    """One TOML table being read: where it is (field path) and how a fix line names it."""

    file: str  # how errors name the document: its path, or "path with --set ..."
    where: str  # field path of the table: "", "wsp", "nodes[2]", "gpu_types.titan-v"
    under: str  # how a fix line names the table: "under [wsp]", "in the 3rd [[nodes]] table"
    data: Mapping[str, Any]

    def at(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, what: str, fix: str) -> NoReturn:
        _fail(self.file, self.at(key), what, fix)

    def only(self, allowed: Sequence[str]) -> None:
        """Reject the first key (in file order) that is not in `allowed`."""
        for key in self.data:
            if key not in allowed:
                home = [s for s, keys in _SECTIONS.items() if key in keys and s != self.where]
                moved = f" (`{key}` belongs under [{home[0]}])" if len(home) == 1 else ""
                self.fail(
                    _key(key),
                    "unknown key",
                    f"allowed keys {self.under}: {', '.join(allowed)}{did_you_mean(key, allowed)}{moved}",
                )

    def _get(self, key: str, default: Any, placeholder: str) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _REQUIRED:
            self.fail(key, "required field is missing", f"add `{key} = {placeholder}` {self.under}")
        return default

    def _type_error(self, key: str, value: Any, kind: str, placeholder: str) -> NoReturn:
        self.fail(
            key,
            f"expected {kind}, got {_show(value)} ({_kind_of(value)})",
            f"write `{key} = {placeholder}` {self.under}",
        )

    def _check_range(self, key: str, value: float, kind: str, **bounds: float | None) -> None:
        if not _in_range(value, **bounds):
            text = _range_text(**bounds)
            self.fail(
                key, f"must be {text}, got {_show(value)}", f"set `{key}` {self.under} to {kind} {text}"
            )

    def string(self, key: str, default: Any = _REQUIRED, *, nonempty: bool = False) -> str:
        value = self._get(key, default, '"<str>"')
        if not isinstance(value, str):
            self._type_error(key, value, "a string", '"<str>"')
        if nonempty and not value:
            self.fail(key, "must not be empty", f'set `{key} = "<str>"` {self.under}')
        return value

    def name(self, key: str) -> str:
        value = self.string(key)
        if not _NAME.fullmatch(value):
            self.fail(key, f"invalid name {_show(value)}", _NAME_FIX)
        return value

    def integer(
        self, key: str, default: Any = _REQUIRED, *, ge: int | None = None, le: int | None = None
    ) -> int:
        placeholder = f"<int {_range_text(ge=ge, le=le)}>" if ge is not None or le is not None else "<int>"
        value = self._get(key, default, placeholder)
        if not isinstance(value, int) or isinstance(value, bool):
            self._type_error(key, value, "an integer", placeholder)
        self._check_range(key, value, "an integer", ge=ge, le=le)
        return value

    def number(
        self,
        key: str,
        default: Any = _REQUIRED,
        *,
        placeholder: str | None = None,
        kind: str = "a number",
        gt: float | None = None,
        ge: float | None = None,
        lt: float | None = None,
    ) -> float:
        placeholder = placeholder or f"<float {_range_text(gt=gt, ge=ge, lt=lt)}>"
        value = self._get(key, default, placeholder)
        if not isinstance(value, int | float) or isinstance(value, bool):
            self._type_error(key, value, kind, placeholder)
        if not math.isfinite(value):
            self.fail(
                key, f"must be a finite number, got {_show(value)}", f"set `{key}` {self.under} to {kind}"
            )
        self._check_range(key, value, "a number", gt=gt, ge=ge, lt=lt)
        return float(value)

    def boolean(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self._get(key, default, "<true|false>")
        if not isinstance(value, bool):
            self._type_error(key, value, "a boolean", "true or false")
        return value

    def registered(self, key: str, default: Any, registry: Registry[Any]) -> str:
        """A name of `registry` (a schedule, an aggregation rule): one it knows, or "package.module:attr"
        naming one defined outside hetpipe, imported here to check it."""
        names = registry.names()
        placeholder = " | ".join(f'"{c}"' for c in names)
        value = self._get(key, default, placeholder)
        if not isinstance(value, str):
            self._type_error(key, value, "a string", placeholder)
        if ":" in value:
            try:
                registry.get(value)
            except UsageError as exc:
                self.fail(key, f"cannot use {_show(value)}", str(exc).replace("\n", " "))
        elif value not in registry:
            self.fail(
                key,
                f"unknown value {_show(value)}",
                f"choose one of: {', '.join(names)}{did_you_mean(value, names)}, or name one of your own "
                f'as "package.module:attr"',
            )
        return value

    def choice(self, key: str, default: Any, choices: Sequence[str]) -> Any:
        placeholder = " | ".join(f'"{c}"' for c in choices)
        value = self._get(key, default, placeholder)
        if not isinstance(value, str):
            self._type_error(key, value, "a string", placeholder)
        if value not in choices:
            self.fail(
                key,
                f"unknown value {_show(value)}",
                f"choose one of: {', '.join(choices)}{did_you_mean(value, choices)}",
            )
        return value

    def strings(self, key: str, *, placeholder: str, nonempty: bool = False) -> tuple[str, ...]:
        value = self._get(key, _REQUIRED, placeholder)
        if not isinstance(value, list):
            self._type_error(key, value, "an array of strings", placeholder)
        if nonempty and not value:
            self.fail(key, "must not be empty", f"write `{key} = {placeholder}` {self.under}")
        for j, item in enumerate(value):
            if not isinstance(item, str):
                self.fail(
                    f"{key}[{j}]",
                    f"expected a string, got {_show(item)} ({_kind_of(item)})",
                    f"write `{key} = {placeholder}` {self.under} (strings need quotes)",
                )
        return tuple(value)

    def ints(self, key: str, default: Any, *, placeholder: str, ge: int) -> tuple[int, ...] | None:
        value = self._get(key, default, placeholder)
        if value is None:
            return None
        if not isinstance(value, list):
            self._type_error(key, value, "an array of integers", placeholder)
        for j, item in enumerate(value):
            if not isinstance(item, int) or isinstance(item, bool):
                self.fail(
                    f"{key}[{j}]",
                    f"expected an integer, got {_show(item)} ({_kind_of(item)})",
                    f"write `{key} = {placeholder}` {self.under}",
                )
            if item < ge:
                self.fail(
                    f"{key}[{j}]",
                    f"must be >= {ge}, got {item}",
                    f"write `{key} = {placeholder}` {self.under}",
                )
        return tuple(value)

    def options(self, key: str) -> FrozenMap:
        value = self.data.get(key, {})
        if not isinstance(value, dict):
            self._type_error(key, value, "a table", "{ <key> = <value>, ... }")
        return FrozenMap(value)

    def section(self, key: str, allowed: Sequence[str] | None = None) -> _Table:
        """A sub-table (absent: empty), its keys checked against `allowed` when given."""
        value = self.data.get(key, {})
        where = self.at(_key(key))
        if not isinstance(value, dict):
            self.fail(
                _key(key),
                f"expected a table, got {_show(value)} ({_kind_of(value)})",
                f"write it as a [{where}] section",
            )
        table = _Table(self.file, where, f"under [{where}]", value)
        if allowed is not None:
            table.only(allowed)
        return table

    def array(self, key: str) -> list[_Table]:
        """An array of tables (absent: empty)."""
        value = self.data.get(key, [])
        if not isinstance(value, list):
            self.fail(
                key,
                f"expected an array of tables, got {_kind_of(value)}",
                f"write each entry as a [[{key}]] table (double brackets)",
            )
        tables = []
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                self.fail(
                    f"{key}[{i}]",
                    f"expected a table, got {_show(item)} ({_kind_of(item)})",
                    f"write each entry as a [[{key}]] table (double brackets)",
                )
            tables.append(
                _Table(self.file, self.at(f"{key}[{i}]"), f"in the {_ordinal(i + 1)} [[{key}]] table", item)
            )
        return tables


# ---------------------------------------------------------------------------------------------- messages


def _fail(file: Path | str, where: str, what: str, fix: str) -> NoReturn:
    head = f"{file}: {where}: {what}" if where else f"{file}: {what}"
    raise ConfigError(f"{head}\n  {fix}")


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def _show(value: Any) -> str:
    """A value as TOML would write it, shortened."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, list):
        text = "[" + ", ".join(_show(item) for item in value) + "]"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{_key(k)} = {_show(v)}" for k, v in value.items()) + "}"
    else:
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind_of(value: Any) -> str:
    kinds = [
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a float"),
        (str, "a string"),
        (list, "an array"),
        (dict, "a table"),
    ]
    return next((name for kind, name in kinds if isinstance(value, kind)), "a date/time")


def _in_range(
    value: float,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> bool:
    return (
        (gt is None or value > gt)
        and (ge is None or value >= ge)
        and (lt is None or value < lt)
        and (le is None or value <= le)
    )


def _range_text(
    *, gt: float | None = None, ge: float | None = None, lt: float | None = None, le: float | None = None
) -> str:
    """ ">= 0", "> 0", "in (0, 1)", "in [1024, 65535]"."""
    low = f"[{ge}" if ge is not None else f"({gt}" if gt is not None else None
    high = f"{le}]" if le is not None else f"{lt})" if lt is not None else None
    if low and high:
        return f"in {low}, {high}"
    if low:
        return f">= {ge}" if ge is not None else f"> {gt}"
    if high:
        return f"<= {le}" if le is not None else f"< {lt}"
    return ""


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"

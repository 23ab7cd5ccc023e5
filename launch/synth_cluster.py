"""A synthetic cluster config for the planner's tests and benchmarks: GPU types, counts, nodes, links and
model in, a cluster TOML in the format of launch/clusters/*.toml out. Pure but for the file it writes.

    python launch/synth_cluster.py --types 8 --gpus 1024 --nodes 128 --model resnet152 --out /tmp/c.toml
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GpuType", "SynthCluster", "random_cluster", "standard_types", "synth_cluster", "to_toml"]

# public FP32 TFLOPS and memories of real cards, as in launch/clusters/paper-16gpu.toml (only ratios matter)
_CARDS = (
    ("a100", 19.5, 40.0),
    ("titan-rtx", 16.3, 24.0),
    ("titan-v", 14.9, 12.0),
    ("v100", 14.0, 16.0),
    ("gtx-1080-ti", 11.3, 11.0),
    ("t4", 8.1, 16.0),
    ("rtx-2060", 6.5, 6.0),
    ("p4000", 5.3, 8.0),
)


@dataclass(frozen=True)
class GpuType:
    name: str
    speed: float  # read as FP32 TFLOPS when profiles are derived by FLOP rate
    memory_gib: float


@dataclass(frozen=True)
class SynthCluster:
    """A cluster to write: its types, each node's GPU types, links, model and batch."""

    name: str
    types: tuple[GpuType, ...]
    nodes: tuple[tuple[str, ...], ...]  # GPU type names per node
    intra_node_gbps: float = 100.0
    inter_node_gbps: float = 56.0
    shards: int = 4
    model: str = "resnet152"
    batch_size: int = 32
    nm: int = 4


def standard_types(count: int) -> tuple[GpuType, ...]:
    """The first `count` of eight real cards (more: numbered copies at lower speeds)."""
    if count < 1:
        raise ValueError(f"--types must be >= 1, got {count}")
    out = [GpuType(*card) for card in _CARDS[:count]]
    for i in range(len(out), count):
        name, speed, memory = _CARDS[i % len(_CARDS)]
        out.append(GpuType(f"{name}-{i}", round(speed * 0.9 ** (i // len(_CARDS)), 2), memory))
    return tuple(out)


def synth_cluster(
    types: int,
    gpus: int,
    nodes: int,
    *,
    model: str = "resnet152",
    inter_node_gbps: float = 56.0,
    shards: int = 4,
    name: str = "",
) -> SynthCluster:
    """`gpus` GPUs of `types` types in equal counts over `nodes` nodes of equal size, one type per node as in
    the paper's cluster (type i on nodes i, i + types, ...): nodes must be a multiple of types and divide
    gpus."""
    if nodes < 1 or gpus % nodes or nodes % types:
        raise ValueError(
            f"{gpus} GPUs of {types} types on {nodes} nodes: nodes must be a multiple of the types "
            "and divide the GPUs (e.g. --types 8 --gpus 64 --nodes 8)"
        )
    kinds = standard_types(types)
    per_node = gpus // nodes
    layout = tuple((kinds[n % types].name,) * per_node for n in range(nodes))
    return SynthCluster(
        name or f"synth-{gpus}gpu-{types}type",
        kinds,
        layout,
        inter_node_gbps=inter_node_gbps,
        shards=shards,
        model=model,
    )


def random_cluster(rng: random.Random, *, max_gpus: int = 8, max_types: int = 3) -> SynthCluster:
    """A small random cluster: 1 to max_types types, 2 to max_gpus GPUs, 1 to 4 nodes of mixed types,
    random links, shards and batch; the model mnist-cnn or resnet18 (fast to plan)."""
    kinds = [
        GpuType(f"g{i}", round(rng.uniform(2.0, 20.0), 1), rng.choice((4.0, 8.0, 12.0, 24.0)))
        for i in range(rng.randint(1, max_types))
    ]
    total = rng.randint(2, max_gpus)
    nodes: list[list[str]] = [[] for _ in range(rng.randint(1, min(4, total)))]
    for g in range(total):
        nodes[g % len(nodes)].append(rng.choice(kinds).name)
    used = {t for node in nodes for t in node}
    return SynthCluster(
        f"random-{total}gpu",
        tuple(k for k in kinds if k.name in used),
        tuple(tuple(node) for node in nodes),
        intra_node_gbps=rng.choice((25.0, 100.0)),
        inter_node_gbps=rng.choice((1.0, 10.0, 56.0)),
        shards=rng.randint(1, 4),
        model=rng.choice(("mnist-cnn", "resnet18")),
        batch_size=32,
        nm=rng.randint(1, 4),
    )


def to_toml(cluster: SynthCluster) -> str:
    """The cluster as a config file of launch/clusters/*.toml's format (real GPUs: emulation off)."""
    lines = [f'name = "{cluster.name}"', "seed = 0", ""]
    for t in cluster.types:
        lines += [f"[gpu_types.{t.name}]", f"speed = {t.speed}", f"memory_gib = {t.memory_gib}", ""]
    for n, gpus in enumerate(cluster.nodes):
        listed = ", ".join(f'"{g}"' for g in gpus)
        lines += ["[[nodes]]", f'name = "n{n}"', 'host = "127.0.0.1"', f"gpus = [{listed}]", ""]
    data = "[3, 28, 28]" if cluster.model == "mnist-cnn" else "[3, 224, 224]"
    classes = 10 if cluster.model == "mnist-cnn" else 1000
    lines += [
        "[network]",
        f"intra_node_gbps = {cluster.intra_node_gbps}",
        f"inter_node_gbps = {cluster.inter_node_gbps}",
        "",
        "[ps]",
        'host = "127.0.0.1"',
        "port = 7500",
        f"shards = {cluster.shards}",
        'placement = "balanced"',
        "",
        "[wsp]",
        "staleness = 0",
        f"nm = {cluster.nm}",
        "",
        "[model]",
        f'name = "{cluster.model}"',
        "options = {}",
        "",
        "[data]",
        'name = "synthetic"',
        f"options = {{ input_shape = {data}, num_classes = {classes}, n = 256 }}",
        "",
        "[train]",
        f"batch_size = {cluster.batch_size}",
        "waves = 20",
        'optimizer = "momentum"',
        "lr = 0.01",
        f'out_dir = "runs/{cluster.name}"',
        "",
        "[emulation]",
        "enabled = false",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", type=int, default=8)
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--model", default="resnet152")
    parser.add_argument("--inter-node-gbps", type=float, default=56.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        cluster = synth_cluster(
            args.types,
            args.gpus,
            args.nodes,
            model=args.model,
            inter_node_gbps=args.inter_node_gbps,
            shards=args.shards,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(to_toml(cluster))
    print(f"wrote {args.out}: {args.gpus} GPUs, {args.types} types, {args.nodes} nodes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

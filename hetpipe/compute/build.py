"""What a cluster config builds: its model spec, its dataset, its virtual workers' layouts, the PS
placement."""

from __future__ import annotations

from dataclasses import dataclass

from hetpipe.compute import data as datalib
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import UsageError
from hetpipe.core.planning.cluster import allocate
from hetpipe.core.protocol.placement import get_placement, layer_shards, local_placement
from hetpipe.core.wsp.audit import audit_key
from hetpipe.models import ModelSpec, build_stage, even_split, get_model, named_stage_tensors, param_counts

__all__ = ["VwLayout", "audit_shape", "dataset_of", "model_of", "ps_placement", "vw_layouts"]


@dataclass(frozen=True)
class VwLayout:
    """One virtual worker as it runs: its GPUs in stage order and the layers of each stage."""

    gpus: tuple[str, ...]
    split: tuple[int, ...]


def model_of(config: ClusterConfig) -> ModelSpec:
    return get_model(config.model.name, seed=config.seed, **config.model.options.to_dict())


def dataset_of(config: ClusterConfig) -> datalib.DatasetSplit:
    return datalib.load_dataset(
        config.data.name,
        test_fraction=config.data.test_fraction,
        seed=config.seed,
        **config.data.options.to_dict(),
    )


def vw_layouts(config: ClusterConfig, spec: ModelSpec) -> tuple[VwLayout, ...]:
    """The config's virtual workers with their splits (given, or balanced by parameter count)."""
    if config.allocation.policy != "explicit":
        groups = [tuple(str(g) for g in vw) for vw in allocate(config, config.allocation.policy)]
        specs: list[tuple[tuple[str, ...], tuple[int, ...] | None]] = [(g, None) for g in groups]
    else:
        specs = [(tuple(str(g) for g in vw.gpus), vw.layers) for vw in config.virtual_workers]
    counts = param_counts(spec)
    out = []
    for i, (gpus, split) in enumerate(specs):
        if split is not None and sum(split) != spec.num_layers:
            raise UsageError(
                f"{config.path}: virtual_workers[{i}].layers sums to {sum(split)} but model "
                f"{spec.name} has {spec.num_layers} layers: make the counts add up"
            )
        out.append(VwLayout(gpus, tuple(split) if split else tuple(even_split(counts, len(gpus)))))
    if not out:
        raise UsageError(
            f"{config.path}: no virtual workers: list [[virtual_workers]] or set [allocation] policy"
        )
    return tuple(out)


def audit_shape(config: ClusterConfig, num_vws: int) -> tuple[int, int]:
    """Shape of an audit ledger: one row per VW, one column per minibatch."""
    return num_vws, config.train.waves * config.wsp.nm


def ps_placement(
    config: ClusterConfig, spec: ModelSpec, audit_vws: int = 0, first_vw: VwLayout | None = None
) -> dict[str, int]:
    """Shard of every synced key of the whole model (computed on the meta device, split-independent); the
    "local" placement follows `first_vw`, the run's first VW (every stage of the run must pass the same
    one)."""
    whole = build_stage(spec, 0, spec.num_layers, "meta")
    sizes = {k: t.numel() * 4 for k, t in named_stage_tensors(whole).items()}  # the PS holds float32
    if audit_vws:
        rows, cols = audit_shape(config, audit_vws)
        sizes.update({audit_key(layer): rows * cols * 4 for layer in range(spec.num_layers)})
    if config.ps.placement == "local":
        if first_vw is None:
            raise UsageError('placement = "local" follows the first VW\'s layout: pass it (first_vw)')
        nodes = [n.name for n in config.nodes]
        return local_placement(sizes, layer_shards(first_vw.gpus, first_vw.split, nodes))
    return get_placement(config.ps.placement)(sizes, config.ps.shards)

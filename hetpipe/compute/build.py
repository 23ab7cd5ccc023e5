"""What a cluster config builds: its model spec, its dataset, its virtual workers' layouts, the PS
placement."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hetpipe.compute import data as datalib
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import UsageError
from hetpipe.core.planning.cluster import allocate
from hetpipe.core.protocol.placement import get_placement, layer_shards, local_placement
from hetpipe.core.wsp.aggregation import get_aggregation
from hetpipe.core.wsp.audit import audit_key
from hetpipe.core.wsp.handover import optimizer_sources
from hetpipe.core.wsp.work import VwWork
from hetpipe.models import ModelSpec, build_stage, even_split, get_model, named_stage_tensors, param_counts

__all__ = [
    "VwLayout",
    "audit_shape",
    "check_init",
    "dataset_of",
    "handover_sources",
    "model_of",
    "ps_placement",
    "run_work",
    "start_from_init",
    "vw_config",
    "vw_layouts",
]


@dataclass(frozen=True)
class VwLayout:
    """One virtual worker as it runs: its GPUs in stage order, the layers of each stage, its work per wave
    (Nm minibatches of `batch` samples; 0: the config's [wsp] nm and [train] batch_size) and the waves
    [start, end) it trains (None: all; docs/wsp.md#planned-spans)."""

    gpus: tuple[str, ...]
    split: tuple[int, ...]
    nm: int = 0
    batch: int = 0
    waves: tuple[int, int] | None = None

    def span(self, num_waves: int) -> tuple[int, int]:
        """The waves [start, end) this VW trains in a run of `num_waves`."""
        return self.waves or (0, num_waves)

    def work(self, config: ClusterConfig) -> VwWork:
        """This VW's Nm and minibatch size."""
        return VwWork(self.nm or config.wsp.nm, self.batch or config.train.batch_size)


def vw_config(config: ClusterConfig, layout: VwLayout) -> ClusterConfig:
    """The config as one VW runs it: [wsp] nm and [train] batch_size are that VW's own."""
    work = layout.work(config)
    if (work.nm, work.batch) == (config.wsp.nm, config.train.batch_size):
        return config
    return replace(
        config,
        wsp=replace(config.wsp, nm=work.nm),
        train=replace(config.train, batch_size=work.batch),
    )


def handover_sources(config: ClusterConfig, vws: tuple[VwLayout, ...]) -> dict[int, int]:
    """VW -> the VW whose optimizer state it starts with at a re-plan (hetpipe.core.wsp.handover); none when
    no VW has a planned span or the PS runs the optimizer."""
    if not any(lay.waves for lay in vws) or not get_aggregation(config.ps.aggregation).local_optimizer:
        return {}
    return optimizer_sources([lay.span(config.train.waves) for lay in vws])


def run_work(config: ClusterConfig, vws: tuple[VwLayout, ...]) -> tuple[VwWork, ...]:
    """Every VW's work per wave, in VW order."""
    return tuple(lay.work(config) for lay in vws)


def model_of(config: ClusterConfig) -> ModelSpec:
    return get_model(config.model.name, seed=config.seed, **config.model.options.to_dict())


def _init_state(config: ClusterConfig) -> dict[str, torch.Tensor]:
    """[model] init's tensors: a state dict by the model's key names (a run's model.pt)."""
    path = Path(config.model.init)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError, ValueError) as exc:
        raise UsageError(
            f"{config.path}: model.init = {str(path)!r} cannot be read ({exc}); give a state dict file, e.g. "
            "an earlier run's model.pt (relative to the working directory)"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UsageError(f"{config.path}: model.init = {str(path)!r} is not a state dict of tensors")
    return state


def check_init(config: ClusterConfig, spec: ModelSpec) -> None:
    """UsageError unless [model] init (when set) holds every weight and buffer of the model, each in its
    shape, and nothing else."""
    if not config.model.init:
        return
    state = _init_state(config)
    want = build_stage(spec, 0, spec.num_layers, "meta").state_dict()
    missing = [k for k in want if k not in state]
    extra = [k for k in state if k not in want]
    shapes = [k for k in want if k in state and tuple(state[k].shape) != tuple(want[k].shape)]
    for what, keys in (
        ("lacks", missing),
        ("has keys the model does not:", extra),
        ("has other shapes for", shapes),
    ):
        if keys:
            raise UsageError(
                f"{config.path}: model.init = {config.model.init!r} {what} {', '.join(keys[:4])}"
                f"{' ...' if len(keys) > 4 else ''}: it is not a state of model {spec.name} with these "
                "options; give the model.pt of a run of the same model"
            )


def start_from_init(module: torch.nn.Module, config: ClusterConfig) -> None:
    """Set a stage's weights and buffers to [model] init's (nothing without one)."""
    if not config.model.init:
        return
    state = _init_state(config)
    module.load_state_dict({k: state[k] for k in module.state_dict()}, strict=True)


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
        specs: list[tuple[tuple[str, ...], tuple[int, ...] | None, int, int, tuple[int, int] | None]] = [
            (g, None, 0, 0, None) for g in groups
        ]
    else:
        specs = [
            (tuple(str(g) for g in vw.gpus), vw.layers, vw.nm or 0, vw.batch_size or 0, vw.waves)
            for vw in config.virtual_workers
        ]
    for wave, layers in config.train.freeze:
        if layers >= spec.num_layers:
            raise UsageError(
                f"{config.path}: train.freeze freezes {layers} layers from wave {wave}, but model "
                f"{spec.name} has {spec.num_layers}: freeze at most {spec.num_layers - 1} (one layer stays "
                "trainable)"
            )
    counts = param_counts(spec)
    out = []
    for i, (gpus, split, nm, batch, waves) in enumerate(specs):
        if split is not None and sum(split) != spec.num_layers:
            raise UsageError(
                f"{config.path}: virtual_workers[{i}].layers sums to {sum(split)} but model "
                f"{spec.name} has {spec.num_layers} layers: make the counts add up"
            )
        split = tuple(split) if split else tuple(even_split(counts, len(gpus)))
        out.append(VwLayout(gpus, split, nm, batch, waves))
    if not out:
        raise UsageError(
            f"{config.path}: no virtual workers: list [[virtual_workers]] or set [allocation] policy"
        )
    return tuple(out)


def audit_shape(waves: int, nms: tuple[int, ...]) -> tuple[int, int]:
    """Shape of an audit ledger: one row per VW, one column per minibatch of the VW with the most."""
    return len(nms), waves * max(nms)


def ps_placement(
    config: ClusterConfig,
    spec: ModelSpec,
    audit: tuple[int, int] | None = None,
    first_vw: VwLayout | None = None,
) -> dict[str, int]:
    """Shard of every synced key of the whole model (computed on the meta device, split-independent), with
    audit ledgers of shape `audit`; the "local" placement follows `first_vw`, the run's first VW (every stage
    of the run must pass the same one)."""
    whole = build_stage(spec, 0, spec.num_layers, "meta")
    sizes = {k: t.numel() * 4 for k, t in named_stage_tensors(whole).items()}  # the PS holds float32
    if audit:
        rows, cols = audit
        sizes.update({audit_key(layer): rows * cols * 4 for layer in range(spec.num_layers)})
    if config.ps.placement == "local":
        if first_vw is None:
            raise UsageError('placement = "local" follows the first VW\'s layout: pass it (first_vw)')
        nodes = [n.name for n in config.nodes]
        return local_placement(sizes, layer_shards(first_vw.gpus, first_vw.split, nodes))
    return get_placement(config.ps.placement)(sizes, config.ps.shards)

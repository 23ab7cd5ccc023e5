"""A decoded TOML document -> a validated ClusterConfig: the top-level keys, each section through its parser,
then the checks that span sections."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hetpipe.core.config.gpus import _gpu_types, _nodes, _virtual_workers
from hetpipe.core.config.schema import (
    _SECTIONS,
    _TOP_KEYS,
    ClusterConfig,
    Node,
    PsConfig,
    TrainConfig,
    VirtualWorkerSpec,
    WspConfig,
)
from hetpipe.core.config.sections import (
    _allocation,
    _checkpoint,
    _data,
    _emulation,
    _model,
    _network,
    _ps,
    _train,
    _wsp,
)
from hetpipe.core.config.table import _Table
from hetpipe.core.pipeline.mitigation import mitigation_conflicts
from hetpipe.core.pipeline.schedule import SCHEDULES
from hetpipe.core.wsp.aggregation import AGGREGATIONS, get_aggregation

__all__ = ["parse_config"]

_MAX_SEED = 2**32 - 1  # numpy's legacy seeding rejects larger seeds


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
    virtual_workers = _virtual_workers(top, allocation, nodes, train.waves)
    _check_across_sections(sections, nodes, ps, train, wsp)
    _check_planned_spans(sections, virtual_workers, ps, train)
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


def _check_across_sections(
    sections: Mapping[str, _Table], nodes: tuple[Node, ...], ps: PsConfig, train: TrainConfig, wsp: WspConfig
) -> None:
    """What no section can check alone: one shard per node under placement "local" or "spread", and
    mitigations that fit the aggregation rule and the schedule's weight stashing."""
    if ps.shard_per_node and ps.shards != len(nodes):
        sections["ps"].fail(
            "shards",
            f'is {ps.shards} but placement = "{ps.placement}" runs one shard on each of the '
            f"{len(nodes)} nodes",
            f'set shards = {len(nodes)}, or placement = "balanced"',
        )
    for what, fix in mitigation_conflicts(
        train.mitigations,
        aggregation=ps.aggregation,
        schedule_stashing=SCHEDULES[train.schedule].stashing,
        weight_stashing=train.weight_stashing,
    ):
        sections["train"].fail("mitigation", what, fix)
    _check_local_controls(sections["train"], ps, train)
    _check_freeze(sections["train"], ps, train, wsp)
    _check_node_aggregation(sections["ps"], ps, wsp, len(nodes))


def _check_freeze(t: _Table, ps: PsConfig, train: TrainConfig, wsp: WspConfig) -> None:
    """Freezing stops a layer's updates; a PS that runs the optimizer would still move it (momentum), a
    mitigation would still predict or correct it, and a skipped minibatch is not told to the frozen stages
    (they receive no gradient to carry it)."""
    if not train.freezes:
        return
    key, off = "freeze", "remove freeze"
    if not train.freeze:
        key, off = "autofreeze_every", "set autofreeze_every = 0"
    first = f" from [{train.freeze[0][0]}, {train.freeze[0][1]}]" if train.freeze else ""
    if not get_aggregation(ps.aggregation).local_optimizer:
        local = " or ".join(f'"{n}"' for n, r in AGGREGATIONS.items() if r.local_optimizer)
        t.fail(
            key,
            f'freezes layers{first}, but with ps.aggregation = "{ps.aggregation}" the PS steps every '
            "layer's weights (its momentum moves a frozen layer too)",
            f"set [ps] aggregation = {local}, or {off}",
        )
    if train.mitigations:
        t.fail(
            key,
            f'freezes layers, but mitigation = "{train.mitigation}" predicts or corrects the weights of '
            "every layer",
            f'set mitigation = "none", or {off}',
        )
    if train.on_nan == "skip":
        t.fail(
            key,
            'freezes layers, but on_nan = "skip" tells each stage of a skipped minibatch through its '
            "gradient, which a frozen stage no longer receives",
            f'set on_nan = "stop", or {off}',
        )
    if train.autofreeze_every:
        _check_autofreeze(t, ps, wsp)


def _check_autofreeze(t: _Table, ps: PsConfig, wsp: WspConfig) -> None:
    """The adaptive rule learns its movement records from exact pulls straight from the shards."""
    if wsp.pull != "exact":
        t.fail(
            "autofreeze_every",
            f'is set, but [wsp] pull = "{wsp.pull}": the movement the rule decides by comes with exact pulls',
            'set [wsp] pull = "exact", or autofreeze_every = 0',
        )
    if ps.node_aggregation:
        t.fail(
            "autofreeze_every",
            "is set, but [ps] node_aggregation = true: a node's relay does not pass the movement records "
            "on yet",
            "set node_aggregation = false, or autofreeze_every = 0",
        )


def _check_planned_spans(
    sections: Mapping[str, _Table], vws: tuple[VirtualWorkerSpec, ...], ps: PsConfig, train: TrainConfig
) -> None:
    """VWs that train some waves only (a planned re-plan, docs/wsp.md#planned-spans): refuse what counts the
    VWs once for the whole run."""
    spanned = next((i for i, vw in enumerate(vws) if vw.waves is not None), None)
    if spanned is None:
        return
    which = f"virtual_workers[{spanned}] trains waves {list(vws[spanned].waves or ())} only"
    for field, what, (why, fix) in planned_span_conflicts(ps, train):
        section, key = field.split(".")
        sections[section].fail(key, f"{what}, but {which}: {why}", fix)


def planned_span_conflicts(ps: PsConfig, train: TrainConfig) -> list[tuple[str, str, tuple[str, str]]]:
    """What refuses VWs that train some waves only (docs/wsp.md#planned-spans): (field, what it is, (why,
    fix)) for each setting that counts the VWs once for the whole run."""
    found = []
    if ps.node_aggregation:
        found.append(
            (
                "ps.node_aggregation",
                "is true",
                ("a node's relay serves the same VWs for the whole run", "set node_aggregation = false"),
            )
        )
    if ps.on_vw_failure == "evict":
        found.append(
            (
                "ps.on_vw_failure",
                'is "evict"',
                (
                    "eviction and rejoin do not yet plan around VWs that end or start mid-run",
                    'set on_vw_failure = "stop" (a failed run resumes with `hetpipe train --resume`)',
                ),
            )
        )
    if train.autofreeze_every:
        found.append(
            (
                "train.autofreeze_every",
                f"is {train.autofreeze_every}",
                (
                    "a re-plan is planned at fixed freeze points, and the adaptive rule decides its own",
                    "list the freeze points in [train] freeze, or set autofreeze_every = 0",
                ),
            )
        )
    counted = [m for m in train.mitigations if m in ("average", "warmup")]
    if counted:
        found.append(
            (
                "train.mitigation",
                f'is "{train.mitigation}"',
                (f'"{counted[0]}" counts the VWs once for the whole run', 'drop "average" and "warmup"'),
            )
        )
    return found


def _check_node_aggregation(t: _Table, ps: PsConfig, wsp: WspConfig, nodes: int) -> None:
    """Node-local aggregation's relays serve exact pulls, stop the run when a VW fails, take no CURVE keys
    yet, and listen between the shards' ports and the VWs' rendezvous ports (ps.port + 50 ..; docs/wsp.md)."""
    if not ps.node_aggregation:
        return
    if ps.shards > 50 or 50 + nodes * ps.shards > 100:
        t.fail(
            "node_aggregation",
            f"is true with {ps.shards} shards on {nodes} nodes: the relays' ports ps.port + 50 + "
            "node x shards + shard would run into the VWs' rendezvous ports (ps.port + 100 + vw)",
            "use fewer shards, or node_aggregation = false",
        )
    for field, value, needed, fix in (
        ("on_vw_failure", ps.on_vw_failure, "stop", 'set [ps] on_vw_failure = "stop"'),
        ("auth", ps.auth, "none", 'set [ps] auth = "none" (the relays take no CURVE keys yet)'),
    ):
        if value != needed:
            t.fail(
                field,
                f"is {value!r} but node_aggregation = true needs {needed!r}",
                f"{fix}, or node_aggregation = false",
            )
    if wsp.pull != "exact":
        t.fail(
            "node_aggregation",
            f'is true but [wsp] pull = "{wsp.pull}": a relay serves exact pulls only',
            '[wsp] pull = "exact", or node_aggregation = false',
        )


def _check_local_controls(t: _Table, ps: PsConfig, train: TrainConfig) -> None:
    """lr_schedule and clip_grad_norm act on the stages' local updates, which an aggregation rule running the
    optimizer at the PS does not make."""
    if get_aggregation(ps.aggregation).local_optimizer:
        return
    local = [n for n, r in AGGREGATIONS.items() if r.local_optimizer]
    fix = f"set [ps] aggregation = {' or '.join(repr(n) for n in local)}".replace("'", '"')
    if train.lr_schedule != "constant":
        t.fail(
            "lr_schedule",
            f'is "{train.lr_schedule}", but with ps.aggregation = "{ps.aggregation}" the PS runs the '
            "optimizer at a fixed learning rate",
            f'{fix}, or lr_schedule = "constant"',
        )
    if train.clip_grad_norm:
        t.fail(
            "clip_grad_norm",
            f'is {train.clip_grad_norm:g}, but with ps.aggregation = "{ps.aggregation}" the stages make no '
            "local updates to clip",
            f"{fix}, or clip_grad_norm = 0",
        )

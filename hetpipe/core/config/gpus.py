"""The cluster's GPUs as a config declares them: [gpu_types], [[nodes]] and hand-listed [[virtual_workers]],
each checked against the others (known types, unique names, every GPU in at most one virtual worker at a
time, every wave trained by some virtual worker)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from hetpipe.core.config.messages import _key, _show
from hetpipe.core.config.schema import (
    _GPU_TYPE_KEYS,
    _NODE_KEYS,
    _VW_KEYS,
    AllocationConfig,
    FrozenMap,
    GpuRef,
    GpuType,
    Node,
    VirtualWorkerSpec,
)
from hetpipe.core.config.table import _NAME, _NAME_FIX, _Table
from hetpipe.core.errors import did_you_mean

_DEVICE = re.compile(r"cpu|cuda:[0-9]+")


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


def _virtual_workers(
    top: _Table, allocation: AllocationConfig, nodes: Sequence[Node], num_waves: int
) -> tuple[VirtualWorkerSpec, ...]:
    tables = top.array("virtual_workers")
    if tables and allocation.policy != "explicit":
        top.fail(
            "virtual_workers",
            f'listed, but allocation.policy = "{allocation.policy}" builds its own',
            'remove the [[virtual_workers]] tables, or set policy = "explicit" under [allocation]',
        )
    by_name = {node.name: node for node in nodes}
    owner: dict[GpuRef, list[tuple[str, tuple[int, float]]]] = {}  # GPU -> (VW, its waves) holding it
    specs = []
    for i, table in enumerate(tables):
        table.only(_VW_KEYS)
        waves = _vw_waves(table)
        span = waves or (0, math.inf)
        refs = []
        texts = table.strings("gpus", placeholder='["<node>:<gpu index>", ...]', nonempty=True)
        for j, text in enumerate(texts):
            ref = _gpu_ref(table, f"gpus[{j}]", text, by_name)
            if ref in refs:
                table.fail(
                    f"gpus[{j}]", f'GPU "{ref}" appears twice in this virtual worker', "list each GPU once"
                )
            for where, other in owner.get(ref, []):
                if span[0] < other[1] and other[0] < span[1]:
                    table.fail(
                        f"gpus[{j}]",
                        f'GPU "{ref}" is already in {where} during the same waves',
                        "a GPU can belong to only one virtual worker at a time: remove it from one of them, "
                        "or give the two `waves = [start, end]` that do not overlap",
                    )
            owner.setdefault(ref, []).append((f"virtual_workers[{i}]", span))
            refs.append(ref)
        layers = table.ints("layers", None, placeholder="[<int >= 1>, ...]", ge=1)
        if layers is not None and len(layers) != len(refs):
            table.fail(
                "layers",
                f"has {len(layers)} entries but gpus has {len(refs)}",
                "give one layer count per GPU, in the same order as gpus (or drop layers to let "
                "the partitioner choose)",
            )
        nm = table.integer("nm", ge=1) if "nm" in table.data else None
        batch = table.integer("batch_size", ge=1) if "batch_size" in table.data else None
        if waves is not None and waves[1] > num_waves:
            table.fail(
                "waves",
                f"ends at wave {waves[1]}, past the run's train.waves = {num_waves}",
                f"end it at {num_waves} at most, or raise train.waves",
            )
        specs.append(VirtualWorkerSpec(gpus=tuple(refs), layers=layers, nm=nm, batch_size=batch, waves=waves))
    _check_every_wave_trained(top, specs, num_waves)
    return tuple(specs)


def _check_every_wave_trained(top: _Table, specs: Sequence[VirtualWorkerSpec], num_waves: int) -> None:
    """With VWs that train some waves only (`waves = [start, end]`), every wave of the run needs one."""
    if not any(vw.waves for vw in specs):
        return
    spans = [vw.waves or (0, num_waves) for vw in specs]
    for wave in sorted({0, *(end for _, end in spans)}):
        if wave < num_waves and not any(start <= wave < end for start, end in spans):
            top.fail(
                "virtual_workers",
                f"no virtual worker trains wave {wave} (their waves: {[list(s) for s in spans]})",
                "give every wave of the run a VW: a later VW's waves start where an earlier one's end",
            )


def _vw_waves(table: _Table) -> tuple[int, int] | None:
    """A listed VW's `waves = [start, end]` (the waves start .. end - 1 it trains), or None (all)."""
    if "waves" not in table.data:
        return None
    span = table.ints("waves", None, placeholder="[<first wave>, <end wave>]", ge=0)
    if span is None or len(span) != 2 or span[0] >= span[1]:
        table.fail(
            "waves",
            f"is {list(span or [])}: it needs two wave numbers, start < end",
            "write waves = [start, end] for a VW that trains waves start .. end - 1 (e.g. [0, 4], then "
            "other VWs from [4, <train.waves>]), or drop it to train every wave",
        )
    return (span[0], span[1])


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

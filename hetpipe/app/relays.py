"""Start node-local aggregation's relays for `hetpipe train` (docs/wsp.md#node-local-aggregation): one relay
process per relayed group and PS shard, on the group's node, and the endpoints each VW's stages talk to."""

from __future__ import annotations

import queue as queue_mod
from typing import Any

from hetpipe.compute.build import VwLayout, run_work
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.runs.procs import ChildFailed, ChildGroup
from hetpipe.core.wsp.groups import group_node, node_groups, relayed
from hetpipe.core.wsp.work import sample_weights
from hetpipe.server.jobs import ShardJob
from hetpipe.server.relay import RelayJob, serve_relay

__all__ = ["start_relays"]


def start_relays(
    group: ChildGroup,
    config: ClusterConfig,
    vws: tuple[VwLayout, ...],
    endpoints: list[str],
    jobs: list[ShardJob],
) -> tuple[list[list[str]], list[Any]]:
    """With [ps] node_aggregation on, a relay per relayed group and shard; returns each VW's endpoints (its
    relays', or the shards') and the relays' children."""
    per_vw = [list(endpoints) for _ in vws]
    children: list[Any] = []
    gpus = [lay.gpus for lay in vws]
    groups = relayed(node_groups(gpus, config.ps.node_aggregation))
    if not groups:
        return per_vw, children
    weights = sample_weights(run_work(config, vws))
    for members in groups:
        node = config.node(group_node(gpus, members))
        mine = []
        for job, upstream in zip(jobs, endpoints, strict=True):
            settings = job.settings()
            relay = RelayJob(
                settings=settings.__class__(
                    **{**settings.__dict__, "endpoint": f"tcp://{node.host}:0", "keys": None}
                ),
                node=node.name,
                members=tuple(members),
                upstream=upstream,
                num_vws=len(vws),
                vw_weights=weights,
                timeout_s=config.ps.timeout_s,
                retry_s=min(2.0, config.ps.timeout_s / 4),
                heartbeat_s=config.ps.heartbeat_s or 2.0,
                wire_dtype=config.ps.wire_dtype,
            )
            port_queue = group.ctx.Queue()
            child = group.start(f"relay-{node.name}-{job.shard}", serve_relay, relay, port_queue)
            try:
                port = port_queue.get(timeout=60)
            except queue_mod.Empty:
                raise ChildFailed(child) from None
            mine.append(f"tcp://{node.host}:{port}")
            children.append(child)
        for v in members:
            per_vw[v] = mine
    return per_vw, children

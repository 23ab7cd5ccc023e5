"""Node-local aggregation's relays (docs/wsp.md#node-local-aggregation): each relayed group's relay jobs (one
per PS shard, on the group's node), started as children of `hetpipe train` or by `hetpipe relay` on a node,
and the endpoints each VW's stages talk to."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hetpipe.app.relay_server import RelayJob, serve_relay
from hetpipe.compute.build import VwLayout, run_work
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import UsageError
from hetpipe.core.runs.procs import ChildGroup
from hetpipe.core.wsp.groups import group_node, node_groups, relayed
from hetpipe.core.wsp.work import sample_weights
from hetpipe.server.jobs import shard_settings

__all__ = ["node_group", "relay_jobs", "start_relays"]


def _groups(config: ClusterConfig, vws: Sequence[VwLayout]) -> tuple[tuple[int, ...], ...]:
    return relayed(node_groups([lay.gpus for lay in vws], config.ps.node_aggregation))


def node_group(config: ClusterConfig, vws: Sequence[VwLayout], node: str) -> tuple[int, ...]:
    """The relayed group on `node`; UsageError when it has none."""
    config.node(node)  # KeyError for an unknown node, named by the caller
    for members in _groups(config, vws):
        if group_node([lay.gpus for lay in vws], members) == node:
            return members
    why = "node_aggregation is off" if not config.ps.node_aggregation else "no two VWs sit wholly on it"
    raise UsageError(
        f"{config.path}: node {node!r} has no relay to run ({why}): its VWs' stages talk to the PS directly"
    )


def relay_jobs(
    config: ClusterConfig,
    vws: Sequence[VwLayout],
    members: tuple[int, ...],
    upstream: Sequence[str],
    ports: Sequence[int],
) -> list[RelayJob]:
    """The relays of group `members`, one per shard `upstream[i]`, listening on its node's host at
    `ports[i]` (0: any free port)."""
    node = config.node(group_node([lay.gpus for lay in vws], members))
    weights = sample_weights(run_work(config, tuple(vws)))
    jobs = []
    for shard, (up, port) in enumerate(zip(upstream, ports, strict=True)):
        settings = replace(
            shard_settings(config, shard, port), endpoint=f"tcp://{node.host}:{port}", keys=None
        )
        jobs.append(
            RelayJob(
                settings=settings,
                node=node.name,
                members=members,
                upstream=up,
                num_vws=len(vws),
                vw_weights=weights,
                timeout_s=config.ps.timeout_s,
                retry_s=min(2.0, config.ps.timeout_s / 4),
                heartbeat_s=config.ps.heartbeat_s or 2.0,
                wire_dtype=config.ps.wire_dtype,
            )
        )
    return jobs


def start_relays(
    group: ChildGroup, config: ClusterConfig, vws: tuple[VwLayout, ...], endpoints: list[str]
) -> tuple[list[list[str]], list[Any]]:
    """`hetpipe train`: with [ps] node_aggregation on, a relay child per relayed group and shard, each on a
    free port; returns each VW's endpoints (its relays', or the shards') and the relays' children."""
    per_vw = [list(endpoints) for _ in vws]
    children: list[Any] = []
    for members in _groups(config, vws):
        mine = []
        for job in relay_jobs(config, vws, members, endpoints, [0] * len(endpoints)):
            child, port = group.start_listening(f"relay-{job.node}-{job.settings.shard}", serve_relay, job)
            mine.append(job.settings.endpoint.rsplit(":", 1)[0] + f":{port}")
            children.append(child)
        for v in members:
            per_vw[v] = mine
    return per_vw, children

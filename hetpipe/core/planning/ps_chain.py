"""How long one wave's PS traffic takes over the nodes' own links (a PsNetwork): every push of the wave, then
the pulls the next gates wait for. Under WSP the gate of wave c needs every VW's wave c - D - 2, so this
chain must fit in the D + 1 waves between, and each phase in one wave, as the next wave's pushes follow
(docs/planning.md#per-vw-work); per-VW work sizes waves by it. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hetpipe.core.planning.plan import VwPlan
from hetpipe.core.planning.relays import Relay
from hetpipe.core.planning.simulate import PsNetwork, stage_param_bytes

__all__ = ["gate_bound_s", "wave_phases_s"]

_Parts = list[tuple[str, float, float]]  # (link name, Gbit/s, bytes)


def gate_bound_s(phases: tuple[float, float], staleness: int) -> float:
    """The shortest wave the PS's links allow at D = `staleness`, from a wave's (push, pull) seconds: the
    chain of both spread over the D + 1 waves the gate leaves it, and each phase within one wave (the pushes
    of consecutive waves queue on the same links, and so do the pulls)."""
    return max(sum(phases) / (staleness + 1), *phases)


def wave_phases_s(
    vws: Sequence[VwPlan],
    network: PsNetwork,
    relays: Sequence[Relay] = (),
    pulls: bool = True,
    ps_bytes_per_s: float = math.inf,
) -> tuple[float, float]:
    """(seconds for every push of one wave of `vws` to cross its links, the same for the pulls after them; 0
    without pulls): each phase as long as its busiest link (bytes over it / its rate, no faster than
    `ps_bytes_per_s`, as the simulator caps them). A relayed VW's stages cross their node's inside link to
    the relay, and the relay sends one copy of the model upstream (simulate.simulate's relays)."""
    relay_of = {v: relay for relay in relays for v in relay.vws}
    push: _Parts = []
    pull: _Parts = []
    for v, vw in enumerate(vws):
        relay = relay_of.get(v)
        for stage, nbytes in zip(vw.stages, stage_param_bytes(vw), strict=True):
            if relay is not None:
                push += [(*link, nbytes) for link in network.route(stage.gpu, True, relay.node)]
                pull += [(*link, nbytes) for link in network.route(stage.gpu, False, relay.node)]
            else:
                push += network.parts(stage.gpu, stage.start, stage.stop, nbytes, True)
                pull += network.parts(stage.gpu, stage.start, stage.stop, nbytes, False)
    for group in relays:
        nbytes = max(sum(stage_param_bytes(vws[v])) for v in group.vws)
        push += network.relay_parts(group.node, nbytes, True)
        pull += network.relay_parts(group.node, nbytes, False)
    return _busiest_s(push, ps_bytes_per_s), (_busiest_s(pull, ps_bytes_per_s) if pulls else 0.0)


def _busiest_s(parts: _Parts, cap: float) -> float:
    """The busiest link's seconds for `parts`, each link at the lesser of its rate and `cap` bytes/s."""
    load: dict[str, float] = {}
    rate: dict[str, float] = {}
    for name, gbps, nbytes in parts:
        load[name] = load.get(name, 0.0) + nbytes
        rate[name] = min(cap, gbps * 1e9 / 8)
    return max((load[name] / rate[name] for name in load if rate[name] > 0), default=0.0)

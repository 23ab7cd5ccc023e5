"""Node-local aggregation: the state of one node's relay (docs/wsp.md#node-local-aggregation). The stages of
the node's group register, push and pull here as with a shard; the relay adds each wave's pushes in VW order
(each times its VW's weight by samples where the rule weighs the key), hands the group's sum upstream once
every member VW completed the wave, and answers every local pull of W_t from the one copy it pulled.
Pure: no sockets (hetpipe.app.relay_server moves the bytes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hetpipe.core.wsp.aggregation import Aggregation
from hetpipe.core.wsp.clock import first_pulled_wave, gate_version
from hetpipe.core.wsp.freezing import FreezeSchedule
from hetpipe.core.wsp.membership import Membership
from hetpipe.core.wsp.registrations import Registered, Registrations, StageId
from hetpipe.core.wsp.results import PullResult, PushResult, WspError
from hetpipe.core.wsp.sources import Source, as_array
from hetpipe.core.wsp.wave_sums import WaveSums

__all__ = ["RelayState"]


class RelayState(Registered):
    """What one relay holds: its group's registrations and pushes, the sums of waves not complete yet, the
    complete ones not yet sent upstream (`outbox`), and the versions W_t pulled from upstream."""

    pull_mode = "exact"

    def __init__(
        self,
        members: tuple[int, ...],
        staleness: int,
        aggregation: Aggregation,
        freeze: FreezeSchedule | None = None,
    ) -> None:
        if len(members) < 2 or list(members) != sorted(set(members)):
            raise ValueError(f"a relay serves two or more VWs in order, not {list(members)}")
        self.members = members
        self.staleness = staleness
        self.aggregation = aggregation
        self.pushed: dict[StageId, int] = {}
        self.pulled: dict[StageId, int] = {}
        self.membership = Membership()
        self.registrations = Registrations(self.membership, freeze=freeze or FreezeSchedule())
        self.full_pull: dict[StageId, int | None] = {}  # each member stage's first pull (all keys): its wave
        self.last_seen: dict[str, np.ndarray] = {}  # each key's newest value from upstream (frozen ones too)
        self.sums: dict[int, WaveSums] = {}
        self.outbox: dict[int, dict[str, Source]] = {}  # complete group sums, by wave, not sent upstream yet
        self.completed = 0  # waves every member completed here
        self.start = 0  # the wave the member stages start at (> 0: a resumed run)
        self.versions: dict[int, dict[str, np.ndarray]] = {}  # W_t pulled from upstream
        self.oldest = 0  # versions before this are forgotten: no member stage pulls them again
        self.upstream_c_global = 0

    # ---- what the shard's handlers read -----------------------------------------------------------
    @property
    def weights(self) -> dict[str, np.ndarray]:
        """Running weights (latest pulls): a relay keeps none."""
        return {}

    @property
    def c_global(self) -> int:
        """The run's clock as upstream last said it."""
        return self.upstream_c_global

    def live(self, vw: int) -> bool:
        return vw in self.members

    def live_vws(self) -> list[int]:
        return list(self.members)

    def epoch_start(self, vw: int) -> int:
        return 0

    def gaps(self) -> list[list[int]]:
        return []

    def c_local(self, vw: int) -> int:
        """Waves member `vw` completed here: every one of its stages pushed them."""
        stages = self.registrations.num_stages.get(vw)
        if stages is None:
            return 0
        return min(self.pushed.get((vw, s), 0) for s in range(stages))

    def slowest_vw(self) -> int | None:
        return min(self.members, key=self.c_local)

    # ---- registration -----------------------------------------------------------------------------
    def register(
        self,
        vw: int,
        stage: int,
        num_vws: int,
        num_stages: int,
        tensors: Mapping[str, Source],
        kinds: Mapping[str, str] | None = None,
        num_waves: int | None = None,
        start_wave: int = 0,
        weights: tuple[int, ...] = (),
        members: tuple[int, ...] = (),
        spans: tuple[tuple[int, int], ...] = (),
    ) -> dict[str, np.ndarray]:
        """A member stage's registration; returns its keys' W_0 as the first registration gave them (the
        relay registers upstream, and the stages hear upstream's W_0, once every member stage is in:
        `registered`). `start_wave` > 0: a resumed run's stages start there, all at the same wave."""
        if members:
            raise WspError("bad_message", "a relay takes stages, not another relay")
        if spans:
            raise WspError("bad_message", "a relay serves its VWs for the whole run: no planned spans")
        if vw not in self.members:
            raise WspError(
                "bad_message",
                f"vw {vw} is not one of this relay's VWs {list(self.members)}: its stages talk to the PS or "
                "to their own node's relay (check the run's layouts)",
            )
        if self.stage_keys and start_wave != self.start:
            raise WspError(
                "conflict",
                f"vw {vw} stage {stage} starts at wave {start_wave}, the relay's other stages at "
                f"{self.start}: a relay's VWs start together (no rejoin under node aggregation)",
            )
        self.start = start_wave
        self.registrations.admit(vw, stage, num_vws, num_stages, tensors, kinds, num_waves, 0, weights)
        sid = (vw, stage)
        self.full_pull[sid] = None
        self.pushed.setdefault(sid, start_wave)
        self.pulled.setdefault(sid, max(first_pulled_wave(self.staleness), start_wave) - 1)
        self.completed = max(self.completed, start_wave)
        return {key: self.registrations.initial[key] for key in tensors}

    def registered(self) -> bool:
        """Whether every stage of every member has registered (the group's keys are known)."""
        stages = self.registrations.num_stages
        return all(
            m in stages and all((m, s) in self.stage_keys for s in range(stages[m])) for m in self.members
        )

    def caught_up(self, upstream_pushed: int) -> None:
        """Upstream holds the group's waves before `upstream_pushed` (this relay restarted, or the run
        resumed): every member stage goes on from there."""
        for sid in self.pushed:
            self.pushed[sid] = max(self.pushed[sid], upstream_pushed)
        self.completed = max(self.completed, upstream_pushed)
        self.sums = {t: s for t, s in self.sums.items() if t >= upstream_pushed}

    def group_keys(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """The group's keys on this shard with their W_0, and their kinds, for the upstream registration."""
        initial = self.registrations.initial
        keys = sorted({k for sid, ks in self.stage_keys.items() for k in ks})
        return {k: initial[k] for k in keys}, {k: self.kinds[k] for k in keys}

    # ---- push -------------------------------------------------------------------------------------
    def push(self, vw: int, stage: int, wave: int, tensors: Mapping[str, Source]) -> PushResult:
        """Add a member stage's push of `wave`; the same (vw, stage, wave) counts once. A push that completes
        the wave for the whole group moves the group's sum to the outbox."""
        keys = self.stage_keys_of(vw, stage)
        done = self.pushed[(vw, stage)]
        if wave < done:
            return PushResult(applied=False, c_global=self.c_global, clock_advanced=False)
        if wave > done:
            raise WspError(
                "out_of_order", f"vw {vw} stage {stage} pushed wave {wave} before wave {done}: push in order"
            )
        self.registrations.check_push(vw, stage, keys, tensors, wave)
        sums = self.sums.setdefault(wave, WaveSums())
        weight = self.membership.weight(vw)
        for key, src in tensors.items():
            if weight != 1 and self.aggregation.weighs(self.kinds[key]):
                src = np.asarray(as_array(src) * np.float32(weight))  # 0-d stays an array
            sums.add(key, vw, src)
        self.pushed[(vw, stage)] = done + 1
        sums.merge(list(self.members), lambda v: self.c_local(v) > wave)
        group = min(self.c_local(m) for m in self.members)
        while self.completed < group:
            t = self.completed
            complete = self.sums.pop(t)
            missing = complete.incomplete(len(self.members))
            if missing:
                raise WspError(
                    "conflict",
                    f"wave {t} completed but keys {missing[:3]} lack some VW's update: every VW must place "
                    "the same keys on the same shard",
                )
            self.outbox[t] = complete.sums
            self.completed += 1
        return PushResult(applied=True, c_global=self.c_global, clock_advanced=False)

    def take_outbox(self) -> list[tuple[int, dict[str, np.ndarray]]]:
        """The complete group sums not sent upstream yet, in wave order (removed from the outbox)."""
        out = [(t, {k: as_array(v) for k, v in self.outbox.pop(t).items()}) for t in sorted(self.outbox)]
        return out

    # ---- pull -------------------------------------------------------------------------------------
    def gate_open(self, wave: int) -> bool:
        """Whether the weights the gate of `wave` needs are here (pulled from upstream)."""
        return gate_version(wave, self.staleness) in self.versions

    def wanted(self, wave: int) -> bool:
        """Whether a pull of `wave` must go upstream: its version is not here and not forgotten (versions
        arrive in any order: a VW ahead by D may have its newer one pulled first)."""
        target = gate_version(wave, self.staleness)
        return target not in self.versions and target >= self.oldest

    def receive(self, version: int, tensors: Mapping[str, np.ndarray], c_global: int) -> None:
        """Keep W_`version` as upstream sent it, for every member's pull of it."""
        self.versions.setdefault(version, dict(tensors))
        self.last_seen.update(tensors)
        self.upstream_c_global = max(self.upstream_c_global, c_global, version)

    def pull(self, vw: int, stage: int, wave: int, known: int = -1, records_only: bool = False) -> PullResult:
        """W_{wave-D-1} for a member stage (call only once gate_open(wave)); no movement records (`known`,
        `records_only`: the config refuses [train] autofreeze with relays)."""
        keys = self.stage_keys_of(vw, stage)
        target = gate_version(wave, self.staleness)
        found = self.versions.get(target)
        if found is None:
            raise WspError("internal", f"pull of wave {wave} before W_{target} came from upstream")
        self.pulled[(vw, stage)] = max(self.pulled[(vw, stage)], wave)
        if self.first_pull(vw, stage, wave):  # a frozen key W_target lacks: the value it froze at (last seen)
            tensors = {k: found[k] if k in found else self.last_seen[k] for k in keys}
        else:
            tensors = {k: found[k] for k in self.registrations.pulled_keys(keys, target)}
        result = PullResult(target, target - 1, tensors)
        self._forget()
        return result

    def _forget(self) -> None:
        """Drop the versions no member stage will pull again (each pulls its waves in order)."""
        self.oldest = max(self.oldest, gate_version(min(self.pulled.values()) + 1, self.staleness))
        for t in [t for t in self.versions if t < self.oldest]:
            del self.versions[t]

    def read(self) -> PullResult:
        """The newest weights pulled (what a local `read` sees)."""
        newest = max(self.versions, default=None)
        if newest is None:
            return PullResult(0, -1, dict(self.registrations.initial))
        return PullResult(newest, -1, dict(self.versions[newest]))

    # ---- the rest of a shard's interface ------------------------------------------------------------
    def evict(self, vw: int) -> tuple[int, bool]:
        raise WspError(
            "bad_message", 'VWs under node aggregation are not evicted: set on_vw_failure = "stop"'
        )

    def held_waves(self) -> tuple[int, int]:
        return len(self.versions), len(self.sums) + len(self.outbox)

    def status(self) -> dict[str, Any]:
        return {
            "relay": True,
            "members": list(self.members),
            "c_global": self.c_global,
            "c_local": [self.c_local(v) if v in self.members else 0 for v in range(self.num_vws or 0)],
            "live": self.live_vws(),
            "epochs": [],
            "gaps": [],
            "version": max(self.versions, default=0),
            "num_vws": self.num_vws,
            "num_waves": self.num_waves,
            "registered": len(self.stage_keys),
            "versions": sorted(self.versions),
            "pending_waves": sorted(self.sums),
            "outbox": sorted(self.outbox),
            "pull_mode": self.pull_mode,
            "staleness": self.staleness,
            "aggregation": self.aggregation.name,
        }

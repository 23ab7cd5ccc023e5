"""Wave Synchronous Parallel state of one PS shard: registrations, idempotent pushes, clocks over the live
virtual workers, the gate, exact and latest pulls, buffers, eviction and rejoin, bounded memory, snapshots.
Pure: numpy arrays in, numpy arrays out, no sockets (docs/wsp.md, docs/recovery.md).

Arithmetic, fixed so runs are reproducible bit for bit:
    S_t = ((P_a(t) + P_b(t)) + P_c(t)) + ...      (the wave's contributors a < b < c ..., whatever the
                                                   arrival order)
    W_{t+1} = fold(W_t, S_t)                       (hetpipe.core.wsp.aggregation: sum, mean or server
    optimizer)
where P_i(t) is VW i's push of wave t for a key: its summed update (or mean gradient, with aggregation
"server") for a parameter, its current values for a buffer. `exact` pulls return exactly W_{c-D-1}, built
once wave c-D-2 is complete and kept while a pull may still ask for it; `latest` pulls return the running
weights, into which every VW's wave is folded the moment that VW completes it on this shard.

A VW's push of wave t is merged (exact) or folded (latest) only once every stage of that VW has pushed wave t
to this shard: so a VW evicted after a failure leaves no half wave behind (its waves from c_local on are
dropped whole), and a wave counts for every stage of a VW or for none. Contributors of wave t: the VWs whose
live span ("epoch") covers t; c_global and the gate count live VWs only. A VW planned to train waves
[start, end) only (a re-plan, docs/wsp.md#planned-spans) counts as having completed `start` waves until its
stages push, and retires (its epoch closed at `end`) the moment its wave end - 1 is complete.

ShardState keeps what each stage pushed and pulled and the clocks over them, and composes the parts: the
registrations (registrations.py), the VWs' epochs (membership.py), the exact versions and wave sums
(versions.py, wave_sums.py), the latest running weights (running.py); snapshot.py writes and reads its
checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from hetpipe.core.wsp import snapshot
from hetpipe.core.wsp.aggregation import DEFAULT_AGGREGATION, Aggregation, make_aggregation
from hetpipe.core.wsp.clock import PULL_MODES, first_pulled_wave, gate_version
from hetpipe.core.wsp.freezing import FreezeSchedule
from hetpipe.core.wsp.membership import Membership
from hetpipe.core.wsp.movement import MovementLog
from hetpipe.core.wsp.registrations import Registered, Registrations, StageId
from hetpipe.core.wsp.results import PullResult, PushResult, WspError
from hetpipe.core.wsp.running import RunningWeights
from hetpipe.core.wsp.sources import Source
from hetpipe.core.wsp.versions import ExactVersions
from hetpipe.core.wsp.wave_sums import WaveSums

__all__ = ["PullResult", "PushResult", "ShardState", "WspError"]  # the results, for the server's imports


class ShardState(Registered):
    """The WSP state machine of one shard: who is registered and live, what was pushed and pulled, the
    weights."""

    def __init__(
        self,
        staleness: int,
        pull_mode: str = "exact",
        aggregation: Aggregation | None = None,
        freeze: FreezeSchedule | None = None,
        autofreeze: int = 0,
    ) -> None:
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if pull_mode not in PULL_MODES:
            raise ValueError(f"pull_mode must be one of {PULL_MODES}, got {pull_mode!r}")
        self.staleness = staleness
        self.pull_mode = pull_mode
        self.aggregation = aggregation or make_aggregation(DEFAULT_AGGREGATION)
        self.pushed: dict[StageId, int] = {}  # waves pushed, contiguous from the epoch's start
        self.pulled: dict[StageId, int] = {}  # highest wave pulled (first_pulled_wave - 1 before any)
        self.membership = Membership()  # the run's VWs and the waves each contributes
        # stages, keys, kinds, W_0; and the parameters [train] freeze leaves off the wire
        self.registrations = Registrations(self.membership, freeze=freeze or FreezeSchedule())
        # each stage's first pull since it registered (None: to come), which carries every key: its wave
        self.full_pull: dict[StageId, int | None] = {}
        self.exact = ExactVersions({0: self.registrations.initial}, self.aggregation, staleness)  # W_t, S_t
        self.running = RunningWeights(self.aggregation, self.membership.weight)  # latest: running weights
        self.movement = MovementLog(autofreeze) if autofreeze else None  # autofreeze: the layers' movement

    # ---- the parts' state, by the names the server and the tests read -------------------------------
    @property
    def versions(self) -> dict[int, dict[str, np.ndarray]]:
        """Exact: W_t by t, never changed once built."""
        return self.exact.versions

    @property
    def wave_sums(self) -> dict[int, WaveSums]:
        """Exact: the sums of waves not complete yet."""
        return self.exact.wave_sums

    @property
    def weights(self) -> dict[str, np.ndarray]:
        """Latest: the running weights (params and ledgers)."""
        return self.running.weights

    @property
    def version(self) -> int:
        """Exact: the newest W_t built (t = c_global once every VW's waves arrived)."""
        return self.exact.newest

    # ---- live virtual workers -----------------------------------------------------------------------
    def live(self, vw: int) -> bool:
        """A VW is live until evicted, and again once it rejoins."""
        return self.membership.live(vw)

    def live_vws(self) -> list[int]:
        return self.membership.live_vws()

    def gaps(self) -> list[list[int]]:
        """[vw, from, to) wave ranges a VW contributes nothing to (to = -1: open)."""
        return self.membership.gaps()

    def epoch_start(self, vw: int) -> int:
        return self.membership.start(vw)

    def evict(self, vw: int) -> tuple[int, bool]:
        """Remove VW `vw` from the live set at its wave boundary c_local(vw): its pushes of waves
        >= c_local(vw) (which some of its stages never pushed) are dropped. Returns (that boundary, whether
        c_global advanced). Evicting a VW that is not live changes nothing."""
        self.membership.check(vw)
        if not self.live(vw):
            return self.membership.end(vw), False
        before = self.c_global
        boundary = self.membership.close(vw, self.c_local(vw))
        if self.pull_mode == "exact":
            self.exact.drop(vw, boundary)
            self.exact.merge(sorted(self.wave_sums), self.membership.contributors, self.c_local)
        else:
            self.running.drop(vw)
        self._build_versions()
        self._forget()
        return boundary, self.c_global > before

    def rejoin(self, vw: int, start_wave: int) -> None:
        """Make evicted VW `vw` live again from wave `start_wave` (its stages push from there). Refused when
        any push of a wave >= start_wave arrived already (its place in the sums' order would be taken) or the
        weights it would start from are gone."""
        self.membership.check(vw)
        newest = max((n for (v, _), n in self.pushed.items() if self.live(v)), default=0)
        least = max(newest, self.membership.end(vw))  # no push of a wave >= start_wave has arrived
        if self.pull_mode == "exact" and start_wave >= first_pulled_wave(self.staleness):
            least = max(least, min(self.versions) + self.staleness + 1)  # W_{start-D-1} is held or to come
        if not self.membership.reopen(vw, start_wave, least, self.num_waves):
            return  # a retried rejoin
        for stage in range(self.registrations.num_stages.get(vw, 0)):
            sid = (vw, stage)
            if sid in self.stage_keys:
                self.pushed[sid] = start_wave
                self.pulled[sid] = max(self.pulled[sid], start_wave - 1)

    # ---- registration -------------------------------------------------------------------------------
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
        """Declare a stage's keys (first registration of a key sets its W_0) and their kinds (default
        "param"), the run's waves (None: unknown) and each VW's weight by samples (() for every VW 1);
        returns the PS's values. A stage registers again after a restart of the shard (nothing changes) or
        of its VW (start_wave: where it rejoined); a node relay as its group's first VW, naming `members`;
        `spans`: each VW's planned [start, end) (end 0: the run's end; docs/wsp.md#planned-spans)."""
        if members and self.pull_mode != "exact":
            raise WspError("bad_message", 'node-local aggregation needs [wsp] pull = "exact"')
        args = (num_vws, num_stages, tensors, kinds, num_waves, start_wave, weights, members, spans)
        new = self.registrations.admit(vw, stage, *args)
        initial = self.registrations.initial
        if self.pull_mode == "latest":
            for key in new:
                self.weights[key] = initial[key].copy()
        sid = (vw, stage)
        self.full_pull[sid] = None
        self.pushed.setdefault(sid, start_wave)
        self.pulled.setdefault(sid, max(first_pulled_wave(self.staleness), start_wave) - 1)
        return {key: initial[key] for key in tensors}

    # ---- clocks -------------------------------------------------------------------------------------
    def c_local(self, vw: int) -> int:
        """Waves VW `vw` has completed on this shard: every one of its stages (or its node's relay) pushed."""
        vw = self.membership.leader(vw)
        stages = self.registrations.num_stages.get(vw)
        if stages is None:
            return self.epoch_start(vw)  # 0, or where a VW planned to start later starts
        return min(self.pushed.get((vw, s), self.epoch_start(vw)) for s in range(stages))

    @property
    def c_global(self) -> int:
        """The fewest waves a live VW has completed (docs/wsp.md#clock); with no live VW, the newest
        version."""
        if self.num_vws is None:
            return 0
        live = self.live_vws()
        if not live:
            return self.version  # a run without a live VW has failed; nothing more is built
        return min(self.c_local(vw) for vw in live)

    def gate_open(self, wave: int) -> bool:
        """Wave `wave` may start once every live VW completed wave - D - 2, i.e. c_global >= wave - D - 1."""
        return self.c_global >= gate_version(wave, self.staleness)

    def slowest_vw(self) -> int | None:
        """The live VW with the fewest completed waves (the one a blocked pull waits for)."""
        live = self.live_vws()
        return min(live, key=self.c_local) if live else None

    # ---- push ---------------------------------------------------------------------------------------
    def push(self, vw: int, stage: int, wave: int, tensors: Mapping[str, Source]) -> PushResult:
        """Add a stage's push of `wave`; the same (vw, stage, wave) counts once.

        The arrays are kept by reference until merged or folded: the caller must not change them afterwards.
        """
        keys = self.stage_keys_of(vw, stage)
        done = self.pushed[(vw, stage)]
        before = self.c_global
        if wave < done:
            return PushResult(applied=False, c_global=before, clock_advanced=False)
        if wave > done:
            raise WspError(
                "out_of_order", f"vw {vw} stage {stage} pushed wave {wave} before wave {done}: push in order"
            )
        self.registrations.check_push(vw, stage, keys, tensors, wave)
        completed = self.c_local(vw)
        if self.pull_mode == "exact":
            self.exact.add(wave, vw, tensors, self.kinds, self.membership.push_weight(vw))
        else:
            self.running.hold(vw, wave, tensors)
        self.pushed[(vw, stage)] = done + 1
        now_complete = range(completed, self.c_local(vw))  # waves this push completed for its VW
        if self.pull_mode == "exact":
            self.exact.merge(list(now_complete), self.membership.contributors, self.c_local)
        else:
            for t in now_complete:
                self.running.fold(vw, t, self.kinds, self.membership.total(t))
        if self.membership.due(vw, self.c_local(vw)):  # its planned last wave is in: it retires
            self.membership.close(vw, self.c_local(vw))
        after = self.c_global
        self._build_versions()
        self._forget()
        return PushResult(applied=True, c_global=after, clock_advanced=after > before)

    # ---- pull ---------------------------------------------------------------------------------------
    def pull(self, vw: int, stage: int, wave: int, known: int = -1, records_only: bool = False) -> PullResult:
        """The global weights for the gate of `wave` (call only once gate_open(wave)); with autofreeze, the
        movement records after boundary `known` (-1: all), and with `records_only` no weights. Exact versions
        are never changed once built, so the arrays can be sent without a copy; the latest running weights
        may be the shard's own arrays: a caller that keeps them past the next push (a zero-copy send) must
        `lend` them."""
        keys = self.stage_keys_of(vw, stage)
        if not self.gate_open(wave):
            raise WspError(
                "internal", f"pull of wave {wave} before its gate opened (c_global {self.c_global})"
            )
        if self.pull_mode == "latest":  # (version, own_through, tensors)
            result = PullResult(self.c_global, self.c_local(vw) - 1, {k: self._latest(k) for k in keys})
        else:
            target = gate_version(wave, self.staleness)
            if not records_only and not self.first_pull(vw, stage, wave):
                keys = self.registrations.pulled_keys(keys, target)
            moved = None if self.movement is None else self.movement.since(known, target)
            keys = () if records_only else keys
            result = PullResult(target, target - 1, self.exact.at(keys, target), moved)
        self.pulled[(vw, stage)] = max(self.pulled[(vw, stage)], wave)
        self._forget()
        return result

    def _latest(self, key: str) -> np.ndarray:
        return self.running.value(key, self.kinds[key], self.registrations.initial[key])

    def read(self) -> PullResult:
        """Every key's newest complete weights: W_{c_global} (exact) or the running weights (latest)."""
        keys = tuple(self.registrations.initial)
        if self.pull_mode == "latest":
            return PullResult(self.c_global, -1, {k: self._latest(k) for k in keys})
        return PullResult(self.version, -1, self.exact.at(keys, self.version))

    def lend(self, key: str, is_done: Callable[[], bool]) -> None:
        """Latest: mark weights[key] as read by an in-flight zero-copy send until is_done() turns true."""
        self.running.lend(key, is_done)

    # ---- building and forgetting versions ------------------------------------------------------------
    def _build_versions(self) -> None:
        """Exact: build W_{t+1} from W_t and S_t for every wave t that every live VW has completed."""
        if self.pull_mode != "exact" or self.num_vws is None:
            return
        before = self.version
        self.exact.build(self.c_global, self.membership.contributors, self.membership.total, self.kinds)
        if self.movement is not None:
            self.movement.record(self.versions, before, self.kinds)

    def _forget(self) -> None:
        """Exact: drop versions no pull can ask for any more (ExactVersions.oldest_needed: from how far the
        live stages got; the newest always stays, for reads)."""
        if self.pull_mode != "exact":
            return
        live = [sid for sid in self.pulled if self.live(sid[0])]
        c_global = self.c_global
        passed = min((max(self.pulled[sid], self.pushed[sid] - 1) for sid in live), default=None)
        self.exact.forget(c_global, passed, self.num_waves)

    # ---- inspection and snapshots --------------------------------------------------------------------
    def held_waves(self) -> tuple[int, int]:
        """(weight versions, wave sums) held now; exact shards keep both within pending_bound(D)."""
        return len(self.versions), len(self.wave_sums)

    def status(self) -> dict[str, Any]:
        return {
            "c_global": self.c_global,
            "c_local": [self.c_local(v) for v in range(self.num_vws or 0)],
            "live": self.live_vws(),
            "epochs": [self.membership.spans(v) for v in range(self.num_vws or 0)],
            "gaps": self.gaps(),
            "version": self.version,
            "num_vws": self.num_vws,
            "num_waves": self.num_waves,
            "registered": len(self.stage_keys),
            "versions": sorted(self.versions) if self.pull_mode == "exact" else [],
            "pending_waves": sorted(self.wave_sums),
            "pull_mode": self.pull_mode,
            "staleness": self.staleness,
            "aggregation": self.aggregation.name,
        }

    def to_state(self, detached: bool = False) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Everything needed to resume: msgpack-able metadata and named float32 arrays (snapshot.to_state);
        `detached`: a copy of what later pushes change in place, for a writer thread."""
        return snapshot.to_state(self, detached)

    @classmethod
    def from_state(
        cls,
        meta: Mapping[str, Any],
        arrays: Mapping[str, np.ndarray],
        aggregation: Aggregation | None = None,
        cut: int | None = None,
        freeze: FreezeSchedule | None = None,
    ) -> ShardState:
        """The state `to_state` wrote (snapshot.from_state); `aggregation`: the rule (and its optimizer
        settings) to resume with; `cut` (exact pulls only): the wave to cut it back to, for a resume;
        `freeze`: the run's [train] freeze."""
        return snapshot.from_state(cls, meta, arrays, aggregation, cut, freeze)

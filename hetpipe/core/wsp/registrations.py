"""Who registered on one PS shard: the run's shape as its stages state it, each stage's keys, which stage of
a VW owns a key, each key's kind and W_0; and the checks a registration and a push must pass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from hetpipe.core.wsp.aggregation import KEY_KINDS, KeyKind
from hetpipe.core.wsp.freezing import FreezeSchedule
from hetpipe.core.wsp.membership import OPEN, Membership
from hetpipe.core.wsp.results import WspError
from hetpipe.core.wsp.sources import Source, copy_of

__all__ = ["Registered", "Registrations", "StageId", "check_float32"]

StageId = tuple[int, int]  # (vw, stage)


def check_float32(key: str, src: Source) -> None:
    """Refuse a tensor that is not float32: the PS holds float32 only."""
    if np.dtype(src.dtype) != np.float32:
        raise WspError("bad_message", f"key {key!r} is {np.dtype(src.dtype)}; the PS holds float32 only")


@dataclass
class Registrations:
    """The registrations a shard holds; the first registration of a run sets its number of VWs (in
    `membership`), the first of a key its W_0 and kind."""

    membership: Membership
    num_waves: int | None = None  # the run's length, when the stages said (no pull asks past it)
    num_stages: dict[int, int] = field(default_factory=dict)
    stage_keys: dict[StageId, tuple[str, ...]] = field(default_factory=dict)
    key_owner: dict[tuple[int, str], int] = field(default_factory=dict)  # (vw, key) -> stage
    kinds: dict[str, KeyKind] = field(default_factory=dict)
    initial: dict[str, np.ndarray] = field(default_factory=dict)  # W_0
    freeze: FreezeSchedule = field(default_factory=FreezeSchedule)  # [train] freeze: keys left off the wire

    def admit(
        self,
        vw: int,
        stage: int,
        num_vws: int,
        num_stages: int,
        tensors: Mapping[str, Source],
        kinds: Mapping[str, str] | None,
        num_waves: int | None,
        start_wave: int,
        weights: tuple[int, ...] = (),
        members: tuple[int, ...] = (),
        spans: tuple[tuple[int, int], ...] = (),
    ) -> list[str]:
        """Check a stage's registration and record its keys; returns the keys new to this shard. `members`:
        the VWs a node's relay, registering as its group's first VW, pushes for (): a stage of its own.
        `spans`: each VW's planned [start, end) (end 0: the run's end; (): every VW trains every wave)."""
        self._check_spans(vw, num_vws, spans)
        self._check_run(vw, stage, num_vws, num_stages, num_waves, start_wave)
        self._check_weights(vw, num_vws, weights)
        if members:
            if any(not 0 <= m < num_vws for m in members):
                raise WspError("bad_message", f"relay of vw {vw}: members {list(members)} out of range")
            self.membership.join_group(vw, list(members))
        elif self.membership.leader(vw) != vw:
            raise WspError(
                "conflict",
                f"vw {vw} is relayed by vw {self.membership.leader(vw)}'s node relay: its stages "
                "register with the relay, not with the shard",
            )
        sid = (vw, stage)
        keys = tuple(tensors)
        if sid in self.stage_keys and set(self.stage_keys[sid]) != set(keys):
            raise WspError("conflict", f"vw {vw} stage {stage} registered again with other keys")
        kinds = dict(kinds or {})
        self._check_keys(vw, stage, tensors, kinds)
        new = []
        for key, src in tensors.items():
            if key not in self.initial:
                self.initial[key] = copy_of(src)
                self.kinds[key] = kinds.get(key, "param")
                new.append(key)
            self.key_owner[(vw, key)] = stage
        self.stage_keys[sid] = keys
        return new

    def _check_run(
        self, vw: int, stage: int, num_vws: int, num_stages: int, num_waves: int | None, start_wave: int
    ) -> None:
        """Check a registration's view of the run (its waves, VWs, the VW's stages, the wave the live VW
        starts at) against what earlier ones said, recording what they had not."""
        if num_waves is not None:
            if self.num_waves not in (None, num_waves):
                raise WspError(
                    "conflict",
                    f"vw {vw} stage {stage} says the run has {num_waves} waves, not {self.num_waves}",
                )
            self.num_waves = num_waves
        members = self.membership
        if members.num_vws is None:
            members.num_vws = num_vws
        elif num_vws != members.num_vws:
            raise WspError(
                "conflict", f"vw {vw} says the run has {num_vws} VWs, but it has {members.num_vws}"
            )
        if not 0 <= vw < num_vws:
            raise WspError("bad_message", f"vw {vw} is out of range for {num_vws} VWs")
        if self.num_stages.setdefault(vw, num_stages) != num_stages:
            raise WspError(
                "conflict", f"vw {vw} has {self.num_stages[vw]} stages, a registration says {num_stages}"
            )
        if not 0 <= stage < num_stages:
            raise WspError("bad_message", f"stage {stage} is out of range for {num_stages} stages")
        if not members.live(vw) and not members.retired(vw):  # a retired one registers again after a restart
            raise WspError(
                "evicted",
                f"vw {vw} was evicted at wave {members.end(vw)}: it must rejoin "
                "(`hetpipe worker --vw` rejoins at the next wave boundary)",
            )
        if start_wave != members.start(vw):
            raise WspError(
                "conflict",
                f"vw {vw} stage {stage} starts at wave {start_wave}, but vw {vw} is live from "
                f"wave {members.start(vw)}: every stage of a VW starts at the same wave",
            )

    def _check_spans(self, vw: int, num_vws: int, spans: tuple[tuple[int, int], ...]) -> None:
        """Check a registration's planned spans (one [start, end) per VW, end 0 for the run's end; () for
        none) against what earlier ones said, recording the first (docs/wsp.md#planned-spans)."""
        members = self.membership
        if spans and (len(spans) != num_vws or any(0 < end <= start for start, end in spans)):
            raise WspError(
                "bad_message", f"vw {vw} gives spans {[list(s) for s in spans]}: one [start, end) per VW"
            )
        planned = {v: (start, end or OPEN) for v, (start, end) in enumerate(spans) if (start, end) != (0, 0)}
        if not self.stage_keys and not members.planned:
            members.plan(planned)
        elif planned != members.planned:
            raise WspError(
                "conflict",
                f"vw {vw} says the VWs train waves {[list(s) for s in spans] or 'all'}, but the run's plan "
                f"is {members.planned or 'every VW every wave'}: every stage must come from the same config",
            )

    def _check_weights(self, vw: int, num_vws: int, weights: tuple[int, ...]) -> None:
        """Check a registration's weights by samples (one per VW, each >= 1; () for every VW 1) against what
        earlier ones said, recording the first."""
        members = self.membership
        if weights and (len(weights) != num_vws or min(weights) < 1):
            raise WspError(
                "bad_message", f"vw {vw} gives weights {list(weights)}: one weight >= 1 per VW ({num_vws})"
            )
        if not self.stage_keys and not members.weights:
            members.weights = tuple(weights)
        elif tuple(weights) != members.weights:
            raise WspError(
                "conflict",
                f"vw {vw} says the VWs weigh {list(weights) or 'alike'}, but the run's weights are "
                f"{list(members.weights) or 'alike'}: every stage must come from the same config",
            )

    def _check_keys(self, vw: int, stage: int, tensors: Mapping[str, Source], kinds: dict[str, str]) -> None:
        """Check a registration's keys: known kinds, one owning stage per VW, float32, the shape and kind
        earlier registrations gave them."""
        for key, kind in kinds.items():
            if key not in tensors or kind not in KEY_KINDS:
                raise WspError(
                    "bad_message", f"kind {kind!r} of key {key!r}: give one of {KEY_KINDS} for a key sent"
                )
        for key, src in tensors.items():
            owner = self.key_owner.get((vw, key))
            if owner is not None and owner != stage:
                raise WspError("conflict", f"key {key!r} of vw {vw} is already owned by its stage {owner}")
            check_float32(key, src)
            held = self.initial.get(key)
            if held is not None and held.shape != tuple(src.shape):
                raise WspError(
                    "conflict", f"key {key!r} has shape {tuple(src.shape)}, registered before as {held.shape}"
                )
            kind = kinds.get(key, "param")
            if self.kinds.get(key, kind) != kind:
                raise WspError("conflict", f"key {key!r} is a {self.kinds[key]}, a registration says {kind}")

    def keys_of(self, vw: int, stage: int) -> tuple[str, ...]:
        """The keys of a registered stage of a live VW, or of one retired by plan that winds down (its retried
        requests, its heartbeats); WspError "not_registered" or "evicted" otherwise."""
        keys = self.stage_keys.get((vw, stage))
        if keys is None:
            raise WspError("not_registered", f"vw {vw} stage {stage} is not registered on this shard")
        if not self.membership.live(vw) and not self.membership.retired(vw):
            raise WspError(
                "evicted",
                f"vw {vw} was evicted at wave {self.membership.end(vw)}; its stages must stop "
                "(`hetpipe worker --vw` rejoins it at the next wave boundary)",
            )
        return keys

    def pushed_keys(self, keys: tuple[str, ...], wave: int) -> tuple[str, ...]:
        """The keys of `keys` a push of `wave` carries: all but the parameters frozen by then."""
        return tuple(self.freeze.pushed(keys, self._is_param, wave))

    def pulled_keys(self, keys: tuple[str, ...], version: int) -> tuple[str, ...]:
        """The keys of `keys` a pull of W_version carries (but a first pull, which carries all): all but the
        parameters frozen before it (docs/wsp.md#freezing)."""
        return tuple(self.freeze.pulled(keys, self._is_param, version))

    def _is_param(self, key: str) -> bool:
        return self.kinds[key] == "param"

    def check_push(
        self, vw: int, stage: int, keys: tuple[str, ...], tensors: Mapping[str, Source], wave: int = 0
    ) -> None:
        """A push carries exactly the stage's registered keys (less the parameters frozen by its wave), in
        float32, with their registered shapes."""
        keys = self.pushed_keys(keys, wave)
        if set(tensors) != set(keys):
            missing = sorted(set(keys) - set(tensors))[:3]
            extra = sorted(set(tensors) - set(keys))[:3]
            frozen = " less the parameters [train] freeze leaves out by then" if self.freeze.points else ""
            raise WspError(
                "bad_message",
                f"push of vw {vw} stage {stage} wave {wave} must carry exactly its registered keys{frozen} "
                f"(missing {missing}, unexpected {extra})",
            )
        for key, src in tensors.items():
            check_float32(key, src)
            if tuple(src.shape) != self.initial[key].shape:
                raise WspError(
                    "bad_message",
                    f"update of {key!r} has shape {tuple(src.shape)}, not {self.initial[key].shape}",
                )


class Registered:
    """What a shard's state and a node relay's both answer from their `membership` and `registrations`, by
    the names the server's handlers read."""

    membership: Membership
    registrations: Registrations
    full_pull: dict[StageId, int | None]

    @property
    def num_vws(self) -> int | None:
        return self.membership.num_vws

    def first_pull(self, vw: int, stage: int, wave: int) -> bool:
        """Whether this pull of `wave` is the stage's first since it registered (or a retry of it): it carries
        every key, frozen ones too, as the stage (joining, or resumed) may hold none of them yet. Records
        the first pull's wave in `full_pull` (a stage id -> its wave, None before it comes)."""
        sid = (vw, stage)
        if sid not in self.full_pull:
            return False
        first = self.full_pull[sid]
        if first is None:
            self.full_pull[sid] = first = wave
        return first == wave

    @property
    def num_waves(self) -> int | None:
        """The run's length, when the stages said (no pull asks past it)."""
        return self.registrations.num_waves

    @property
    def stage_keys(self) -> dict[StageId, tuple[str, ...]]:
        return self.registrations.stage_keys

    @property
    def kinds(self) -> dict[str, KeyKind]:
        return self.registrations.kinds

    def stage_keys_of(self, vw: int, stage: int) -> tuple[str, ...]:
        """The keys of a registered stage of a live VW (WspError "not_registered" or "evicted" otherwise)."""
        return self.registrations.keys_of(vw, stage)

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
live span ("epoch") covers t; c_global and the gate count live VWs only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hetpipe.core.wsp.aggregation import KEY_KINDS, Aggregation, KeyKind, make_aggregation

__all__ = [
    "PULL_MODES",
    "PullResult",
    "PushResult",
    "ShardState",
    "TensorSource",
    "WaveSums",
    "WspError",
    "first_pulled_wave",
    "gate_version",
    "pending_bound",
]

PULL_MODES = ("exact", "latest")
StageId = tuple[int, int]  # (vw, stage)
OPEN = -1  # the end of a live VW's epoch


class TensorSource(Protocol):
    """What a push or registration may carry besides a plain array (hetpipe.core.protocol.wire.TensorView
    fits)."""

    dtype: np.dtype
    shape: tuple[int, ...]

    def copy_into(self, dst: np.ndarray) -> None: ...

    def add_into(self, dst: np.ndarray) -> None: ...

    def added_to(self, base: np.ndarray) -> np.ndarray: ...


Source = np.ndarray | TensorSource


class WspError(Exception):
    """A request the WSP rules refuse; `code` is the wire error code the server replies with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class PushResult:
    applied: bool  # False: the same (vw, stage, wave) was applied before
    c_global: int
    clock_advanced: bool


@dataclass(frozen=True)
class PullResult:
    version: int  # t of the W_t returned (exact); c_global at the time (latest)
    own_through: int  # the requester's own waves <= this are contained in the tensors
    tensors: dict[str, np.ndarray]


def gate_version(wave: int, staleness: int) -> int:
    """The index t of the global weights W_t that the gate of `wave` requires: wave - D - 1."""
    return wave - staleness - 1


def first_pulled_wave(staleness: int) -> int:
    """The first wave whose gate needs a pull; earlier waves start from W_0 (docs/wsp.md)."""
    return staleness + 2


def pending_bound(staleness: int) -> tuple[int, int]:
    """The most an exact shard holds, in waves' worth of its keys (docs/wsp.md#bounded-memory):
    (weight versions, wave sums) = (D + 2, D + 2). Versions W_t are kept from the oldest a pull may still
    ask for (c_global - D - 1 at the slowest stage, also what a resume from clock c_global or a rejoin needs)
    to the newest (c_global); sums of waves c_global .. c_global + D + 1, the furthest any VW may run ahead of
    the slowest."""
    return staleness + 2, staleness + 2


def _add(dst: np.ndarray, src: Source) -> None:
    if isinstance(src, np.ndarray):
        np.add(dst, src, out=dst)
    else:
        src.add_into(dst)


def _as_array(src: Source) -> np.ndarray:
    return src if isinstance(src, np.ndarray) else _copy(src)


def _copy(src: Source) -> np.ndarray:
    out = np.empty(tuple(src.shape), dtype=np.float32)
    if isinstance(src, np.ndarray):
        np.copyto(out, src)
    else:
        src.copy_into(out)
    return out


@dataclass
class WaveSums:
    """S_w of one wave, accumulated per key in contributor order; contributions wait in `held` until their VW
    completed the wave on this shard and every contributor before them is in.

    A sum with one contribution is kept as it arrived (a view over the received frames, no copy); the
    second contribution turns it into a fresh array.
    """

    sums: dict[str, Source] = field(default_factory=dict)
    merged: dict[str, int] = field(default_factory=dict)  # contributors (in order) already in sums[key]
    held: dict[str, dict[int, Source]] = field(default_factory=dict)
    owned: set[str] = field(default_factory=set)  # keys whose sum is our own array, safe to add into

    def add(self, key: str, vw: int, src: Source) -> None:
        self.held.setdefault(key, {})[vw] = src

    def drop(self, vw: int) -> None:
        """Forget VW `vw`'s contributions not merged yet (it was evicted before completing this wave)."""
        for key in list(self.held):
            self.held[key].pop(vw, None)
            if not self.held[key]:
                del self.held[key]

    def merge(self, order: list[int], complete: Callable[[int], bool]) -> None:
        """Merge held contributions while the next contributor in `order` has one and has completed the
        wave."""
        for key in list(self.held):
            parts, i = self.held[key], self.merged.get(key, 0)
            while i < len(order) and order[i] in parts and complete(order[i]):
                self._accumulate(key, parts.pop(order[i]))
                i += 1
            self.merged[key] = i
            if not parts:
                del self.held[key]

    def _accumulate(self, key: str, src: Source) -> None:
        part = self.sums.get(key)
        if part is None:
            self.sums[key] = src
        else:
            if key not in self.owned:
                part = self.sums[key] = _copy(part)
                self.owned.add(key)
            _add(part, src)

    def incomplete(self, contributors: int) -> list[str]:
        """Keys that still miss a contributor's update, or hold one never merged (empty when the sum is
        complete)."""
        return sorted({k for k, n in self.merged.items() if n != contributors} | set(self.held))


class ShardState:
    """The WSP state machine of one shard: who is registered and live, what was pushed and pulled, the
    weights."""

    def __init__(
        self, staleness: int, pull_mode: str = "exact", aggregation: Aggregation | None = None
    ) -> None:
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if pull_mode not in PULL_MODES:
            raise ValueError(f"pull_mode must be one of {PULL_MODES}, got {pull_mode!r}")
        self.staleness = staleness
        self.pull_mode = pull_mode
        self.aggregation = aggregation or make_aggregation("sum")
        self.num_vws: int | None = None
        self.num_waves: int | None = None  # the run's length, when the stages said (no pull asks past it)
        self.num_stages: dict[int, int] = {}
        self.stage_keys: dict[StageId, tuple[str, ...]] = {}
        self.key_owner: dict[tuple[int, str], int] = {}  # (vw, key) -> stage
        self.kinds: dict[str, KeyKind] = {}
        self.pushed: dict[StageId, int] = {}  # waves pushed, contiguous from the epoch's start
        self.pulled: dict[StageId, int] = {}  # highest wave pulled (first_pulled_wave - 1 before any)
        self.epochs: dict[
            int, list[list[int]]
        ] = {}  # vw -> [[start, end or OPEN], ...]: waves it contributes
        self.initial: dict[str, np.ndarray] = {}  # W_0
        self.versions: dict[int, dict[str, np.ndarray]] = {
            0: self.initial
        }  # exact: W_t, never changed once built
        self.wave_sums: dict[int, WaveSums] = {}  # exact: sums of waves not complete yet
        self.weights: dict[str, np.ndarray] = {}  # latest only: running weights (params and ledgers)
        self.latest_held: dict[
            int, dict[int, dict[str, Source]]
        ] = {}  # latest: vw -> wave -> pushes not folded
        self.latest_buffers: dict[int, dict[str, np.ndarray]] = {}  # latest: each VW's newest buffer values
        self._lent: dict[str, list[Callable[[], bool]]] = {}

    @property
    def version(self) -> int:
        """Exact: the newest W_t built (t = c_global once every VW's waves arrived)."""
        return max(self.versions)

    # ---- live virtual workers -----------------------------------------------------------------------
    def _epochs(self, vw: int) -> list[list[int]]:
        return self.epochs.setdefault(vw, [[0, OPEN]])

    def live(self, vw: int) -> bool:
        """A VW is live until evicted, and again once it rejoins."""
        return self._epochs(vw)[-1][1] == OPEN

    def live_vws(self) -> list[int]:
        return [v for v in range(self.num_vws or 0) if self.live(v)]

    def contributors(self, wave: int) -> list[int]:
        """The VWs whose updates wave `wave` sums, in order: those whose epoch covers it."""
        return [
            v
            for v in range(self.num_vws or 0)
            if any(s <= wave and (e == OPEN or wave < e) for s, e in self._epochs(v))
        ]

    def gaps(self) -> list[list[int]]:
        """[vw, from, to) wave ranges a VW contributes nothing to (evicted, until it rejoined;
        to = -1: open)."""
        out = []
        for v in range(self.num_vws or 0):
            spans = self._epochs(v)
            for (_, end), nxt in zip(spans, [*spans[1:], None], strict=True):
                if end != OPEN:
                    out.append([v, end, OPEN if nxt is None else nxt[0]])
        return out

    def evict(self, vw: int) -> tuple[int, bool]:
        """Remove VW `vw` from the live set at its wave boundary c_local(vw): its pushes of waves
        >= c_local(vw) (which some of its stages never pushed) are dropped. Returns (that boundary, whether
        c_global advanced). Evicting a VW that is not live changes nothing."""
        self._check_vw(vw)
        spans = self._epochs(vw)
        if spans[-1][1] != OPEN:
            return spans[-1][1], False
        before = self.c_global
        boundary = max(self.c_local(vw), spans[-1][0])
        spans[-1][1] = boundary
        if self.pull_mode == "exact":
            for wave, sums in self.wave_sums.items():
                if wave >= boundary:
                    sums.drop(vw)
            self._merge(sorted(self.wave_sums))
        else:
            self.latest_held.pop(vw, None)
            self.latest_buffers.pop(vw, None)
        self._build_versions()
        self._forget()
        return boundary, self.c_global > before

    def rejoin(self, vw: int, start_wave: int) -> None:
        """Make evicted VW `vw` live again from wave `start_wave` (its stages push from there). Refused when
        any push of a wave >= start_wave arrived already (its place in the sums' order would be taken) or the
        weights it would start from are gone."""
        self._check_vw(vw)
        if self.live(vw):
            start = self._epochs(vw)[-1][0]
            if start == start_wave:
                return  # a retried rejoin
            raise WspError("conflict", f"vw {vw} is live (since wave {start}): only an evicted VW rejoins")
        newest = max((n for (v, _), n in self.pushed.items() if self.live(v)), default=0)
        least = max(newest, self._epochs(vw)[-1][1])  # no push of a wave >= start_wave has arrived
        if self.pull_mode == "exact" and start_wave >= first_pulled_wave(self.staleness):
            least = max(
                least, min(self.versions) + self.staleness + 1
            )  # W_{start-D-1} is held or still to come
        if start_wave < least:
            raise WspError(
                "stale", f"vw {vw} cannot rejoin at wave {start_wave}: the earliest it may is {least}"
            )
        if self.num_waves is not None and start_wave >= self.num_waves:
            raise WspError(
                "stale", f"vw {vw} cannot rejoin at wave {start_wave}: the run has {self.num_waves} waves"
            )
        self._epochs(vw).append([start_wave, OPEN])
        for stage in range(self.num_stages.get(vw, 0)):
            sid = (vw, stage)
            if sid in self.stage_keys:
                self.pushed[sid] = start_wave
                self.pulled[sid] = max(self.pulled[sid], start_wave - 1)

    def epoch_start(self, vw: int) -> int:
        return self._epochs(vw)[-1][0]

    def _check_vw(self, vw: int) -> None:
        if self.num_vws is None or not 0 <= vw < self.num_vws:
            raise WspError(
                "bad_message", f"vw {vw} is not a virtual worker of this run ({self.num_vws or 0} known)"
            )

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
    ) -> dict[str, np.ndarray]:
        """Declare a stage's keys (first registration of a key sets its W_0) and their kinds (default
        "param"), and how many waves the run has (None: unknown); returns the PS's values. A stage registers
        again after a restart of the shard (nothing changes) or of its VW (start_wave: where it rejoined)."""
        if num_waves is not None:
            if self.num_waves not in (None, num_waves):
                raise WspError(
                    "conflict",
                    f"vw {vw} stage {stage} says the run has {num_waves} waves, not {self.num_waves}",
                )
            self.num_waves = num_waves
        if self.num_vws is None:
            self.num_vws = num_vws
        elif num_vws != self.num_vws:
            raise WspError("conflict", f"vw {vw} says the run has {num_vws} VWs, but it has {self.num_vws}")
        if not 0 <= vw < num_vws:
            raise WspError("bad_message", f"vw {vw} is out of range for {num_vws} VWs")
        if self.num_stages.setdefault(vw, num_stages) != num_stages:
            raise WspError(
                "conflict", f"vw {vw} has {self.num_stages[vw]} stages, a registration says {num_stages}"
            )
        if not 0 <= stage < num_stages:
            raise WspError("bad_message", f"stage {stage} is out of range for {num_stages} stages")
        if not self.live(vw):
            raise WspError(
                "evicted",
                f"vw {vw} was evicted at wave {self._epochs(vw)[-1][1]}: it must rejoin "
                "(`hetpipe worker --vw` rejoins at the next wave boundary)",
            )
        if start_wave != self.epoch_start(vw):
            raise WspError(
                "conflict",
                f"vw {vw} stage {stage} starts at wave {start_wave}, but vw {vw} is live from "
                f"wave {self.epoch_start(vw)}: every stage of a VW starts at the same wave",
            )
        sid = (vw, stage)
        keys = tuple(tensors)
        if sid in self.stage_keys and set(self.stage_keys[sid]) != set(keys):
            raise WspError("conflict", f"vw {vw} stage {stage} registered again with other keys")
        kinds = dict(kinds or {})
        for key, kind in kinds.items():
            if key not in tensors or kind not in KEY_KINDS:
                raise WspError(
                    "bad_message", f"kind {kind!r} of key {key!r}: give one of {KEY_KINDS} for a key sent"
                )
        for key, src in tensors.items():
            owner = self.key_owner.get((vw, key))
            if owner is not None and owner != stage:
                raise WspError("conflict", f"key {key!r} of vw {vw} is already owned by its stage {owner}")
            self._check_float32(key, src)
            held = self.initial.get(key)
            if held is not None and held.shape != tuple(src.shape):
                raise WspError(
                    "conflict", f"key {key!r} has shape {tuple(src.shape)}, registered before as {held.shape}"
                )
            kind = kinds.get(key, "param")
            if self.kinds.get(key, kind) != kind:
                raise WspError("conflict", f"key {key!r} is a {self.kinds[key]}, a registration says {kind}")
        for key, src in tensors.items():
            if key not in self.initial:
                self.initial[key] = _copy(src)
                if self.pull_mode == "latest":
                    self.weights[key] = self.initial[key].copy()
                self.kinds[key] = kinds.get(key, "param")
            self.key_owner[(vw, key)] = stage
        self.stage_keys[sid] = keys
        self.pushed.setdefault(sid, start_wave)
        self.pulled.setdefault(sid, max(first_pulled_wave(self.staleness), start_wave) - 1)
        return {key: self.initial[key] for key in keys}

    @staticmethod
    def _check_float32(key: str, src: Source) -> None:
        if np.dtype(src.dtype) != np.float32:
            raise WspError("bad_message", f"key {key!r} is {np.dtype(src.dtype)}; the PS holds float32 only")

    def stage_keys_of(self, vw: int, stage: int) -> tuple[str, ...]:
        """The keys of a registered stage of a live VW (WspError "not_registered" or "evicted" otherwise)."""
        return self._stage_keys(vw, stage)

    def _stage_keys(self, vw: int, stage: int) -> tuple[str, ...]:
        keys = self.stage_keys.get((vw, stage))
        if keys is None:
            raise WspError("not_registered", f"vw {vw} stage {stage} is not registered on this shard")
        if not self.live(vw):
            raise WspError(
                "evicted",
                f"vw {vw} was evicted at wave {self._epochs(vw)[-1][1]}; its stages must stop "
                "(`hetpipe worker --vw` rejoins it at the next wave boundary)",
            )
        return keys

    # ---- clocks -------------------------------------------------------------------------------------
    def c_local(self, vw: int) -> int:
        """Waves VW `vw` has completed on this shard: every one of its stages pushed them."""
        stages = self.num_stages.get(vw)
        if stages is None:
            return 0
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
        keys = self._stage_keys(vw, stage)
        done = self.pushed[(vw, stage)]
        before = self.c_global
        if wave < done:
            return PushResult(applied=False, c_global=before, clock_advanced=False)
        if wave > done:
            raise WspError(
                "out_of_order", f"vw {vw} stage {stage} pushed wave {wave} before wave {done}: push in order"
            )
        if set(tensors) != set(keys):
            missing = sorted(set(keys) - set(tensors))[:3]
            extra = sorted(set(tensors) - set(keys))[:3]
            raise WspError(
                "bad_message",
                f"push of vw {vw} stage {stage} must carry exactly its registered keys "
                f"(missing {missing}, unexpected {extra})",
            )
        for key, src in tensors.items():
            self._check_float32(key, src)
            if tuple(src.shape) != self.initial[key].shape:
                raise WspError(
                    "bad_message",
                    f"update of {key!r} has shape {tuple(src.shape)}, not {self.initial[key].shape}",
                )
        completed = self.c_local(vw)
        if self.pull_mode == "exact":
            sums = self.wave_sums.setdefault(wave, WaveSums())
            for key, src in tensors.items():
                sums.add(key, vw, src)
        else:
            self.latest_held.setdefault(vw, {}).setdefault(wave, {}).update(tensors)
        self.pushed[(vw, stage)] = done + 1
        now_complete = range(completed, self.c_local(vw))  # waves this push completed for its VW
        if self.pull_mode == "exact":
            self._merge(list(now_complete))
        else:
            for t in now_complete:
                self._fold_now(vw, t, self.latest_held[vw].pop(t, {}))
        after = self.c_global
        self._build_versions()
        self._forget()
        return PushResult(applied=True, c_global=after, clock_advanced=after > before)

    def _merge(self, waves: list[int]) -> None:
        for wave in waves:
            sums = self.wave_sums.get(wave)
            if sums is not None:
                sums.merge(self.contributors(wave), lambda v, wave=wave: self.c_local(v) > wave)

    def _fold_now(self, vw: int, wave: int, tensors: Mapping[str, Source]) -> None:
        """Latest: fold one VW's complete wave into the running weights (buffers: keep its newest values)."""
        count = max(1, len(self.contributors(wave)))
        for key, src in tensors.items():
            kind = self.kinds[key]
            if kind == "buffer":
                self.latest_buffers.setdefault(vw, {})[key] = _copy(src)
                continue
            if self.aggregation.adds(kind):  # W += S straight from the received frames, not copied out first
                _add(self._writable(key), src)
                continue
            new = self.aggregation.add_now(key, kind, self._writable(key), _as_array(src), count)
            if new is not None:
                self.weights[key] = new.astype(np.float32, copy=False)

    # ---- pull ---------------------------------------------------------------------------------------
    def pull(self, vw: int, stage: int, wave: int) -> PullResult:
        """The global weights for the gate of `wave` (call only once gate_open(wave)).

        Exact versions are never changed once built, so the arrays can be sent without a copy; the latest
        running weights may be the shard's own arrays: a caller that keeps them past the next push (a
        zero-copy send) must `lend` them.
        """
        keys = self._stage_keys(vw, stage)
        if not self.gate_open(wave):
            raise WspError(
                "internal", f"pull of wave {wave} before its gate opened (c_global {self.c_global})"
            )
        sid = (vw, stage)
        if self.pull_mode == "latest":
            result = PullResult(
                version=self.c_global,
                own_through=self.c_local(vw) - 1,
                tensors={k: self._latest(k) for k in keys},
            )
        else:
            target = gate_version(wave, self.staleness)
            result = PullResult(version=target, own_through=target - 1, tensors=self.weights_at(keys, target))
        self.pulled[sid] = max(self.pulled[sid], wave)
        self._forget()
        return result

    def _latest(self, key: str) -> np.ndarray:
        if self.kinds[key] != "buffer":
            return self.weights[key]
        values = [
            self.latest_buffers[v][key] for v in sorted(self.latest_buffers) if key in self.latest_buffers[v]
        ]
        if not values:
            return self.initial[key]
        total = values[0].copy()
        for part in values[1:]:
            total += part
        return np.asarray(total / np.float32(len(values)), dtype=np.float32)

    def read(self) -> PullResult:
        """Every key's newest complete weights: W_{c_global} (exact) or the running weights (latest)."""
        if self.pull_mode == "latest":
            return PullResult(self.c_global, -1, {k: self._latest(k) for k in self.initial})
        return PullResult(self.version, -1, self.weights_at(tuple(self.initial), self.version))

    def weights_at(self, keys: tuple[str, ...], target: int) -> dict[str, np.ndarray]:
        """W_target for `keys` (exact): a version built and not yet forgotten."""
        found = self.versions.get(target)
        if found is None:
            oldest = min(self.versions)
            raise WspError(
                "stale",
                f"W_{target} is not held (the shard holds W_{oldest}..W_{self.version}); "
                "a retried old pull, or a pull before its gate?",
            )
        return {k: found[k] for k in keys}

    # ---- building and forgetting versions ------------------------------------------------------------
    def _build_versions(self) -> None:
        """Exact: build W_{t+1} from W_t and S_t for every wave t that every live VW has completed."""
        if self.pull_mode != "exact" or self.num_vws is None:
            return
        while self.version < self.c_global:
            t = self.version
            sums = self.wave_sums.pop(t, WaveSums())
            contributors = self.contributors(t)
            incomplete = sums.incomplete(len(contributors))
            if incomplete:
                self.wave_sums[t] = sums
                raise WspError(
                    "conflict",
                    f"wave {t} completed but keys {incomplete[:3]} lack some VW's update: "
                    "every VW must place the same keys on the same shard",
                )
            old = self.versions[t]
            new = {}
            for key, w in old.items():
                part = sums.sums.get(key)
                new[key] = w if part is None else self._folded(key, w, part, len(contributors))
            self.versions[t + 1] = new

    def _folded(self, key: str, w: np.ndarray, part: Source, contributors: int) -> np.ndarray:
        """W_{t+1}[key]; a sum that is still the received frames (one contributor) is added to W_t straight
        from them where the rule is W + S, not copied out first (100 MB in 4 MB keys: 23 ms against 35,
        2-core VM)."""
        kind = self.kinds[key]
        if not isinstance(part, np.ndarray) and self.aggregation.adds(kind):
            return part.added_to(w)
        return self.aggregation.fold(key, kind, w, _as_array(part), contributors)

    def oldest_needed(self) -> int:
        """The oldest W_t a pull may still ask for: a live stage that pulled wave c or pushed wave c has
        passed the gates of every wave <= c, so it will ask for W_{c'-D-1} with c' > c only. W_{c_global-D-1}
        stays too: a resume from clock c_global, or a VW rejoining, starts from it."""
        live = [sid for sid in self.pulled if self.live(sid[0])]
        keep = max(0, self.c_global - self.staleness - 1)
        if not live:
            return keep
        passed = min(max(self.pulled[sid], self.pushed[sid] - 1) for sid in live)
        return min(keep, max(0, passed + 1 - self.staleness - 1))

    def last_pullable(self) -> int | None:
        """The newest W_t any pull of the run will ask for (the last wave's gate), when the length is
        known."""
        return None if self.num_waves is None else gate_version(self.num_waves - 1, self.staleness)

    def _forget(self) -> None:
        """Exact: drop versions no pull can ask for any more (the newest always stays, for reads)."""
        if self.pull_mode != "exact":
            return
        oldest, last = self.oldest_needed(), self.last_pullable()
        for t in [t for t in self.versions if t < self.version]:
            if t < oldest or (last is not None and t > last):
                del self.versions[t]

    def lend(self, key: str, is_done: Callable[[], bool]) -> None:
        """Latest: mark weights[key] as read by an in-flight zero-copy send until is_done() turns true (the
        sends already done are dropped here, so many reads between two pushes keep this list short)."""
        self._lent[key] = [done for done in self._lent.get(key, []) if not done()] + [is_done]

    def _writable(self, key: str) -> np.ndarray:
        """weights[key], copied first if a send still reads it (copy-on-write, never a wait)."""
        readers = self._lent.pop(key, [])
        if not all(done() for done in readers):
            self.weights[key] = self.weights[key].copy()
        return self.weights[key]

    # ---- inspection and snapshots --------------------------------------------------------------------
    def held_waves(self) -> tuple[int, int]:
        """(weight versions, wave sums) held now; exact shards keep both within pending_bound(D)."""
        return len(self.versions), len(self.wave_sums)

    def status(self) -> dict[str, Any]:
        return {
            "c_global": self.c_global,
            "c_local": [self.c_local(v) for v in range(self.num_vws or 0)],
            "live": self.live_vws(),
            "epochs": [self._epochs(v) for v in range(self.num_vws or 0)],
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
        """Everything needed to resume: msgpack-able metadata and the named float32 arrays. `detached`: copy
        the arrays later pushes change in place (latest weights, sums being accumulated), so that another
        thread may write them out while the shard goes on; the others are never changed once made. The
        metadata is always a copy: a writer thread encodes it later, and must see the state of this moment."""
        arrays: dict[str, np.ndarray] = {f"i/{k}": v for k, v in self.initial.items()}
        if self.pull_mode == "latest":
            arrays.update({f"w/{k}": v.copy() if detached else v for k, v in self.weights.items()})
            for vw, values in self.latest_buffers.items():
                arrays.update({f"b/{vw}/{k}": v for k, v in values.items()})
            for vw, waves in self.latest_held.items():
                for wave, tensors in waves.items():
                    arrays.update({f"l/{vw}/{wave}/{k}": _as_array(v) for k, v in tensors.items()})
        for t, weights in self.versions.items():
            if t:
                arrays.update({f"v/{t}/{k}": v for k, v in weights.items()})
        sums_meta = {}
        for wave, ws in self.wave_sums.items():
            for key, arr in ws.sums.items():
                arrays[f"s/{wave}/{key}"] = arr.copy() if detached and key in ws.owned else _as_array(arr)
            for key, held in ws.held.items():
                for v, arr in held.items():
                    arrays[f"h/{wave}/{v}/{key}"] = _as_array(arr)
            sums_meta[str(wave)] = {
                "merged": dict(ws.merged),
                "summed": sorted(ws.sums),
                "held": {k: sorted(h) for k, h in ws.held.items()},
            }
        optimizer_meta, opt_arrays = (
            self.aggregation.to_state()
        )  # a PS-side optimizer's state, if the rule has one
        arrays.update({f"o/{k}": v for k, v in opt_arrays.items()})
        meta = {
            "staleness": self.staleness,
            "pull_mode": self.pull_mode,
            "aggregation": self.aggregation.name,
            "optimizer": optimizer_meta,
            "num_vws": self.num_vws,
            "num_waves": self.num_waves,
            "num_stages": {str(v): n for v, n in self.num_stages.items()},
            "epochs": {str(v): [list(span) for span in spans] for v, spans in self.epochs.items()},
            "stages": [
                {
                    "vw": v,
                    "stage": s,
                    "keys": list(keys),
                    "pushed": self.pushed[(v, s)],
                    "pulled": self.pulled[(v, s)],
                }
                for (v, s), keys in sorted(self.stage_keys.items())
            ],
            "kinds": dict(self.kinds),
            "versions": sorted(self.versions),
            "latest_buffers": {str(v): list(values) for v, values in self.latest_buffers.items()},
            "latest_held": {
                str(v): {str(t): list(ts) for t, ts in waves.items()} for v, waves in self.latest_held.items()
            },
            "wave_sums": sums_meta,
        }
        return meta, arrays

    @classmethod
    def from_state(
        cls,
        meta: Mapping[str, Any],
        arrays: Mapping[str, np.ndarray],
        aggregation: Aggregation | None = None,
        cut: int | None = None,
    ) -> ShardState:
        """The state `to_state` wrote; `aggregation` supplies the rule (and its optimizer settings) to resume.

        `cut` (exact pulls only): the state as it was when every stage had pushed exactly the waves < cut and
        nothing more, what `hetpipe train --resume` restarts the stages from (docs/recovery.md)."""
        aggregation = aggregation or make_aggregation(meta.get("aggregation", "sum"))
        if meta.get("optimizer"):
            prefix = "o/"
            aggregation.load_state(
                meta["optimizer"], {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
            )
        state = cls(meta["staleness"], meta["pull_mode"], aggregation)
        state.num_vws = meta["num_vws"]
        state.num_waves = meta.get("num_waves")
        state.num_stages = {int(v): n for v, n in meta["num_stages"].items()}
        state.epochs = {int(v): [list(s) for s in spans] for v, spans in meta.get("epochs", {}).items()}
        state.kinds = dict(meta["kinds"])
        for entry in meta["stages"]:
            sid = (entry["vw"], entry["stage"])
            state.stage_keys[sid] = tuple(entry["keys"])
            state.pushed[sid] = entry["pushed"]
            state.pulled[sid] = entry["pulled"]
            for key in entry["keys"]:
                state.key_owner[(entry["vw"], key)] = entry["stage"]

        def load(name: str) -> np.ndarray:
            return np.array(arrays[name], dtype=np.float32)

        state.initial = {k: load(f"i/{k}") for k in state.kinds}
        state.versions = {
            t: (state.initial if t == 0 else {k: load(f"v/{t}/{k}") for k in state.kinds})
            for t in meta["versions"]
        }
        if state.pull_mode == "latest":
            state.weights = {k: load(f"w/{k}") for k in state.kinds}
            state.latest_buffers = {
                int(v): {k: load(f"b/{v}/{k}") for k in keys} for v, keys in meta["latest_buffers"].items()
            }
            state.latest_held = {
                int(v): {int(t): {k: load(f"l/{v}/{t}/{k}") for k in keys} for t, keys in waves.items()}
                for v, waves in meta.get("latest_held", {}).items()
            }
        for wave_s, wm in meta["wave_sums"].items():
            wave = int(wave_s)
            ws = WaveSums(merged=dict(wm["merged"]))
            ws.sums = {k: load(f"s/{wave}/{k}") for k in wm["summed"]}
            ws.owned = set(ws.sums)
            ws.held = {k: {v: load(f"h/{wave}/{v}/{k}") for v in vs} for k, vs in wm["held"].items()}
            state.wave_sums[wave] = ws
        if cut is not None:
            state._cut_at(cut)
        return state

    def _cut_at(self, cut: int) -> None:
        """Forget every push of a wave >= cut (exact pulls: nothing of them is folded into a version yet)."""
        if self.pull_mode != "exact":
            raise WspError("conflict", "only a shard with exact pulls can be cut back to a wave")
        need = max(0, gate_version(cut, self.staleness))
        if self.c_global != cut or need < min(self.versions):
            raise WspError(
                "stale",
                f"this checkpoint (c_global {self.c_global}, versions {sorted(self.versions)}) "
                f"cannot be cut back to wave {cut}",
            )
        if any(spans != [[0, OPEN]] for spans in self.epochs.values()):
            raise WspError(
                "conflict",
                "virtual workers were evicted or rejoined in this run: a resume restarts "
                "every VW from one wave, and an evicted VW has no state at it",
            )
        self.wave_sums = {t: s for t, s in self.wave_sums.items() if t < cut}
        for t in [t for t in self.versions if t > cut]:
            del self.versions[t]
        for sid in self.pushed:
            if self.live(sid[0]):
                self.pushed[sid] = min(self.pushed[sid], cut)
                self.pulled[sid] = first_pulled_wave(self.staleness) - 1

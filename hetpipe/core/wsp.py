"""Wave Synchronous Parallel state of one PS shard: registrations, idempotent pushes, clocks, the gate,
exact and latest pulls, buffers, bounded memory, snapshots. Pure: numpy arrays in, numpy arrays out, no
sockets (docs/wsp.md).

Arithmetic, fixed so runs are reproducible bit for bit:
    S_t = ((P_0(t) + P_1(t)) + P_2(t)) + ...      (VW order, whatever the arrival order)
    W_{t+1} = fold(W_t, S_t)                       (hetpipe.core.aggregation: sum, mean or server optimizer)
where P_i(t) is VW i's push of wave t for a key: its summed update (or mean gradient, with aggregation
"server") for a parameter, its current values for a buffer. `exact` pulls return exactly W_{c-D-1}, built
once wave c-D-2 is complete and kept while a pull may still ask for it; `latest` pulls return the running
weights, into which every push is folded the moment it arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hetpipe.core.aggregation import KEY_KINDS, Aggregation, KeyKind, make_aggregation

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


class TensorSource(Protocol):
    """What a push or registration may carry besides a plain array (hetpipe.core.wire.TensorView fits)."""

    dtype: np.dtype
    shape: tuple[int, ...]

    def copy_into(self, dst: np.ndarray) -> None: ...

    def add_into(self, dst: np.ndarray) -> None: ...


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
    ask for (c_global - D - 1 at the slowest stage) to the newest (c_global); sums of waves c_global ..
    c_global + D + 1, the furthest any VW may run ahead of the slowest."""
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
    """S_w of one wave, accumulated per key in VW order; early arrivals from later VWs are held.

    A sum with one contribution is kept as it arrived (a view over the received frames, no copy); the
    second contribution turns it into a fresh array.
    """

    sums: dict[str, Source] = field(default_factory=dict)
    next_vw: dict[str, int] = field(default_factory=dict)
    held: dict[str, dict[int, Source]] = field(default_factory=dict)
    owned: set[str] = field(default_factory=set)  # keys whose sum is our own array, safe to add into

    def add(self, key: str, vw: int, src: Source) -> None:
        if vw != self.next_vw.get(key, 0):
            self.held.setdefault(key, {})[vw] = src
            return
        self._accumulate(key, src)
        waiting = self.held.get(key, {})
        while self.next_vw[key] in waiting:
            self._accumulate(key, waiting.pop(self.next_vw[key]))
        if key in self.held and not waiting:
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
        self.next_vw[key] = self.next_vw.get(key, 0) + 1

    def incomplete(self, num_vws: int) -> list[str]:
        """Keys that still miss a VW's contribution (empty when the wave sum is complete)."""
        return sorted(k for k, n in self.next_vw.items() if n != num_vws) + sorted(
            k for k in self.held if k not in self.next_vw
        )


class ShardState:
    """The WSP state machine of one shard: who is registered, what was pushed and pulled, the weights."""

    def __init__(self, staleness: int, pull_mode: str = "exact", aggregation: Aggregation | None = None) -> None:
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
        self.pushed: dict[StageId, int] = {}  # waves pushed, contiguous from 0
        self.pulled: dict[StageId, int] = {}  # highest wave pulled (first_pulled_wave - 1 before any)
        self.initial: dict[str, np.ndarray] = {}  # W_0
        self.versions: dict[int, dict[str, np.ndarray]] = {0: self.initial}  # exact: W_t, never changed once built
        self.wave_sums: dict[int, WaveSums] = {}  # exact: sums of waves not complete yet
        self.weights: dict[str, np.ndarray] = {}  # latest only: running weights (params and ledgers)
        self.latest_buffers: dict[int, dict[str, np.ndarray]] = {}  # latest: each VW's newest buffer values
        self._lent: dict[str, list[Callable[[], bool]]] = {}

    @property
    def version(self) -> int:
        """Exact: the newest W_t built (t = c_global once every VW's waves arrived)."""
        return max(self.versions)

    # ---- registration -------------------------------------------------------------------------------
    def register(
        self, vw: int, stage: int, num_vws: int, num_stages: int, tensors: Mapping[str, Source],
        kinds: Mapping[str, str] | None = None, num_waves: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Declare a stage's keys (first registration of a key sets its W_0) and their kinds (default
        "param"), and how many waves the run has (None: unknown); returns the PS's values."""
        if num_waves is not None:
            if self.num_waves not in (None, num_waves):
                raise WspError("conflict", f"vw {vw} stage {stage} says the run has {num_waves} waves, not {self.num_waves}")
            self.num_waves = num_waves
        if self.num_vws is None:
            self.num_vws = num_vws
        elif num_vws != self.num_vws:
            raise WspError("conflict", f"vw {vw} says the run has {num_vws} VWs, but it has {self.num_vws}")
        if not 0 <= vw < num_vws:
            raise WspError("bad_message", f"vw {vw} is out of range for {num_vws} VWs")
        if self.num_stages.setdefault(vw, num_stages) != num_stages:
            raise WspError("conflict", f"vw {vw} has {self.num_stages[vw]} stages, a registration says {num_stages}")
        if not 0 <= stage < num_stages:
            raise WspError("bad_message", f"stage {stage} is out of range for {num_stages} stages")
        sid = (vw, stage)
        keys = tuple(tensors)
        if sid in self.stage_keys and set(self.stage_keys[sid]) != set(keys):
            raise WspError("conflict", f"vw {vw} stage {stage} registered again with other keys")
        kinds = dict(kinds or {})
        for key, kind in kinds.items():
            if key not in tensors or kind not in KEY_KINDS:
                raise WspError("bad_message", f"kind {kind!r} of key {key!r}: give one of {KEY_KINDS} for a key sent")
        for key, src in tensors.items():
            owner = self.key_owner.get((vw, key))
            if owner is not None and owner != stage:
                raise WspError("conflict", f"key {key!r} of vw {vw} is already owned by its stage {owner}")
            self._check_float32(key, src)
            held = self.initial.get(key)
            if held is not None and held.shape != tuple(src.shape):
                raise WspError("conflict", f"key {key!r} has shape {tuple(src.shape)}, registered before as {held.shape}")
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
        self.pushed.setdefault(sid, 0)
        self.pulled.setdefault(sid, first_pulled_wave(self.staleness) - 1)
        return {key: self.initial[key] for key in keys}

    @staticmethod
    def _check_float32(key: str, src: Source) -> None:
        if np.dtype(src.dtype) != np.float32:
            raise WspError("bad_message", f"key {key!r} is {np.dtype(src.dtype)}; the PS holds float32 only")

    def _stage_keys(self, vw: int, stage: int) -> tuple[str, ...]:
        keys = self.stage_keys.get((vw, stage))
        if keys is None:
            raise WspError("not_registered", f"vw {vw} stage {stage} is not registered on this shard")
        return keys

    # ---- clocks -------------------------------------------------------------------------------------
    def c_local(self, vw: int) -> int:
        """Waves VW `vw` has completed on this shard: every one of its stages pushed them."""
        stages = self.num_stages.get(vw)
        if stages is None:
            return 0
        return min(self.pushed.get((vw, s), 0) for s in range(stages))

    @property
    def c_global(self) -> int:
        if self.num_vws is None:
            return 0
        return min(self.c_local(vw) for vw in range(self.num_vws))

    def gate_open(self, wave: int) -> bool:
        """Wave `wave` may start once every VW completed wave - D - 2, i.e. c_global >= wave - D - 1."""
        return self.c_global >= gate_version(wave, self.staleness)

    def slowest_vw(self) -> int | None:
        """The VW with the fewest completed waves (the one a blocked pull waits for)."""
        if self.num_vws is None:
            return None
        return min(range(self.num_vws), key=self.c_local)

    # ---- push ---------------------------------------------------------------------------------------
    def push(self, vw: int, stage: int, wave: int, tensors: Mapping[str, Source]) -> PushResult:
        """Add a stage's push of `wave`; the same (vw, stage, wave) counts once.

        The arrays are kept by reference until folded: the caller must not change them afterwards.
        """
        keys = self._stage_keys(vw, stage)
        done = self.pushed[(vw, stage)]
        before = self.c_global
        if wave < done:
            return PushResult(applied=False, c_global=before, clock_advanced=False)
        if wave > done:
            raise WspError("out_of_order", f"vw {vw} stage {stage} pushed wave {wave} before wave {done}: push in order")
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
                raise WspError("bad_message", f"update of {key!r} has shape {tuple(src.shape)}, not {self.initial[key].shape}")
        if self.pull_mode == "exact":
            sums = self.wave_sums.setdefault(wave, WaveSums())
            for key, src in tensors.items():
                sums.add(key, vw, src)
        else:
            self._fold_now(vw, tensors)
        self.pushed[(vw, stage)] = done + 1
        after = self.c_global
        self._build_versions()
        self._forget()
        return PushResult(applied=True, c_global=after, clock_advanced=after > before)

    def _fold_now(self, vw: int, tensors: Mapping[str, Source]) -> None:
        """Latest: fold one VW's push into the running weights (buffers: keep its newest values)."""
        assert self.num_vws is not None
        for key, src in tensors.items():
            kind = self.kinds[key]
            if kind == "buffer":
                self.latest_buffers.setdefault(vw, {})[key] = _copy(src)
                continue
            new = self.aggregation.add_now(key, kind, self._writable(key), _as_array(src), self.num_vws)
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
            raise WspError("internal", f"pull of wave {wave} before its gate opened (c_global {self.c_global})")
        sid = (vw, stage)
        if self.pull_mode == "latest":
            result = PullResult(version=self.c_global, own_through=self.pushed[sid] - 1,
                                tensors={k: self._latest(k) for k in keys})
        else:
            target = gate_version(wave, self.staleness)
            result = PullResult(version=target, own_through=target - 1, tensors=self.weights_at(keys, target))
        self.pulled[sid] = max(self.pulled[sid], wave)
        self._forget()
        return result

    def _latest(self, key: str) -> np.ndarray:
        if self.kinds[key] != "buffer":
            return self.weights[key]
        values = [self.latest_buffers[v][key] for v in sorted(self.latest_buffers) if key in self.latest_buffers[v]]
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
            raise WspError("stale", f"W_{target} is not held (the shard holds W_{oldest}..W_{self.version}); "
                                    "a retried old pull, or a pull before its gate?")
        return {k: found[k] for k in keys}

    # ---- building and forgetting versions ------------------------------------------------------------
    def _build_versions(self) -> None:
        """Exact: build W_{t+1} from W_t and S_t for every wave t that every VW has completed."""
        if self.pull_mode != "exact" or self.num_vws is None:
            return
        while self.version < self.c_global:
            t = self.version
            sums = self.wave_sums.pop(t, WaveSums())
            incomplete = sums.incomplete(self.num_vws)
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
                new[key] = w if part is None else self.aggregation.fold(key, self.kinds[key], w, _as_array(part),
                                                                        self.num_vws)
            self.versions[t + 1] = new

    def oldest_needed(self) -> int:
        """The oldest W_t a pull may still ask for: a stage that pulled wave c or pushed wave c has passed the
        gates of every wave <= c, so it will ask for W_{c'-D-1} with c' > c only."""
        if not self.pulled:
            return 0
        passed = min(max(self.pulled[sid], self.pushed[sid] - 1) for sid in self.pulled)
        return max(0, passed + 1 - self.staleness - 1)

    def last_pullable(self) -> int | None:
        """The newest W_t any pull of the run will ask for (the last wave's gate), when the length is known."""
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
            "version": self.version,
            "num_vws": self.num_vws,
            "registered": len(self.stage_keys),
            "versions": sorted(self.versions) if self.pull_mode == "exact" else [],
            "pending_waves": sorted(self.wave_sums),
            "pull_mode": self.pull_mode,
            "staleness": self.staleness,
            "aggregation": self.aggregation.name,
        }

    def to_state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Everything needed to resume: msgpack-able metadata and the named float32 arrays."""
        arrays: dict[str, np.ndarray] = {f"i/{k}": v for k, v in self.initial.items()}
        if self.pull_mode == "latest":
            arrays.update({f"w/{k}": v for k, v in self.weights.items()})
            for vw, values in self.latest_buffers.items():
                arrays.update({f"b/{vw}/{k}": v for k, v in values.items()})
        for t, weights in self.versions.items():
            if t:
                arrays.update({f"v/{t}/{k}": v for k, v in weights.items()})
        sums_meta = {}
        for wave, ws in self.wave_sums.items():
            for key, arr in ws.sums.items():
                arrays[f"s/{wave}/{key}"] = _as_array(arr)
            for key, held in ws.held.items():
                for v, arr in held.items():
                    arrays[f"h/{wave}/{v}/{key}"] = _as_array(arr)
            sums_meta[str(wave)] = {"next_vw": ws.next_vw, "held": {k: sorted(h) for k, h in ws.held.items()}}
        optimizer_meta = None
        if self.aggregation.optimizer is not None:
            optimizer_meta, opt_arrays = self.aggregation.optimizer.to_state()
            arrays.update({f"o/{k}": v for k, v in opt_arrays.items()})
        meta = {
            "staleness": self.staleness,
            "pull_mode": self.pull_mode,
            "aggregation": self.aggregation.name,
            "optimizer": optimizer_meta,
            "num_vws": self.num_vws,
            "num_waves": self.num_waves,
            "num_stages": {str(v): n for v, n in self.num_stages.items()},
            "stages": [
                {"vw": v, "stage": s, "keys": list(keys), "pushed": self.pushed[(v, s)], "pulled": self.pulled[(v, s)]}
                for (v, s), keys in sorted(self.stage_keys.items())
            ],
            "kinds": self.kinds,
            "versions": sorted(self.versions),
            "latest_buffers": {str(v): list(values) for v, values in self.latest_buffers.items()},
            "wave_sums": sums_meta,
        }
        return meta, arrays

    @classmethod
    def from_state(cls, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
                   aggregation: Aggregation | None = None) -> ShardState:
        """The state `to_state` wrote; `aggregation` supplies the rule (and its optimizer settings) to resume."""
        aggregation = aggregation or make_aggregation(meta.get("aggregation", "sum"))
        if aggregation.optimizer is not None and meta.get("optimizer"):
            prefix = "o/"
            aggregation.optimizer.load_state(
                meta["optimizer"], {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)})
        state = cls(meta["staleness"], meta["pull_mode"], aggregation)
        state.num_vws = meta["num_vws"]
        state.num_waves = meta.get("num_waves")
        state.num_stages = {int(v): n for v, n in meta["num_stages"].items()}
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
        state.versions = {t: (state.initial if t == 0 else {k: load(f"v/{t}/{k}") for k in state.kinds})
                          for t in meta["versions"]}
        if state.pull_mode == "latest":
            state.weights = {k: load(f"w/{k}") for k in state.kinds}
            state.latest_buffers = {int(v): {k: load(f"b/{v}/{k}") for k in keys}
                                    for v, keys in meta["latest_buffers"].items()}
        for wave_s, wm in meta["wave_sums"].items():
            wave = int(wave_s)
            ws = WaveSums(next_vw=dict(wm["next_vw"]))
            ws.sums = {k: load(f"s/{wave}/{k}") for k in wm["next_vw"]}
            ws.owned = set(ws.sums)
            ws.held = {k: {v: load(f"h/{wave}/{v}/{k}") for v in vs} for k, vs in wm["held"].items()}
            state.wave_sums[wave] = ws
        return state

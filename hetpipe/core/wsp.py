"""Wave Synchronous Parallel state of one PS shard: registrations, idempotent pushes, clocks, the gate,
exact and latest pulls, snapshots. Pure: numpy arrays in, numpy arrays out, no sockets (hetpipe.md §3).

Arithmetic, fixed so runs are reproducible bit for bit:
    W_{t+1} = W_t + S_t,   S_t = ((Δ_0(t) + Δ_1(t)) + Δ_2(t)) + ...   (VW order, whatever the arrival order)
where Δ_i(t) is VW i's summed update of wave t for a key. `exact` pulls return exactly W_{c-D-1}; `latest`
pulls return the running weights, to which every update is added the moment it arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

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
    """The first wave whose gate needs a pull; earlier waves start from W_0 (hetpipe.md §3)."""
    return staleness + 2


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

    def __init__(self, staleness: int, pull_mode: str = "exact") -> None:
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if pull_mode not in PULL_MODES:
            raise ValueError(f"pull_mode must be one of {PULL_MODES}, got {pull_mode!r}")
        self.staleness = staleness
        self.pull_mode = pull_mode
        self.num_vws: int | None = None
        self.num_stages: dict[int, int] = {}
        self.stage_keys: dict[StageId, tuple[str, ...]] = {}
        self.key_owner: dict[tuple[int, str], int] = {}  # (vw, key) -> stage
        self.pushed: dict[StageId, int] = {}  # waves pushed, contiguous from 0
        self.pulled: dict[StageId, int] = {}  # highest wave pulled
        self.weights: dict[str, np.ndarray] = {}  # exact: W_version; latest: running weights
        self.version = 0
        self.wave_sums: dict[int, WaveSums] = {}
        self._lent: dict[str, list[Callable[[], bool]]] = {}

    # ---- registration -------------------------------------------------------------------------------
    def register(
        self, vw: int, stage: int, num_vws: int, num_stages: int, tensors: Mapping[str, Source]
    ) -> dict[str, np.ndarray]:
        """Declare a stage's keys (first registration of a key sets its W_0); returns the PS's values."""
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
        sid = (vw, stage)
        keys = tuple(tensors)
        if sid in self.stage_keys and set(self.stage_keys[sid]) != set(keys):
            raise WspError("conflict", f"vw {vw} stage {stage} registered again with other keys")
        for key, src in tensors.items():
            owner = self.key_owner.get((vw, key))
            if owner is not None and owner != stage:
                raise WspError("conflict", f"key {key!r} of vw {vw} is already owned by its stage {owner}")
            self._check_float32(key, src)
            held = self.weights.get(key)
            if held is not None and held.shape != tuple(src.shape):
                raise WspError(
                    "conflict", f"key {key!r} has shape {tuple(src.shape)}, registered before as {held.shape}"
                )
        for key, src in tensors.items():
            if key not in self.weights:
                self.weights[key] = _copy(src)
            self.key_owner[(vw, key)] = stage
        self.stage_keys[sid] = keys
        self.pushed.setdefault(sid, 0)
        self.pulled.setdefault(sid, first_pulled_wave(self.staleness) - 1)
        return {key: self.weights[key] for key in keys}

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
    def push(self, vw: int, stage: int, wave: int, deltas: Mapping[str, Source]) -> PushResult:
        """Add a stage's summed update of `wave`; the same (vw, stage, wave) counts once.

        The deltas are kept by reference until folded: the caller must not change them afterwards.
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
        if set(deltas) != set(keys):
            missing = sorted(set(keys) - set(deltas))[:3]
            extra = sorted(set(deltas) - set(keys))[:3]
            raise WspError(
                "bad_message",
                f"push of vw {vw} stage {stage} must carry exactly its registered keys "
                f"(missing {missing}, unexpected {extra})",
            )
        for key, src in deltas.items():
            self._check_float32(key, src)
            if tuple(src.shape) != self.weights[key].shape:
                raise WspError(
                    "bad_message", f"update of {key!r} has shape {tuple(src.shape)}, not {self.weights[key].shape}"
                )
        if self.pull_mode == "exact":
            sums = self.wave_sums.setdefault(wave, WaveSums())
            for key, src in deltas.items():
                sums.add(key, vw, src)
        else:
            for key, src in deltas.items():
                _add(self._writable(key), src)
        self.pushed[(vw, stage)] = done + 1
        after = self.c_global
        self._fold()
        return PushResult(applied=True, c_global=after, clock_advanced=after > before)

    # ---- pull ---------------------------------------------------------------------------------------
    def pull(self, vw: int, stage: int, wave: int) -> PullResult:
        """The global weights for the gate of `wave` (call only once gate_open(wave)).

        The tensors may be the shard's own arrays (no copy): they stay as returned until the next push,
        which folds; a caller that keeps them longer (a zero-copy send) must `lend` them.
        """
        keys = self._stage_keys(vw, stage)
        if not self.gate_open(wave):
            raise WspError("internal", f"pull of wave {wave} before its gate opened (c_global {self.c_global})")
        sid = (vw, stage)
        if self.pull_mode == "latest":
            result = PullResult(
                version=self.c_global,
                own_through=self.pushed[sid] - 1,
                tensors={k: self.weights[k] for k in keys},
            )
        else:
            target = gate_version(wave, self.staleness)
            result = PullResult(version=target, own_through=target - 1, tensors=self.weights_at(keys, target))
        self.pulled[sid] = max(self.pulled[sid], wave)  # the next push may fold W_{target}
        return result

    def read(self) -> PullResult:
        """Every key's newest complete weights: W_{c_global} (exact) or the running weights (latest)."""
        if self.pull_mode == "latest":
            return PullResult(self.c_global, -1, dict(self.weights))
        target = max(self.c_global, self.version)
        return PullResult(target, -1, self.weights_at(tuple(self.weights), target))

    def weights_at(self, keys: tuple[str, ...], target: int) -> dict[str, np.ndarray]:
        """W_target for `keys`: the held weights when target is the folded version, else a fresh sum."""
        if target < self.version:
            raise WspError(
                "stale", f"W_{target} was folded away (the shard holds W_{self.version}); a retried old pull?"
            )
        if target == self.version:
            return {k: self.weights[k] for k in keys}
        out = {}
        for key in keys:
            w = self.weights[key].copy()
            for t in range(self.version, target):
                part = self.wave_sums.get(t, WaveSums()).sums.get(key)
                if part is not None:
                    _add(w, part)
            out[key] = w
        return out

    # ---- folding and copy-on-write -------------------------------------------------------------------
    def _fold(self) -> None:
        """Fold S_t into W_t while wave t is complete and no future pull can ask for W_t any more."""
        if self.pull_mode != "exact" or self.num_vws is None:
            return
        needed = min(self.pulled.values(), default=0) - self.staleness
        while self.version < min(self.c_global, needed):
            sums = self.wave_sums.pop(self.version, WaveSums())
            incomplete = sums.incomplete(self.num_vws)
            if incomplete:
                self.wave_sums[self.version] = sums
                raise WspError(
                    "conflict",
                    f"wave {self.version} completed but keys {incomplete[:3]} lack some VW's update: "
                    "every VW must place the same keys on the same shard",
                )
            for key, part in sums.sums.items():
                _add(self._writable(key), part)
            self.version += 1

    def lend(self, key: str, is_done: Callable[[], bool]) -> None:
        """Mark weights[key] as read by an in-flight zero-copy send until is_done() turns true."""
        self._lent.setdefault(key, []).append(is_done)

    def _writable(self, key: str) -> np.ndarray:
        """weights[key], copied first if a send still reads it (copy-on-write, never a wait)."""
        readers = self._lent.pop(key, [])
        if not all(done() for done in readers):
            self.weights[key] = self.weights[key].copy()
        return self.weights[key]

    # ---- inspection and snapshots --------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {
            "c_global": self.c_global,
            "c_local": [self.c_local(v) for v in range(self.num_vws or 0)],
            "version": self.version,
            "num_vws": self.num_vws,
            "registered": len(self.stage_keys),
            "pending_waves": sorted(self.wave_sums),
            "pull_mode": self.pull_mode,
            "staleness": self.staleness,
        }

    def to_state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Everything needed to resume: msgpack-able metadata and the named float32 arrays."""
        arrays: dict[str, np.ndarray] = {f"w/{k}": v for k, v in self.weights.items()}
        sums_meta = {}
        for wave, ws in self.wave_sums.items():
            for key, arr in ws.sums.items():
                arrays[f"s/{wave}/{key}"] = _as_array(arr)
            for key, held in ws.held.items():
                for v, arr in held.items():
                    arrays[f"h/{wave}/{v}/{key}"] = _as_array(arr)
            sums_meta[str(wave)] = {"next_vw": ws.next_vw, "held": {k: sorted(h) for k, h in ws.held.items()}}
        meta = {
            "staleness": self.staleness,
            "pull_mode": self.pull_mode,
            "num_vws": self.num_vws,
            "num_stages": {str(v): n for v, n in self.num_stages.items()},
            "stages": [
                {"vw": v, "stage": s, "keys": list(keys), "pushed": self.pushed[(v, s)], "pulled": self.pulled[(v, s)]}
                for (v, s), keys in sorted(self.stage_keys.items())
            ],
            "version": self.version,
            "weights": list(self.weights),
            "wave_sums": sums_meta,
        }
        return meta, arrays

    @classmethod
    def from_state(cls, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> ShardState:
        state = cls(meta["staleness"], meta["pull_mode"])
        state.num_vws = meta["num_vws"]
        state.num_stages = {int(v): n for v, n in meta["num_stages"].items()}
        for entry in meta["stages"]:
            sid = (entry["vw"], entry["stage"])
            state.stage_keys[sid] = tuple(entry["keys"])
            state.pushed[sid] = entry["pushed"]
            state.pulled[sid] = entry["pulled"]
            for key in entry["keys"]:
                state.key_owner[(entry["vw"], key)] = entry["stage"]
        state.weights = {k: np.array(arrays[f"w/{k}"], dtype=np.float32) for k in meta["weights"]}
        state.version = meta["version"]
        for wave_s, wm in meta["wave_sums"].items():
            wave = int(wave_s)
            ws = WaveSums(next_vw=dict(wm["next_vw"]))
            ws.sums = {k: np.array(arrays[f"s/{wave}/{k}"]) for k in wm["next_vw"]}
            ws.owned = set(ws.sums)
            ws.held = {k: {v: np.array(arrays[f"h/{wave}/{v}/{k}"]) for v in vs} for k, vs in wm["held"].items()}
            state.wave_sums[wave] = ws
        return state

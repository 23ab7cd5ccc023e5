"""A shard's WSP state as a checkpoint holds it (msgpack-able metadata and named float32 arrays), read back,
and cut back to a wave for a resume (docs/recovery.md). The format: arrays "i/<key>" (W_0), "v/<t>/<key>"
(W_t), "s/<wave>/<key>" and "h/<wave>/<vw>/<key>" (wave sums and held pushes), "w/<key>", "b/<vw>/<key>" and
"l/<vw>/<wave>/<key>" (latest: running weights, buffers, pushes not folded), "o/<name>" (the PS optimizer)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from hetpipe.core.wsp.aggregation import DEFAULT_AGGREGATION, Aggregation, make_aggregation
from hetpipe.core.wsp.clock import first_pulled_wave, gate_version
from hetpipe.core.wsp.freezing import FreezeSchedule
from hetpipe.core.wsp.movement import MovementLog
from hetpipe.core.wsp.results import WspError
from hetpipe.core.wsp.sources import as_array
from hetpipe.core.wsp.wave_sums import WaveSums

if TYPE_CHECKING:
    from hetpipe.core.wsp.state import ShardState

__all__ = ["cut_at", "from_state", "to_state"]


def to_state(state: ShardState, detached: bool = False) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Everything needed to resume: msgpack-able metadata and the named float32 arrays. `detached`: copy
    the arrays later pushes change in place (latest weights, sums being accumulated), so that another
    thread may write them out while the shard goes on; the others are never changed once made. The
    metadata is always a copy: a writer thread encodes it later, and must see the state of this moment."""
    arrays = _weight_arrays(state, detached)
    sums_meta = _wave_sum_arrays(state, detached, arrays)
    optimizer_meta, opt_arrays = state.aggregation.to_state()  # a PS-side optimizer's, if the rule has one
    arrays.update({f"o/{k}": v for k, v in opt_arrays.items()})
    registrations, running = state.registrations, state.running
    meta = {
        "staleness": state.staleness,
        "pull_mode": state.pull_mode,
        "aggregation": state.aggregation.name,
        "optimizer": optimizer_meta,
        "num_vws": state.num_vws,
        "weights": list(state.membership.weights),
        "leaders": {str(v): lead for v, lead in state.membership.leaders.items()},
        "planned": {str(v): list(span) for v, span in state.membership.planned.items()},
        "num_waves": registrations.num_waves,
        "num_stages": {str(v): n for v, n in registrations.num_stages.items()},
        "epochs": {str(v): [list(span) for span in spans] for v, spans in state.membership.epochs.items()},
        "stages": [
            {
                "vw": v,
                "stage": s,
                "keys": list(keys),
                "pushed": state.pushed[(v, s)],
                "pulled": state.pulled[(v, s)],
            }
            for (v, s), keys in sorted(registrations.stage_keys.items())
        ],
        "kinds": dict(registrations.kinds),
        "versions": sorted(state.versions),
        "latest_buffers": {str(v): list(values) for v, values in running.buffers.items()},
        "latest_held": {
            str(v): {str(t): list(ts) for t, ts in waves.items()} for v, waves in running.held.items()
        },
        "wave_sums": sums_meta,
    }
    if state.movement is not None:  # [train] autofreeze
        meta["movement"] = state.movement.to_meta()
    return meta, arrays


def _weight_arrays(state: ShardState, detached: bool) -> dict[str, np.ndarray]:
    """W_0, the latest running weights, buffers and pushes not folded, and the versions W_t, t > 0."""
    arrays: dict[str, np.ndarray] = {f"i/{k}": v for k, v in state.registrations.initial.items()}
    if state.pull_mode == "latest":
        running = state.running
        arrays.update({f"w/{k}": v.copy() if detached else v for k, v in running.weights.items()})
        for vw, values in running.buffers.items():
            arrays.update({f"b/{vw}/{k}": v for k, v in values.items()})
        for vw, waves in running.held.items():
            for wave, tensors in waves.items():
                arrays.update({f"l/{vw}/{wave}/{k}": as_array(v) for k, v in tensors.items()})
    for t, weights in state.versions.items():
        if t:
            arrays.update({f"v/{t}/{k}": v for k, v in weights.items()})
    return arrays


def _wave_sum_arrays(state: ShardState, detached: bool, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Add each pending wave's sums and held pushes to `arrays`; returns what the metadata says of them."""
    sums_meta = {}
    for wave, ws in state.wave_sums.items():
        for key, arr in ws.sums.items():
            arrays[f"s/{wave}/{key}"] = arr.copy() if detached and key in ws.owned else as_array(arr)
        for key, held in ws.held.items():
            for v, arr in held.items():
                arrays[f"h/{wave}/{v}/{key}"] = as_array(arr)
        sums_meta[str(wave)] = {
            "merged": dict(ws.merged),
            "summed": sorted(ws.sums),
            "held": {k: sorted(h) for k, h in ws.held.items()},
        }
    return sums_meta


def from_state(
    cls: type[ShardState],
    meta: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    aggregation: Aggregation | None = None,
    cut: int | None = None,
    freeze: FreezeSchedule | None = None,
) -> ShardState:
    """The state `to_state` wrote; `aggregation` supplies the rule (and its optimizer settings) to resume,
    `freeze` the run's [train] freeze (which parameters pushes and pulls leave out; the config says).

    `cut` (exact pulls only): the state as it was when every stage had pushed exactly the waves < cut and
    nothing more, what `hetpipe train --resume` restarts the stages from (docs/recovery.md)."""
    aggregation = aggregation or make_aggregation(meta.get("aggregation", DEFAULT_AGGREGATION))
    if meta.get("optimizer"):
        prefix = "o/"
        aggregation.load_state(
            meta["optimizer"], {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
        )
    state = cls(meta["staleness"], meta["pull_mode"], aggregation, freeze)
    _restore(state, meta, arrays)
    if cut is not None:
        cut_at(state, cut)
    return state


def _restore(state: ShardState, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
    """Fill a fresh `state` (built with the snapshot's staleness, pull mode and rule) from a snapshot."""
    registrations = state.registrations
    state.membership.num_vws = meta["num_vws"]
    state.membership.weights = tuple(meta.get("weights", ()))
    state.membership.leaders = {int(v): lead for v, lead in meta.get("leaders", {}).items()}
    state.membership.plan({int(v): (span[0], span[1]) for v, span in meta.get("planned", {}).items()})
    registrations.num_waves = meta.get("num_waves")
    registrations.num_stages = {int(v): n for v, n in meta["num_stages"].items()}
    state.membership.epochs = {
        int(v): [list(s) for s in spans] for v, spans in meta.get("epochs", {}).items()
    }
    registrations.kinds = dict(meta["kinds"])
    if "movement" in meta:
        state.movement = MovementLog.from_meta(meta["movement"])
    for entry in meta["stages"]:
        sid = (entry["vw"], entry["stage"])
        registrations.stage_keys[sid] = tuple(entry["keys"])
        state.pushed[sid] = entry["pushed"]
        state.pulled[sid] = entry["pulled"]
        for key in entry["keys"]:
            registrations.key_owner[(entry["vw"], key)] = entry["stage"]

    def load(name: str) -> np.ndarray:
        return np.array(arrays[name], dtype=np.float32)

    kinds = registrations.kinds
    registrations.initial = {k: load(f"i/{k}") for k in kinds}
    state.exact.versions = {
        t: (registrations.initial if t == 0 else {k: load(f"v/{t}/{k}") for k in kinds})
        for t in meta["versions"]
    }
    if state.pull_mode == "latest":
        running = state.running
        running.weights = {k: load(f"w/{k}") for k in kinds}
        running.buffers = {
            int(v): {k: load(f"b/{v}/{k}") for k in keys} for v, keys in meta["latest_buffers"].items()
        }
        running.held = {
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


def cut_at(state: ShardState, cut: int) -> None:
    """Forget every push of a wave >= cut (exact pulls: nothing of them is folded into a version yet), so the
    state is that of every stage having pushed exactly the waves < cut."""
    if state.pull_mode != "exact":
        raise WspError("conflict", "only a shard with exact pulls can be cut back to a wave")
    need = max(0, gate_version(cut, state.staleness))
    if state.c_global != cut or need < min(state.versions):
        raise WspError(
            "stale",
            f"this checkpoint (c_global {state.c_global}, versions {sorted(state.versions)}) "
            f"cannot be cut back to wave {cut}",
        )
    if state.membership.ever_changed():
        raise WspError(
            "conflict",
            "virtual workers were evicted or rejoined in this run: a resume restarts "
            "every VW from one wave, and an evicted VW has no state at it",
        )
    exact = state.exact
    exact.wave_sums = {t: s for t, s in exact.wave_sums.items() if t < cut}
    for t in [t for t in exact.versions if t > cut]:
        del exact.versions[t]
    for sid in state.pushed:
        if state.live(sid[0]):
            state.pushed[sid] = min(state.pushed[sid], cut)
            state.pulled[sid] = first_pulled_wave(state.staleness) - 1

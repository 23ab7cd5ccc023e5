"""The checkpoint format of a stage's arithmetic (hetpipe train --resume): what StageCompute carries from one
action to the next, as plain metadata and named tensors, and back. The keys and metadata are fixed: snapshots
written before must still load. Running the forwards in flight again is StageCompute's."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hetpipe.compute.weight_versions import Weights

if TYPE_CHECKING:
    from hetpipe.compute.stage_compute import StageCompute

__all__ = ["SavedFlight", "restore_stage", "save_stage", "saved_flights"]


@dataclass(frozen=True)
class SavedFlight:
    """A forward in flight as saved: its input (on the stage's device) and weight version, and what its
    backward needs built again."""

    p: int
    inputs: Tensor
    weights: Weights | None
    output: bool  # its backward needs the forward's graph: run it again
    loss: bool  # and the loss on it (last stage)


# ---- saving -----------------------------------------------------------------------------------------------
@torch.no_grad()
def save_stage(compute: StageCompute) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Everything `compute`'s arithmetic carries from one action to the next, as plain metadata and named
    tensors: weights, buffers, ledgers, optimizer state, update baselines and own per-wave sums, pending
    gradients, and each forward in flight (its input and the weight version it ran on; the outputs are
    recomputed on load)."""
    compute.updates.settle()  # sums kept in host memory may still be on their way there
    tensors: dict[str, Tensor] = {}
    meta: dict[str, Any] = {
        "in_flight": [],
        "pending": list(compute.pending),
        "stash": None,
        "open_wave": compute.updates.open_wave,  # its updates are in the weights, not yet in sums
        "autofreeze": compute.freezing.saved(),  # the points decided so far (None: no adaptive freezing)
    }
    for key, t in {**compute.params, **compute.ledgers}.items():
        tensors[f"w/{key}"] = t.detach()
    for key, b in compute.buffers().items():
        tensors[f"b/{key}"] = b.detach()
    for key, t in compute.baseline.items():
        tensors[f"base/{key}"] = t
    for key, t in compute.acc.items():
        tensors[f"acc/{key}"] = t
    for name, table in (("sums", compute.sums), ("gsums", compute.gsums)):
        meta[name] = sorted(table)
        for wave, parts in table.items():
            tensors.update({f"{name}/{wave}/{key}": t for key, t in parts.items()})
    if compute.optimizer is not None:
        state = compute.optimizer.state_dict()["state"]
        meta["optimizer"] = {str(i): sorted(entry) for i, entry in state.items()}
        for i, entry in state.items():
            tensors.update({f"opt/{i}/{name}": t for name, t in entry.items()})
    _save_flights(compute, meta, tensors)
    return meta, tensors


def _save_flights(compute: StageCompute, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    """The weight versions in use (each once, numbered) and each forward in flight: its input and version."""
    stashes: dict[int, Weights] = {}
    for weights in [f.weights for f in compute.in_flight.values()] + [compute.versions.current]:
        if weights is not None:
            stashes.setdefault(id(weights), weights)
    order = list(stashes)
    for n, weights in enumerate(stashes.values()):
        tensors.update({f"stash/{n}/{key}": w.detach() for key, w in weights.items()})
    meta["stashes"] = len(order)
    current = compute.versions.current
    meta["stash"] = None if current is None else order.index(id(current))
    for p, flight in sorted(compute.in_flight.items()):
        tensors[f"x/{p}"] = flight.inputs.detach()
        meta["in_flight"].append(
            {
                "p": p,
                "weights": None if flight.weights is None else order.index(id(flight.weights)),
                "output": flight.output is not None,
                "loss": flight.loss is not None,
                "input_grad": flight.inputs.requires_grad,
            }
        )


# ---- loading ----------------------------------------------------------------------------------------------
@torch.no_grad()
def restore_stage(
    compute: StageCompute, meta: Mapping[str, Any], tensors: Mapping[str, Tensor], device: torch.device
) -> list[Weights]:
    """Restore what save_stage saved (tensors on any device; copies on `device`), all but the forwards in
    flight; returns the saved weight versions, by number (saved_flights reads them)."""
    for key, t in {**compute.params, **compute.ledgers}.items():
        t.copy_(tensors[f"w/{key}"])
    for key, old in compute.buffers().items():
        compute.buffer_slots.set(key, tensors[f"b/{key}"].to(old.device, old.dtype, copy=True))
    updates = compute.updates
    updates.baseline = {k: tensors[f"base/{k}"].to(device, copy=True) for k in updates.tracked}
    compute.acc = {
        k[len("acc/") :]: t.to(device, copy=True) for k, t in tensors.items() if k.startswith("acc/")
    }
    compute.pending = list(meta["pending"])
    compute.freezing.restore(meta.get("autofreeze"))
    updates.open_wave = meta.get("open_wave")
    updates.sums = {
        int(w): {k: tensors[f"sums/{w}/{k}"].to(device, copy=True) for k in updates.tracked}
        for w in meta["sums"]
    }
    updates.gsums = {
        int(w): {
            k[len(f"gsums/{w}/") :]: t.to(device, copy=True)
            for k, t in tensors.items()
            if k.startswith(f"gsums/{w}/")
        }
        for w in meta["gsums"]
    }
    if compute.optimizer is not None:
        state = {
            int(i): {name: tensors[f"opt/{i}/{name}"] for name in names}
            for i, names in meta.get("optimizer", {}).items()
        }
        compute.optimizer.load_state_dict({**compute.optimizer.state_dict(), "state": state})
    stashes = [
        {
            k: tensors[f"stash/{n}/{k}"].to(device, copy=True).requires_grad_(w.requires_grad)
            for k, w in compute.params.items()
        }
        for n in range(meta["stashes"])
    ]
    compute.versions.current = None if meta["stash"] is None else stashes[meta["stash"]]
    return stashes


def saved_flights(
    meta: Mapping[str, Any], tensors: Mapping[str, Tensor], stashes: list[Weights], device: torch.device
) -> Iterator[SavedFlight]:
    """The forwards in flight save_stage saved, in minibatch order, each input copied onto `device` as it is
    reached (needing its gradient where it did)."""
    for entry in meta["in_flight"]:
        p = entry["p"]
        inputs = tensors[f"x/{p}"].to(device, copy=True)
        if entry["input_grad"]:
            inputs.requires_grad_(True)
        weights = None if entry["weights"] is None else stashes[entry["weights"]]
        yield SavedFlight(p, inputs, weights, entry["output"], entry["loss"])

"""A stage optimizer's state by parameter name, to hand it from a VW that retires to one that starts at a
re-plan (docs/wsp.md#planned-spans), or to forget a frozen layer's (docs/wsp.md#freezing): torch.optim's and
hetpipe.compute.optim's state dicts index parameters by position, which differs between two stages that split
the model differently."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from torch import Tensor

__all__ = ["drop_state", "load_state_by_name", "state_by_name"]


def state_by_name(optimizer: Any, names: Sequence[str]) -> dict[str, dict[str, Tensor]]:
    """{parameter name: its state (momentum buffer, Adam moments and step)}, on the CPU; `names` in the
    optimizer's parameter order. None (no parameters): {}."""
    if optimizer is None:
        return {}
    state = optimizer.state_dict()["state"]
    return {
        names[int(i)]: {key: value.detach().cpu().clone() for key, value in entry.items()}
        for i, entry in state.items()
    }


def load_state_by_name(
    optimizer: Any, names: Sequence[str], states: Mapping[str, Mapping[str, Tensor]]
) -> None:
    """Set the state of each of the optimizer's parameters (`names`, in its order) that `states` has; the
    others start fresh."""
    if optimizer is None:
        return
    doc = optimizer.state_dict()
    doc["state"] = {i: dict(states[name]) for i, name in enumerate(names) if name in states}
    optimizer.load_state_dict(doc)


def drop_state(optimizer: Any, names: Sequence[str], dropped: Collection[str]) -> None:
    """Forget the state of the optimizer's parameters named in `dropped` (`names`: all of them, in its order):
    a frozen layer's momentum or Adam moments, which no step reads again."""
    if optimizer is None or not dropped:
        return
    doc = optimizer.state_dict()
    doc["state"] = {i: entry for i, entry in doc["state"].items() if names[int(i)] not in dropped}
    optimizer.load_state_dict(doc)

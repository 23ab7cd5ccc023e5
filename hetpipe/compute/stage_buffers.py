"""A stage's persistent buffers (BatchNorm running statistics and counters) by global name: finding them,
reading them and replacing them out of place."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from torch import Tensor, nn

__all__ = ["BufferSlots", "buffer_slots", "set_buffer", "stage_buffers"]


def stage_buffers(module: nn.Module) -> dict[str, Tensor]:
    """The persistent buffers of a stage (BatchNorm running statistics and counters), by global name."""
    params = dict(module.named_parameters())
    return {k: t for k, t in module.state_dict(keep_vars=True).items() if k not in params}


def _slot(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module that owns the buffer `name` (a global name) and its attribute there."""
    owner, _, leaf = name.rpartition(".")
    return (module.get_submodule(owner) if owner else module), leaf


def set_buffer(module: nn.Module, name: str, value: Tensor) -> None:
    """Replace a buffer by another tensor (out of place: graphs that saved the old one keep it)."""
    owner, leaf = _slot(module, name)
    owner._buffers[leaf] = value


def buffer_slots(module: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Where each of stage_buffers(module) lives (owning module, attribute), found once: reading a buffer
    through its slot is a dict lookup, not a walk of the module tree (state_dict: ~0.6 ms for resnet50, per
    call)."""
    return {name: _slot(module, name) for name in stage_buffers(module)}


class BufferSlots:
    """A stage's buffers read and replaced through their slots (buffer_slots, found once), out of place."""

    def __init__(self, module: nn.Module) -> None:
        self._slots = buffer_slots(module)

    def names(self) -> list[str]:
        return list(self._slots)

    def now(self) -> dict[str, Tensor]:
        """The buffers now (stage_buffers(module), through their slots)."""
        return {key: owner._buffers[leaf] for key, (owner, leaf) in self._slots.items()}

    def set(self, key: str, value: Tensor) -> None:
        """set_buffer(module, key, value), through its slot."""
        owner, leaf = self._slots[key]
        owner._buffers[leaf] = value

    def replace(self, values: Mapping[str, Tensor]) -> None:
        """Every buffer replaced by its synced value (float32 from the PS: integer buffers rounded back)."""
        for key, old in self.now().items():
            new = values[key].to(old.device)
            new = new.round().to(old.dtype) if not old.is_floating_point() else new.to(old.dtype, copy=True)
            self.set(key, new)

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Run a recomputed forward without letting it move the running statistics a second time."""
        kept = {k: b.detach().clone() for k, b in self.now().items()}
        try:
            yield
        finally:
            for key, value in kept.items():
                self.set(key, value)

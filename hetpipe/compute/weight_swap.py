"""Run a module on other tensors in place of its parameters (a stashed weight version), cheaply.

torch.func.functional_call does this generically: every call walks the module tree, unties shared
parameters and swaps each tensor in and out through accessor objects, about 1 ms of host time per forward
of an 8-block GPT (a CUDA stage's host time is what a plain loop hides behind the device's). A stage swaps
the same parameter names on every forward, so the slots each name fills are found once, here, and a
forward only assigns into them. A parameter shared by several modules (tied weights) fills every slot it
occupies, as functional_call's tie handling does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from torch import Tensor, nn

__all__ = ["WeightSwap"]


class WeightSwap:
    """The parameter slots (owning module, attribute) of each of `module`'s parameter names."""

    def __init__(self, module: nn.Module) -> None:
        by_param: dict[int, list[tuple[nn.Module, str]]] = {}
        for owner in module.modules():
            for attr, param in owner._parameters.items():
                if param is not None:
                    by_param.setdefault(id(param), []).append((owner, attr))
        self.slots = {name: by_param[id(param)] for name, param in module.named_parameters()}

    @contextlib.contextmanager
    def using(self, weights: Mapping[str, Tensor]) -> Iterator[None]:
        """Within the block the module computes with `weights` (by parameter name; names it lacks keep their
        parameter); the parameters are back in place after it, also when the block raises."""
        saved: list[tuple[nn.Module, str, Tensor | None]] = []
        try:
            for name, tensor in weights.items():
                for owner, attr in self.slots.get(name, ()):
                    saved.append((owner, attr, owner._parameters[attr]))
                    owner._parameters[attr] = tensor
            yield
        finally:
            for owner, attr, param in reversed(saved):
                owner._parameters[attr] = param

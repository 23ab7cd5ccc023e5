"""The training loss by name (`[train] loss`): cross_entropy, mse, nll, or a user's "package.module:function".
The runtime's stages and the reference both take theirs from here; evaluation keeps scoring cross-entropy."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor

from hetpipe.core.config.schema import BUILTIN_LOSSES
from hetpipe.core.imports import import_target

__all__ = ["LossFn", "cross_entropy", "loss_function", "mse", "nll"]

LossFn = Callable[[Tensor, Tensor], Tensor]


def cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy of (B, C) logits with (B,) targets, or (B, T, V) with (B, T): every built-in model's
    own (ModelSpec.loss)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def nll(output: Tensor, target: Tensor) -> Tensor:
    """Mean negative log-likelihood; the output must be log-probabilities (a model ending in log_softmax)."""
    return F.nll_loss(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def mse(output: Tensor, target: Tensor) -> Tensor:
    """Mean squared error; class-index targets are compared as one-hot vectors of the output's width."""
    if not target.is_floating_point() and output.dim() == target.dim() + 1:
        target = F.one_hot(target, output.shape[-1]).to(output.dtype)
    return F.mse_loss(output, target.to(output.dtype))


_BUILTIN: dict[str, LossFn] = {"cross_entropy": cross_entropy, "mse": mse, "nll": nll}
assert tuple(_BUILTIN) == BUILTIN_LOSSES


def loss_function(name: str) -> LossFn:
    """The loss named `name` (validated at config load: hetpipe.core.config.sections)."""
    if name in _BUILTIN:
        return _BUILTIN[name]
    return import_target(name, f'train.loss "{name}"')

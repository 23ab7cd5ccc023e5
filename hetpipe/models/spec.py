"""ModelSpec: a model as an ordered list of layer factories, each layer seeded from (seed, index)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from hetpipe.compute.losses import cross_entropy
from hetpipe.core.errors import UsageError

__all__ = ["ModelSpec", "Task", "layer_seed"]

Task = Literal["classification", "language"]


def layer_seed(seed: int, index: int) -> int:
    """The torch seed for layer `index` of a model built with `seed`: independent of any split."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0] >> 1)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run the block with the CPU RNG seeded, restoring the caller's RNG state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class _SkipMetaInit(TorchFunctionMode):
    """Skip weight initialisers on meta tensors: they have no values, and in torch 2.13 a meta
    `normal_` imports torch._dynamo (about 1.2 s per process) just to draw nothing."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" or func is Tensor.normal_:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@dataclass(frozen=True)
class ModelSpec:
    """An ordered list of layers; a stage runs layers [start, stop) and each layer maps one tensor to one.

    `factories[i]()` builds layer i on the CPU with torch's default RNG; `build_layer` seeds it from
    (seed, i), so layer i has the same weights whether built alone, in a stage, or in the whole model.
    """

    name: str
    layer_names: tuple[str, ...]
    factories: tuple[Callable[[], nn.Module], ...]
    input_shape: tuple[int, ...]  # one sample, without the batch dimension
    input_dtype: torch.dtype
    task: Task
    num_classes: int  # classes, or vocabulary size for a language model
    seed: int = 0
    options: tuple[tuple[str, Any], ...] = field(default=())  # what get_model was given, for logs

    def __post_init__(self) -> None:
        if len(self.layer_names) != len(self.factories):
            raise UsageError(
                f"model {self.name}: {len(self.layer_names)} layer names for "
                f"{len(self.factories)} layers; give one name per layer"
            )
        if not self.factories:
            raise UsageError(f"model {self.name} has no layers; a model needs at least one layer")

    @property
    def num_layers(self) -> int:
        return len(self.factories)

    def build_layer(self, index: int, device: str | torch.device | None = None) -> nn.Module:
        """Layer `index` with its deterministic initial weights; device="meta" builds shapes only (cheap)."""
        if not 0 <= index < self.num_layers:
            raise UsageError(
                f"model {self.name} has layers 0..{self.num_layers - 1}; layer {index} does not exist"
            )
        if device is not None and torch.device(device).type == "meta":
            with torch.device("meta"), _SkipMetaInit():
                return self.factories[index]()
        with _seeded(layer_seed(self.seed, index)):
            layer = self.factories[index]()
        return layer if device is None else layer.to(device)

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Mean cross-entropy; (B, C) logits with (B,) targets, or (B, T, V) with (B, T) for language
        (hetpipe.compute.losses.cross_entropy, train.loss's default)."""
        return cross_entropy(output, target)

    def example_input(self, batch_size: int, seed: int = 0) -> Tensor:
        """A random input batch of the right shape and dtype (for shape checks and profiling)."""
        gen = torch.Generator().manual_seed(seed)
        shape = (batch_size, *self.input_shape)
        if self.input_dtype.is_floating_point:
            return torch.randn(shape, generator=gen, dtype=self.input_dtype)
        return torch.randint(0, self.num_classes, shape, generator=gen, dtype=self.input_dtype)

"""FLOPs of one training step of a model (forward with the loss, and backward), counted by torch's
FlopCounterMode."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from hetpipe.models.spec import ModelSpec

__all__ = ["training_flops"]


def training_flops(spec: ModelSpec, batch_size: int) -> int:
    """Floating-point operations of forward + loss + backward of the whole model on one minibatch.

    Counted on meta tensors (shapes only, nothing computed) for the ops torch's counter knows (matmuls,
    convolutions, attention): the arithmetic that dominates a step; element-wise ops are not counted.
    """
    layers = [spec.build_layer(i, "meta") for i in range(spec.num_layers)]
    x = spec.example_input(batch_size).to("meta")
    with FlopCounterMode(display=False) as counter:
        for layer in layers:
            x = layer(x)
        target_shape = x.shape[:-1]
        target = torch.zeros(target_shape, dtype=torch.long, device="meta")
        spec.loss(x, target).backward()
    return int(counter.get_total_flops())

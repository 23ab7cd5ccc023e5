"""Evaluate a trained model on held-out data, batched on a training device: accuracy for classifiers,
loss and perplexity for text."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from hetpipe.compute.data import DatasetSplit, unigram_loss
from hetpipe.models import ModelSpec, build_stage

__all__ = ["evaluate", "load_ps_state"]


def load_ps_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor], name: str) -> None:
    """Load the PS's tensors (all float32: weights and buffers alike) into `model`, each cast back to the
    dtype of the model's own tensor (integer buffers such as BatchNorm's num_batches_tracked rounded first).
    ValueError names the keys that do not fit; integer buffers the PS does not hold keep their value."""
    wanted = model.state_dict()
    missing = [k for k in wanted if k not in state and wanted[k].is_floating_point()]
    unexpected = [k for k in state if k not in wanted]
    if missing or unexpected:
        raise ValueError(
            f"state does not fit model {name}: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    model.load_state_dict(
        {
            k: (v.round() if not wanted[k].is_floating_point() else v).to(wanted[k].dtype)
            for k, v in state.items()
        },
        strict=False,
    )


@torch.no_grad()
def evaluate(
    spec: ModelSpec,
    state: Mapping[str, torch.Tensor],
    data: DatasetSplit,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    max_samples: int = 0,
) -> dict[str, Any]:
    """Load `state` (the PS's tensors) into the whole model on `device` and score it on the first
    `max_samples` held-out samples (0: all of them)."""
    model = build_stage(spec, 0, spec.num_layers, device)
    load_ps_state(model, state, spec.name)
    model.eval()
    x, y = data.test.x, data.test.y
    count_all = len(y) if not max_samples else min(len(y), max_samples)
    total_loss, correct, count = 0.0, 0, 0
    for i in range(0, count_all, batch_size):
        stop = min(i + batch_size, count_all)
        out = model(x[i:stop].to(device))
        target = y[i:stop].to(device)
        total_loss += float(spec.loss(out, target)) * target.numel()
        count += target.numel()
        if spec.task == "classification":
            correct += int((out.argmax(-1) == target).sum())
    mean = total_loss / max(count, 1)
    scored = {"eval_samples": count_all}
    if spec.task == "classification":
        return {"test_accuracy": round(correct / max(count, 1), 4), "test_loss": round(mean, 4), **scored}
    train_ids = data.train.tokens if data.train.tokens is not None else data.train.y.reshape(-1)
    baseline = unigram_loss(train_ids, y.reshape(-1), data.vocab_size or spec.num_classes)
    return {
        "val_loss": round(mean, 4),
        "val_perplexity": round(math.exp(mean), 3),
        "unigram_loss": round(baseline, 4),
        **scored,
    }

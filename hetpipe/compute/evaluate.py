"""Evaluate a trained model on held-out data: accuracy for classifiers, loss and perplexity for text."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from hetpipe.compute.data import DatasetSplit, unigram_loss
from hetpipe.models import ModelSpec, build_stage

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(spec: ModelSpec, state: Mapping[str, torch.Tensor], data: DatasetSplit, batch_size: int = 256) -> dict[str, Any]:
    """Load `state` (the PS's float tensors) into the whole model and score it on data.test."""
    model = build_stage(spec, 0, spec.num_layers)
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    float_missing = [k for k in missing if model.state_dict()[k].is_floating_point()]
    if float_missing or unexpected:
        raise ValueError(f"state does not fit model {spec.name}: missing {float_missing[:3]}, unexpected {unexpected[:3]}")
    model.eval()
    x, y = data.test.x, data.test.y
    total_loss, correct, count = 0.0, 0, 0
    for i in range(0, len(y), batch_size):
        out = model(x[i : i + batch_size])
        target = y[i : i + batch_size]
        total_loss += float(spec.loss(out, target)) * target.numel()
        count += target.numel()
        if spec.task == "classification":
            correct += int((out.argmax(-1) == target).sum())
    mean = total_loss / max(count, 1)
    if spec.task == "classification":
        return {"test_accuracy": round(correct / max(count, 1), 4), "test_loss": round(mean, 4)}
    train_ids = data.train.tokens if data.train.tokens is not None else data.train.y.reshape(-1)
    baseline = unigram_loss(train_ids, y.reshape(-1), data.vocab_size or spec.num_classes)
    return {"val_loss": round(mean, 4), "val_perplexity": round(math.exp(mean), 3), "unigram_loss": round(baseline, 4)}

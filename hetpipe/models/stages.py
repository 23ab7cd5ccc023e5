"""Stages of a ModelSpec: build layers [start, stop), name their tensors globally, balance a split."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hetpipe.core.errors import UsageError
from hetpipe.models.spec import ModelSpec

__all__ = ["build_stage", "named_stage_tensors", "stage_state_keys", "param_counts", "even_split"]


def _check_range(spec: ModelSpec, start: int, stop: int) -> None:
    if not 0 <= start < stop <= spec.num_layers:
        raise UsageError(
            f"stage layers [{start}, {stop}) do not fit model {spec.name} with "
            f"{spec.num_layers} layers: need 0 <= start < stop <= {spec.num_layers}"
        )


def build_stage(
    spec: ModelSpec, start: int, stop: int, device: str | torch.device | None = None
) -> nn.Sequential:
    """Layers [start, stop) as one nn.Sequential whose children are named by their global index.

    Because child i is named str(i), `stage.state_dict()` keys are already global ("3.weight",
    "7.attn.qkv.bias") and equal across every split of the model.
    """
    _check_range(spec, start, stop)
    stage = nn.Sequential()
    for i in range(start, stop):
        stage.add_module(str(i), spec.build_layer(i, device))
    return stage


def named_stage_tensors(stage: nn.Module, *, buffers: bool = True) -> dict[str, Tensor]:
    """Parameters (and, by default, persistent buffers such as BatchNorm running stats) keyed by
    global name, in state_dict order, so concatenating the stages of any split gives the same list."""
    if not buffers:
        return dict(stage.named_parameters())
    return dict(stage.state_dict(keep_vars=True))


def stage_state_keys(spec: ModelSpec, start: int, stop: int, *, buffers: bool = True) -> list[str]:
    """The global tensor names of layers [start, stop), found without allocating weights (meta device)."""
    return list(named_stage_tensors(build_stage(spec, start, stop, "meta"), buffers=buffers))


def param_counts(spec: ModelSpec) -> list[int]:
    """Parameters per layer, built on the meta device so even ResNet-152 counts in milliseconds."""
    return [sum(p.numel() for p in spec.build_layer(i, "meta").parameters()) for i in range(spec.num_layers)]


def even_split(counts: list[int], num_stages: int) -> list[int]:
    """Layers per stage: contiguous, each >= 1, minimising the largest stage's count.

    Among splits with that smallest maximum it picks the one with the least sum of squared stage
    counts (the most even), and among those the one whose earlier stages end earliest.
    """
    n = len(counts)
    if not 1 <= num_stages <= n:
        raise UsageError(
            f"cannot split {n} layers into {num_stages} stages: each stage needs at "
            f"least one layer; use between 1 and {n} stages"
        )
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    inf = float("inf")

    # Pass 1: the smallest achievable maximum stage count (DP over stages x prefix length).
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            best[k][i] = min(max(best[k - 1][s], prefix[i] - prefix[s]) for s in range(k - 1, i))
    bottleneck = best[num_stages][n]

    # Pass 2: among splits whose stages all stay <= bottleneck, the least sum of squares.
    cost = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    cost[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for s in range(k - 1, i):
                size = prefix[i] - prefix[s]
                if size <= bottleneck and cost[k - 1][s] + size * size < cost[k][i]:
                    cost[k][i], cut[k][i] = cost[k - 1][s] + size * size, s
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]

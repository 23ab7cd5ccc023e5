"""Multi-tensor helpers (torch._foreach_*) a stage's arithmetic shares: one kernel launch for many tensors."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["add_into", "float_copies"]


def float_copies(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """float32 copies of `tensors`, by key: the float32 ones copied in one multi-tensor op (x * 1.0: bit for
    bit x, -0.0 and NaN too, unless torch.set_flush_denormal is on; _foreach_clone is too new to rely on), the
    others converted."""
    same = [k for k, t in tensors.items() if t.dtype == torch.float32]
    copied = dict(zip(same, torch._foreach_mul([tensors[k] for k in same], 1.0), strict=True)) if same else {}
    return {k: copied[k] if k in copied else t.float() for k, t in tensors.items()}


def add_into(totals: dict[str, Tensor], new: list[tuple[str, Tensor]]) -> None:
    """totals[key] += tensor for the keys totals holds, in one multi-tensor add (not a kernel per tensor); the
    others are taken as they are (the caller owns them)."""
    held = [(totals[k], t) for k, t in new if k in totals]
    if held:
        torch._foreach_add_([total for total, _ in held], [t for _, t in held])
    totals.update({k: t for k, t in new if k not in totals})

"""What a shard's WSP state answers a request with: a push's or a pull's result, or a refusal (WspError,
carrying the wire error code the server replies with)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PullResult", "PushResult", "WspError"]


class WspError(Exception):
    """A request the WSP rules refuse; `code` is the wire error code the server replies with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class PushResult:
    applied: bool  # False: the same (vw, stage, wave) was applied before
    c_global: int
    clock_advanced: bool


@dataclass(frozen=True)
class PullResult:
    version: int  # t of the W_t returned (exact); c_global at the time (latest)
    own_through: int  # the requester's own waves <= this are contained in the tensors
    tensors: dict[str, np.ndarray]
    # [train] autofreeze: this shard's movement records the puller has not had (hetpipe.core.wsp.movement)
    movement: list | None = None

"""What a plan is: virtual workers, each an ordered list of GPUs with a contiguous layer split and Nm.

Data only: the partitioner and policies produce these, the simulator and `hetpipe train --plan` use them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

from hetpipe.core.pipeline.schedule import DEFAULT_SCHEDULE

__all__ = ["Plan", "StagePlan", "VwPlan"]


@dataclass(frozen=True)
class StagePlan:
    gpu: str  # "node:index", as in the config
    gpu_type: str
    start: int  # first layer (inclusive)
    stop: int  # last layer (exclusive)
    forward_s: float  # compute of one minibatch on this GPU
    backward_s: float
    recv_s: float  # receiving the input activation (forward) and the output gradient (backward)
    send_s: float  # sending the output activation (forward) and the input gradient (backward)
    memory_bytes: int  # peak by the memory model of docs/memory.md
    memory_limit_bytes: int
    # This stage's weights (what its PUSH and pull move). 0 on every stage means "not known": the
    # simulator then splits VwPlan.param_bytes over the stages by layer count.
    param_bytes: int = 0

    @property
    def time_s(self) -> float:
        """The stage's time per minibatch: compute plus its boundary transfers."""
        return self.forward_s + self.backward_s + self.recv_s + self.send_s


@dataclass(frozen=True)
class VwPlan:
    stages: tuple[StagePlan, ...]
    nm: int  # this VW's minibatches per wave (VWs may differ: docs/wsp.md#per-vw-work)
    param_bytes: int  # the whole model's weights (what a wave pushes and pulls)
    batch_size: int = 0  # this VW's minibatch size; 0: the plan's batch_size

    def batch(self, plan_batch: int) -> int:
        """This VW's minibatch size in a plan whose batch_size is `plan_batch`."""
        return self.batch_size or plan_batch

    @property
    def gpus(self) -> tuple[str, ...]:
        return tuple(s.gpu for s in self.stages)

    @property
    def split(self) -> tuple[int, ...]:
        """Layers per stage."""
        return tuple(s.stop - s.start for s in self.stages)

    @property
    def bottleneck_s(self) -> float:
        return max(s.time_s for s in self.stages)

    def times_scaled(self, factor: float) -> VwPlan:
        """The VW with every stage's compute and transfer times x `factor` (another minibatch size, by
        proportion: ModelProfile.at_batch)."""
        stages = tuple(
            replace(
                s,
                forward_s=s.forward_s * factor,
                backward_s=s.backward_s * factor,
                recv_s=s.recv_s * factor,
                send_s=s.send_s * factor,
            )
            for s in self.stages
        )
        return replace(self, stages=stages)


@dataclass(frozen=True)
class Plan:
    policy: str  # "np" | "ed" | "hd" | "explicit"
    model: str
    batch_size: int
    staleness: int  # D
    vws: tuple[VwPlan, ...]
    placement: str = "balanced"
    schedule: str = DEFAULT_SCHEDULE  # the pipeline schedule every VW runs (hetpipe.core.pipeline.schedule)
    recompute: bool = False
    aggregation: str = (
        ""  # the PS's aggregation it was planned under ("": a plan file from before, the config's)
    )
    mitigation: str = ""  # the staleness mitigation it was planned under ("": the config's)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan of `to_json`'s text (a plan file's re-plans are read by hetpipe.app.plan_replan)."""
        data = json.loads(text)
        data.pop("replans", None)
        vws = tuple(
            VwPlan(
                stages=tuple(StagePlan(**s) for s in vw["stages"]),
                nm=vw["nm"],
                param_bytes=vw["param_bytes"],
                batch_size=vw.get("batch_size", 0),
            )
            for vw in data.pop("vws")
        )
        return cls(vws=vws, **data)

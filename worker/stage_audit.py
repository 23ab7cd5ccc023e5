"""A stage's `--audit` ledgers: every update tagged with the minibatches it covers, and the WSP guarantees
checked against the weights each forward is about to run on (hetpipe.core.wsp.audit)."""

from __future__ import annotations

import torch

from hetpipe.compute.build import audit_shape
from hetpipe.core.pipeline.schedule import Schedule, own_through_required
from hetpipe.core.wsp.audit import AuditError, audit_key, ledger_violations
from hetpipe.worker.jobs import StageJob

__all__ = ["StageAudit"]


class StageAudit:
    """The ledgers (one per layer of the stage, a row per VW and a column per minibatch; none unless the job
    audits), which the stage's compute carries as weights, and the checks made of them."""

    def __init__(self, job: StageJob, schedule: Schedule, device: torch.device) -> None:
        self.job, self.schedule = job, schedule
        self.ledgers: dict[str, torch.Tensor] = {}
        if job.audit:
            shape = audit_shape(job.config.train.waves, job.nms)
            start, stop = job.layers
            self.ledgers = {
                audit_key(layer): torch.zeros(shape, device=device) for layer in range(start, stop)
            }
        self.checks = 0  # ledgers checked, reported when the stage is done

    @torch.no_grad()
    def tag_updates(self, minibatches: list[int]) -> None:
        """The compute's on_update: this VW's slot of each minibatch the update covers, one more update."""
        for ledger in self.ledgers.values():
            for p in minibatches:
                ledger[self.job.vw, p] += 1.0

    def check(self, p: int, gaps: list[list[int]]) -> None:
        """Before the forward of minibatch p: every ledger holds exactly the updates guarantees L and G say
        (`gaps`: from the last pull, the waves some VW contributed nothing to); else an AuditError."""
        wsp = self.job.config.wsp
        own = own_through_required(self.schedule.guarantee, p, wsp.nm)
        for key, ledger in self.ledgers.items():
            problems = ledger_violations(
                ledger.cpu().numpy(),
                self.job.vw,
                p,
                self.job.nms,
                wsp.staleness,
                own,
                gaps,
                own_from=self.job.start_wave * wsp.nm,
            )
            if problems:
                raise AuditError(
                    f"vw {self.job.vw} stage {self.job.stage}, forward of minibatch {p}, {key}: "
                    + "; ".join(problems)
                )
            self.checks += 1

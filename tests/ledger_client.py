"""A simulated stage for PS tests and demos: each (vw, stage, wave) adds exactly 1.0 to its own slot.

Every stage owns keys whose arrays have one slot per (vw, wave); a push of wave c by VW i is a one-hot
at [i, c]. So any pulled snapshot says exactly which updates it contains, and the WSP guarantees can
be checked from the numbers alone (docs/wsp.md).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np

from hetpipe.core.protocol.placement import balanced_placement
from hetpipe.core.wsp.clock import first_pulled_wave, gate_version
from hetpipe.worker.ps_client import PSClient

__all__ = ["LedgerSpec", "ledger_keys", "ledger_stage", "check_pull"]


@dataclass(frozen=True)
class LedgerSpec:
    run: str
    num_vws: int
    num_stages: int
    num_waves: int
    staleness: int
    pull_mode: str = "exact"
    keys_per_stage: int = 2  # more than one, so a stage's keys spread over shards


def ledger_keys(spec: LedgerSpec, stage: int) -> list[str]:
    return [f"stage{stage}/slot{k}" for k in range(spec.keys_per_stage)]


def check_pull(spec: LedgerSpec, vw: int, wave: int, own_through: int, values: np.ndarray) -> None:
    """Raise AssertionError unless `values` (one key) holds what a pull for `wave` must hold."""
    need = gate_version(wave, spec.staleness)  # W_need: every VW's waves < need
    if spec.pull_mode == "exact":
        expected = np.zeros((spec.num_vws, spec.num_waves), np.float32)
        expected[:, :need] = 1.0
        if not np.array_equal(values, expected):
            raise AssertionError(
                f"vw {vw} pull of wave {wave}: got\n{values}\nexpected exactly W_{need}\n{expected}"
            )
    else:
        if not (values[:, :need] == 1.0).all():
            raise AssertionError(f"vw {vw} pull of wave {wave} lacks updates of waves < {need}:\n{values}")
        if not (values[vw, : own_through + 1] == 1.0).all() or not np.isin(values, (0.0, 1.0)).all():
            raise AssertionError(
                f"vw {vw} pull of wave {wave}: bad own updates or a slot counted twice:\n{values}"
            )


def ledger_stage(
    endpoints: list[str], spec: LedgerSpec, vw: int, stage: int, pause_s: float, seed: int = 0
) -> dict[str, int]:
    """Run one stage: WAIT c before PUSH c-1 (as the pipelined schedule does), checking every pull."""
    all_keys = [k for s in range(spec.num_stages) for k in ledger_keys(spec, s)]
    shape = (spec.num_vws, spec.num_waves)
    placement = balanced_placement({k: int(np.prod(shape)) * 4 for k in all_keys}, len(endpoints))
    rng = random.Random(seed * 1000 + vw * 10 + stage)
    keys = ledger_keys(spec, stage)
    counts = {"pulls": 0, "pushes": 0, "duplicates": 0}
    with PSClient(
        endpoints, spec.run, vw, stage, spec.num_vws, spec.num_stages, placement, retry_s=1.0
    ) as ps:
        ps.register({k: np.zeros(shape, np.float32) for k in keys})

        def push(wave: int) -> None:
            delta = np.zeros(shape, np.float32)
            delta[vw, wave] = 1.0
            ps.push(wave, {k: delta for k in keys})
            counts["pushes"] += 1
            if rng.random() < 0.2:  # a retried push must count once
                ps.push(wave, {k: delta for k in keys})
                counts["duplicates"] += 1

        for wave in range(spec.num_waves):
            if wave >= first_pulled_wave(spec.staleness):
                pulled = ps.pull(wave)
                for key in keys:
                    check_pull(spec, vw, wave, pulled.own_through, pulled.tensors[key])
                counts["pulls"] += 1
            if wave >= 1:
                push(wave - 1)
            time.sleep(pause_s * rng.uniform(0.5, 1.5))
        push(spec.num_waves - 1)
        assert ps.wait_durable(60), "the shards never put this stage's last pushes in a checkpoint"
    return counts

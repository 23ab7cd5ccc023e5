"""Bounded memory over a long run (issue 13): 2,000 waves with one VW (no pulls), and with two VWs at D >=
waves (no pull ever due), keep the PS shard's and every stage's resident memory flat; the measured slope is
reported.

Without a pull to hold it back a stage keeps one push in flight at most (before, a PS slower than the stage
let pushes pile up in the stage's agent: +59 KiB/wave at 2,000 waves, +19 KiB/wave over 20,000); a stage's
trace grows by its events until it keeps only the first and newest
(hetpipe.core.runs.metrics.MAX_TRACE_EVENTS), about 2 KiB/wave here. With D >= waves the PS holds a wave sum
for every wave one VW is ahead of the other (WSP's bound: the early pushes held for the VW behind,
docs/memory.md#ps-side-state), so the VWs run on emulated GPUs of one speed, and the shard's slope is taken
after its allowance for the lead: one model's bytes per wave of the most waves one VW was ahead so far (on a
loaded machine the lead can grow by tens of waves over a run; a leak of one copy per wave would still show
whole)."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from hetpipe.app.train import TrainOptions, train
from hetpipe.core.config.files import load_config

from conftest import write_config

pytestmark = pytest.mark.slow

WAVES = 2000
HIDDEN = (256,)  # 784*256 + 256*10 weights: about 0.8 MB, so a leak of one copy per wave is 1.6 GB by the end


def rss_bytes(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) * 1024 if match else None


def waves_done(metrics: Path, vws: int) -> list[int]:
    """Waves each VW's first stage has pushed so far, from the run's metrics.jsonl."""
    try:
        text = metrics.read_text()
    except OSError:
        return [0] * vws
    pushes = [line for line in text.splitlines() if '"event": "push"' in line and '"stage": 0,' in line]
    return [sum(1 for line in pushes if f'"vw": {v},' in line) for v in range(vws)]


class Sampler(threading.Thread):
    """Every process's resident memory, beside VW 0's waves done and the most waves one VW was ahead so far,
    sampled until stopped."""

    def __init__(self, run_dir: Path, vws: int) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.vws, self.samples, self.done = run_dir, vws, {}, threading.Event()
        self.max_lead = 0

    def run(self) -> None:
        pids: dict[str, int] = {}
        while not self.done.wait(0.2):
            if not pids:
                try:
                    pids = json.loads((self.run_dir / "pids.json").read_text())
                except (OSError, ValueError):
                    continue
            done = waves_done(self.run_dir / "metrics.jsonl", self.vws)
            self.max_lead = max(self.max_lead, max(done) - min(done))
            for name, pid in pids.items():
                rss = rss_bytes(pid)
                if rss is not None:
                    self.samples.setdefault(name, []).append((done[0], rss, self.max_lead))


def slopes(samples: dict[str, list[tuple[int, int, int]]], allowance: dict[str, int]) -> dict[str, float]:
    """Bytes per wave of each process over the run's second half (after warm-up), by least squares, after
    taking off `allowance[name]` bytes per wave of the most waves one VW was ahead so far."""
    out = {}
    for name, points in samples.items():
        late = np.array(
            [(w, r - allowance.get(name, 0) * lead) for w, r, lead in points if WAVES // 2 <= w < WAVES],
            dtype=float,
        )
        assert len(late) >= 5, (
            f"{name}: only {len(late)} samples in the second half; the run was too quick to watch"
        )
        out[name] = float(np.polyfit(late[:, 0], late[:, 1], 1)[0])
    return out


@pytest.mark.parametrize(("vws", "staleness"), [(1, 0), (2, WAVES)], ids=["one-vw", "two-vws-D-over-waves"])
def test_long_run_keeps_ps_and_stage_memory_flat(tmp_path: Path, vws: int, staleness: int, record_property):
    # emulated GPUs of one speed: compute is stretched 3x by sleeping, so two VWs keep pace on a busy machine
    # (with D >= waves nothing else couples them, and the PS rightly holds every wave one VW is ahead)
    path = write_config(
        tmp_path,
        vws=[[f"n0:{v}"] for v in range(vws)],
        nm=1,
        staleness=staleness,
        waves=WAVES,
        hidden=HIDDEN,
        batch_size=4,
        emulation=True,
        time_scale=3.0,
    )
    config = load_config(path)
    run_dir = tmp_path / "run"
    sampler = Sampler(run_dir, vws)
    sampler.start()
    try:
        summary = train(config, TrainOptions(run_dir=run_dir, progress=False))
    finally:
        sampler.done.set()
        sampler.join()
    assert summary["waves"] == WAVES
    weight_bytes = 4 * (784 * HIDDEN[0] + HIDDEN[0] + HIDDEN[0] * 10 + 10)
    found = slopes(sampler.samples, {"ps-shard-0": weight_bytes})  # an early push held per wave of lead
    assert set(found) == {"ps-shard-0", *(f"vw{v}-s0" for v in range(vws))}
    report = ", ".join(f"{name} {slope / 1024:+.2f} KiB/wave" for name, slope in sorted(found.items()))
    record_property("rss_slope", report)
    print(
        f"\nmost waves one VW was ahead: {summary['max_lead_waves']} "
        f"(seen by the sampler: {sampler.max_lead})"
    )
    print(
        f"\nresident memory slope over waves {WAVES // 2}-{WAVES} "
        f"(weights {weight_bytes / 1024:.0f} KiB): {report}"
    )
    # one model copy kept per wave would be a slope of weight_bytes; allocator noise stays far below
    # 1/20 of it
    for name, slope in found.items():
        assert slope < weight_bytes / 20, f"{name} grows {slope / 1024:.1f} KiB per wave ({report})"

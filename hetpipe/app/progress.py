"""What `hetpipe train` shows while it runs: its view of every VW, fed by the stages' events, and the
progress block redrawn in place on a terminal (or printed every few seconds to a log)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from hetpipe.compute.build import VwLayout
from hetpipe.core.runs.metrics import VwProgress, wave_breakdown_ms

__all__ = ["Progress", "ProgressView"]


@dataclass
class Progress:
    """The launcher's view of every VW, fed by the stages' events."""

    layouts: tuple[VwLayout, ...]
    start_wave: int = 0  # a resumed run's first wave: every VW has completed the waves before it
    waves: dict[int, int] = field(default_factory=dict)
    loss: dict[int, float] = field(default_factory=dict)
    speed: dict[int, float] = field(default_factory=dict)
    gate_wait: dict[tuple[int, int], float] = field(default_factory=dict)
    pushed: dict[tuple[int, int], int] = field(default_factory=dict)
    audit_checks: int = 0
    frozen_cache: dict[str, float] = field(default_factory=dict)  # over every stage: hits, misses, mib
    times: dict[tuple[int, int], dict[str, float]] = field(
        default_factory=dict
    )  # (vw, stage) -> seconds by part
    evals: list[dict[str, Any]] = field(default_factory=list)
    startup: dict[tuple[int, int], dict[str, float]] = field(
        default_factory=dict
    )  # (vw, stage) -> its start-up points
    max_lead: int = 0
    steps: int = 0  # minibatches finished, over all VWs
    samples: int = 0  # their samples, the first one's left out (it ends the start-up, not the training)
    first_step: float | None = None  # when the first and the last of them finished (the stages' clock)
    last_step: float | None = None
    evicted: set[int] = field(default_factory=set)  # VWs out of the run (on_vw_failure = "evict")
    num_waves: int = 0  # the run's waves (VWs with planned spans stop before: docs/wsp.md#planned-spans)
    frozen_from: dict[int, int] = field(default_factory=dict)  # train.autofreeze: wave -> layers frozen

    def update(self, event: dict[str, Any]) -> None:
        vw = event.get("vw")
        if event["event"] == "minibatch":
            self.samples += event.get("batch", 0) if self.steps else 0
            self.steps += 1
            self.first_step = (
                event["time"] if self.first_step is None else min(self.first_step, event["time"])
            )
            self.last_step = event["time"] if self.last_step is None else max(self.last_step, event["time"])
        if event["event"] == "stage_done":
            self.audit_checks += event.get("audit_checks", 0)
            for key, value in event.get("frozen_cache", {}).items():
                self.frozen_cache[key] = self.frozen_cache.get(key, 0) + value
            self.times[(vw, event["stage"])] = event.get("times_s", {})
            self.frozen_from.update({w: n for w, n in event.get("autofreeze", [])})
        if event["event"] == "eval":
            self.evals.append({k: v for k, v in event.items() if k != "event"})
        if event["event"] == "startup":
            self.startup[(vw, event["stage"])] = event["points"]
        if event["event"] == "freeze":
            self.frozen_from[event["wave"]] = event["layers"]
        if event["event"] == "minibatch":
            self.loss[vw] = event["loss"]
            self.speed[vw] = event["samples_per_s"]
        elif event["event"] == "push":
            self.pushed[(vw, event["stage"])] = event["wave"] + 1
            self.gate_wait[(vw, event["stage"])] = event["gate_wait_s"]
            done = [self.completed(v) for v in self.training()]
            self.max_lead = max(self.max_lead, max(done, default=0) - min(done, default=0))

    def training(self) -> list[int]:
        """The VWs that count in the clock: not evicted, and not past a planned span's end."""
        return [
            v
            for v, lay in enumerate(self.layouts)
            if v not in self.evicted and (lay.waves is None or self.completed(v) < lay.waves[1])
        ]

    def c_global(self) -> int:
        return min((self.completed(v) for v in self.training()), default=self.num_waves)

    def breakdown_ms(self, waves: int) -> dict[str, dict[str, float]]:
        """Per VW, ms per wave spent in each part (compute, recv, d2h, push, gate_wait, pull, h2d, ...): the
        most any of its stages spent there (wave_breakdown_ms); a VW none of whose stages reported has
        none."""
        found = wave_breakdown_ms(self.times, waves)
        return {str(v): found.get(str(v), {}) for v in range(len(self.layouts))}

    def completed(self, vw: int) -> int:
        """Waves VW `vw` has completed (a VW planned to start later: its first wave, until it pushes)."""
        lay = self.layouts[vw]
        first = max(self.start_wave, lay.waves[0] if lay.waves else 0)
        return min(self.pushed.get((vw, s), first) for s in range(len(lay.split)))

    def started(self, vw: int) -> bool:
        """Whether a stage of VW `vw` has pushed (a VW planned to start later has not, at first)."""
        return any(v == vw for v, _ in self.pushed) or not self.layouts[vw].waves

    def rows(self) -> list[VwProgress]:
        c_global, training = self.c_global(), set(self.training())
        return [
            VwProgress(
                vw=v,
                gpus=",".join(lay.gpus),
                wave=self.completed(v),
                loss=self.loss.get(v),
                samples_per_s=self.speed.get(v, 0.0),
                lead=self.completed(v) - c_global if v in training and self.started(v) else 0,
                gate_wait_s=max((w for (vv, _), w in self.gate_wait.items() if vv == v), default=0.0),
                span=lay.waves,
            )
            for v, lay in enumerate(self.layouts)
        ]


class ProgressView:
    """Redraws the progress block in place on a terminal; prints it every few seconds otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.lines = 0
        self.last = 0.0

    def show(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < (0.5 if self.tty else 10.0)):
            return
        self.last = now
        if self.tty and self.lines:
            sys.stderr.write(f"\x1b[{self.lines}F\x1b[J")
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        self.lines = text.count("\n") + 1

"""Where a run's start-up goes: the launcher's and every stage's start-up points folded into one timeline
(seconds after `hetpipe train` started), for the summary and the launcher's one-line report. No torch here:
the CLI reads PRELOAD before it imports anything heavy."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["LAUNCHER_STEPS", "PRELOAD", "STAGE_STEPS", "format_timeline", "startup_timeline"]

# what the fork server imports once, so stage and PS processes fork ready
# (hetpipe.core.runs.procs.warm_forkserver): the stage and PS code with torch, and what they would import
# later on their own: numpy.random (the data's split and order) and torch's symbolic shapes with sympy, which
# torch.autograd.grad imports at a stage's first backward with an output gradient (~0.35 s, else paid by every
# stage but the last inside its first wave)
PRELOAD = (
    "hetpipe.worker.stage",
    "hetpipe.server.launch",
    "hetpipe.cli",
    "numpy.random",
    "torch.fx.experimental.symbolic_shapes",
)

LAUNCHER_STEPS = ("launcher_ready", "checks_done", "ps_ready", "stages_started")
# a stage's points (worker/stage.py): process started, its imports done, data loaded, stage built, registered
# with the PS (initial weights in), joined its VW's process group (rendezvous)
STAGE_STEPS = ("process", "imported", "data", "built", "registered", "rendezvous")


def startup_timeline(
    started: float,
    launcher: Mapping[str, float],
    stages: Iterable[Mapping[str, float]],
    first_minibatch: float | None,
) -> dict[str, float]:
    """Seconds after `started` (Unix time of `hetpipe train`) at which each step was done: the launcher's own
    steps, each stage step by its slowest stage ("stage_<step>"), and the first minibatch's end."""
    out = {step: round(launcher[step] - started, 3) for step in LAUNCHER_STEPS if step in launcher}
    points = list(stages)
    for step in STAGE_STEPS:
        times = [p[step] for p in points if p.get(step) is not None]
        if times:
            out[f"stage_{step}"] = round(max(times) - started, 3)
    if first_minibatch is not None:
        out["first_minibatch"] = round(first_minibatch - started, 3)
    return out


def format_timeline(timeline: Mapping[str, float]) -> str:
    """One line in time order:
    `start-up: launcher_ready 1.62 s, ps_ready 1.80 s, ..., first_minibatch 3.41 s`."""
    steps = sorted(timeline.items(), key=lambda item: item[1])
    return "start-up: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in steps)

"""TensorBoard event files of a run (`hetpipe train --tensorboard DIR`, the optional `tensorboard` extra): per
VW its training loss, samples/s, gate wait, lead over the slowest VW and the age of the weights it pulled,
and every evaluation of the global weights. Fed by the launcher with the events it writes to metrics.jsonl."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hetpipe.app.progress import Progress
from hetpipe.core.errors import UsageError

__all__ = ["EVAL_METRICS", "Board", "check_board", "scalars"]

EVAL_METRICS = ("test_accuracy", "test_loss", "val_loss", "val_perplexity")
# hetpipe is installed from its checkout, not an index: the extra is `-e '.[tensorboard]'` there
INSTALL = "pip install -e '.[tensorboard]' in the hetpipe checkout (or pip install 'tensorboard>=2.14')"


def check_board() -> None:
    """UsageError in one line when the tensorboard extra is missing (checked before anything starts)."""
    if importlib.util.find_spec("tensorboard") is None:
        raise UsageError(
            f"--tensorboard needs the tensorboard package, which is not installed: {INSTALL} "
            "(or leave out --tensorboard; metrics.jsonl has the same figures)"
        )


def scalars(
    event: Mapping[str, Any], progress: Progress, logged_waves: dict[int, int]
) -> list[tuple[str, float, int]]:
    """(tag, value, step) of one event, read after `progress` took it in. Steps: the VW's minibatch p for
    loss and samples/s, waves completed for gate wait and lead, the wave started for the pull's age, W_t's t
    for evaluations. `logged_waves` (VW -> waves logged) makes each completed wave log once, when the last of
    its stages pushed it."""
    kind, vw = event["event"], event.get("vw")
    if kind == "minibatch":
        out = [(f"vw{vw}/samples_per_s", float(event["samples_per_s"]), event["p"])]
        if event.get("loss") is not None and not event.get("skipped"):
            out.append((f"vw{vw}/loss", float(event["loss"]), event["p"]))
        return out
    if kind == "push":
        done = progress.completed(vw)
        if done <= logged_waves.get(vw, 0):
            return []
        logged_waves[vw] = done
        wait = max((w for (v, _), w in progress.gate_wait.items() if v == vw), default=0.0)
        return [
            (f"vw{vw}/gate_wait_s", float(wait), done),
            (f"vw{vw}/lead_waves", float(done - progress.c_global()), done),
        ]
    if kind == "pull" and event.get("stage") == 0:
        return [(f"vw{vw}/pulled_age_waves", float(event["age_waves"]), event["wave"])]
    if kind == "eval":
        return [(f"eval/{m}", float(event[m]), event["wave"]) for m in EVAL_METRICS if m in event]
    return []


class Board:
    """A SummaryWriter on `directory` fed event by event (wall time: the event's own time)."""

    def __init__(self, directory: Path) -> None:
        check_board()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise UsageError(
                f"--tensorboard: the tensorboard package does not load ({exc}); reinstall it: {INSTALL}"
            ) from None
        self.directory = directory
        self.writer = SummaryWriter(log_dir=str(directory))
        self._logged: dict[int, int] = {}

    def write(self, event: Mapping[str, Any], progress: Progress) -> None:
        for tag, value, step in scalars(event, progress, self._logged):
            self.writer.add_scalar(tag, value, global_step=step, walltime=event.get("time"))

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()

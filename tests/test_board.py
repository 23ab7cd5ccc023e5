"""Tests of hetpipe.app.board: which scalars each event gives, event files TensorBoard reads back, and the
one-line error without the tensorboard extra."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hetpipe.app import board as board_mod
from hetpipe.app.board import Board, scalars
from hetpipe.app.progress import Progress
from hetpipe.compute.build import VwLayout
from hetpipe.core.errors import UsageError

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
LAYOUTS = (VwLayout(("a", "b"), (1, 1)), VwLayout(("c",), (2,)))


def feed(progress: Progress, logged: dict[int, int], event: dict) -> list[tuple[str, float, int]]:
    progress.update(event)
    return scalars(event, progress, logged)


def test_scalars_per_event() -> None:
    progress, logged = Progress(LAYOUTS), {}
    assert feed(
        progress,
        logged,
        {
            "event": "minibatch",
            "vw": 1,
            "p": 4,
            "loss": 0.5,
            "time": 1.0,
            "samples_per_s": 250.0,
            "skipped": False,
        },
    ) == [("vw1/samples_per_s", 250.0, 4), ("vw1/loss", 0.5, 4)]
    assert feed(
        progress,
        logged,
        {
            "event": "minibatch",
            "vw": 1,
            "p": 5,
            "loss": float("nan"),
            "time": 1.1,
            "samples_per_s": 240.0,
            "skipped": True,
        },
    ) == [("vw1/samples_per_s", 240.0, 5)]
    # VW 0 completes wave 0 only once both its stages pushed it: one log, from the second push
    push = {"event": "push", "vw": 0, "wave": 0, "c_global": 0}
    assert feed(progress, logged, {**push, "stage": 0, "gate_wait_s": 0.25}) == []
    assert feed(progress, logged, {**push, "stage": 1, "gate_wait_s": 0.5}) == [
        ("vw0/gate_wait_s", 0.5, 1),
        ("vw0/lead_waves", 1.0, 1),
    ]  # VW 1 has completed nothing yet
    assert feed(
        progress, logged, {"event": "push", "vw": 1, "stage": 0, "wave": 0, "c_global": 1, "gate_wait_s": 0.0}
    ) == [("vw1/gate_wait_s", 0.0, 1), ("vw1/lead_waves", 0.0, 1)]
    assert feed(
        progress, logged, {"event": "pull", "vw": 0, "stage": 0, "wave": 2, "version": 1, "age_waves": 1}
    ) == [("vw0/pulled_age_waves", 1.0, 2)]
    assert (
        feed(
            progress, logged, {"event": "pull", "vw": 0, "stage": 1, "wave": 2, "version": 1, "age_waves": 1}
        )
        == []
    )  # stage 0's pull stands for its VW
    assert feed(
        progress,
        logged,
        {"event": "eval", "wave": 3, "test_accuracy": 0.75, "test_loss": 0.5, "eval_samples": 100},
    ) == [("eval/test_accuracy", 0.75, 3), ("eval/test_loss", 0.5, 3)]
    assert feed(progress, logged, {"event": "startup", "vw": 0, "stage": 0, "points": {}}) == []


def test_missing_extra_is_one_line(monkeypatch) -> None:
    monkeypatch.setattr(board_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UsageError) as caught:
        Board(Path("unused"))
    message = str(caught.value)
    assert "\n" not in message and "pip install -e '.[tensorboard]' in the hetpipe checkout" in message


@pytest.mark.skipif(
    not HAS_TENSORBOARD, reason="needs the tensorboard extra (pip install -e '.[tensorboard]')"
)
def test_event_files_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    progress = Progress(LAYOUTS)
    sink = Board(tmp_path / "tb")
    for p, loss in enumerate((2.0, 1.5, 1.0)):
        event = {
            "event": "minibatch",
            "vw": 0,
            "p": p,
            "loss": loss,
            "time": 1_700_000_000.0 + p,
            "samples_per_s": 100.0 + p,
            "skipped": False,
        }
        progress.update(event)
        sink.write(event, progress)
    sink.write({"event": "eval", "wave": 2, "test_accuracy": 0.5, "time": 1_700_000_005.0}, progress)
    sink.close()
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"vw0/loss", "vw0/samples_per_s", "eval/test_accuracy"}
    assert [(s.step, s.value, s.wall_time) for s in acc.Scalars("vw0/loss")] == [
        (0, 2.0, 1_700_000_000.0),
        (1, 1.5, 1_700_000_001.0),
        (2, 1.0, 1_700_000_002.0),
    ]
    assert [(s.step, s.value) for s in acc.Scalars("eval/test_accuracy")] == [(2, 0.5)]

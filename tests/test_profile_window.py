"""`hetpipe train --profile FIRST:COUNT`: which actions a stage profiles, and what it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetpipe.core.errors import UsageError
from hetpipe.core.pipeline.profile_window import ProfileWindow
from hetpipe.core.pipeline.schedule import get_schedule
from hetpipe.worker.stage_profile import StageProfiler


def test_parse_reads_first_and_count():
    window = ProfileWindow.parse("40:8")
    assert (window.first, window.count, window.last) == (40, 8, 47)
    assert window.fits(48) and not window.fits(47)


@pytest.mark.parametrize("text", ["40", "a:3", "4:0", "-1:4", "4:2:1", ""])
def test_parse_refuses_what_is_not_first_colon_count(text: str):
    with pytest.raises(UsageError, match="--profile"):
        ProfileWindow.parse(text)


def profiled_actions(name: str, window: ProfileWindow, nm: int = 4, waves: int = 6) -> list[str]:
    """The actions of one stage of a one-stage VW that run while the window's profiler is on."""
    on, inside = False, []
    for action in get_schedule(name)(1, nm, waves, 0).stages[0]:
        if not on and window.opens_at(action.kind, action.index):
            on = True
        if on:
            inside.append(f"{action.kind}{action.index}")
            if window.closes_after(action.kind, action.index):
                break
    return inside


def test_the_window_runs_from_the_first_forward_to_the_update_of_the_last():
    # wsp at Nm 4 runs forwards ahead: B and U of minibatches before FIRST and F of some after LAST fall
    # inside
    inside = profiled_actions("wsp", ProfileWindow(8, 4))
    assert inside[0] == "F8" and inside[-1] == "U11"
    assert [a for a in inside if a[0] == "F"] == ["F8", "F9", "F10", "F11", "F12", "F13", "F14"]
    # a flush schedule updates once a wave: the window closes at the update after its last minibatch
    inside = profiled_actions("1f1b-flush", ProfileWindow(8, 2))
    assert inside[0] == "F8" and inside[-1] == "U11"


def run_actions(profiler: StageProfiler, actions) -> None:
    weight = torch.ones(64, 64)
    for action in actions:
        profiler.before(action.kind, action.index)
        weight = weight @ weight / 64.0  # an op inside every action
        profiler.after(action.kind, action.index)
    profiler.close()


def test_a_stage_writes_its_ops_per_minibatch(tmp_path: Path):
    actions = get_schedule("wsp")(1, 2, 5, 0).stages[0]
    profiler = StageProfiler(ProfileWindow(2, 4), torch.device("cpu"), tmp_path / "profile", "vw0-s0")
    run_actions(profiler, actions)
    summary = json.loads((tmp_path / "profile" / "vw0-s0.json").read_text())
    names = [f"{a.kind}{a.index}" for a in actions]
    inside = actions[names.index("F2") : names.index("U5") + 1]
    forwards = sum(1 for a in inside if a.kind == "F")
    assert summary["window"] == [2, 5] and summary["minibatches"] == forwards
    mm = next(op for op in summary["by_host"] if op["name"] == "aten::mm")
    assert mm["calls"] == pytest.approx(len(inside) / forwards, abs=0.01)  # one matmul an action, per forward
    text = (tmp_path / "profile" / "vw0-s0.txt").read_text()
    assert (
        text.startswith("vw0-s0, from the forward of minibatch 2 through the update of 5: ")
        and "aten::mm" in text
    )


def test_a_run_that_ends_inside_the_window_still_writes_it_and_says_so(tmp_path: Path):
    actions = get_schedule("wsp")(1, 2, 3, 0).stages[0]  # minibatches 0 ... 5
    profiler = StageProfiler(ProfileWindow(2, 10), torch.device("cpu"), tmp_path, "vw1-s0")
    run_actions(profiler, actions)
    assert "the run ended at minibatch 5 before the window's end, 11" in (tmp_path / "vw1-s0.txt").read_text()

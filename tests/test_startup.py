"""Tests of hetpipe.app.startup: the start-up timeline folds launcher and stage points into seconds after
start."""

from __future__ import annotations

from hetpipe.app.startup import format_timeline, startup_timeline

START = 1_700_000_000.0


def test_timeline_takes_the_slowest_stage_of_each_step() -> None:
    launcher = {
        "launcher_ready": START + 1.5,
        "checks_done": START + 1.75,
        "ps_ready": START + 2.0,
        "stages_started": START + 2.125,
    }
    stages = [
        {
            "process": START + 2.0,
            "imported": START + 2.125,
            "data": START + 2.25,
            "built": START + 2.375,
            "registered": START + 2.375,
            "rendezvous": START + 2.5,
        },
        {
            "process": START + 2.125,
            "imported": START + 2.25,
            "data": START + 2.5,
            "built": START + 2.625,
            "registered": START + 2.75,
            "rendezvous": START + 2.5,
        },
        {"process": None, "imported": START + 2.0},  # /proc missing there: that point is left out
    ]
    assert startup_timeline(START, launcher, stages, START + 2.875) == {
        "launcher_ready": 1.5,
        "checks_done": 1.75,
        "ps_ready": 2.0,
        "stages_started": 2.125,
        "stage_process": 2.125,
        "stage_imported": 2.25,
        "stage_data": 2.5,
        "stage_built": 2.625,
        "stage_registered": 2.75,
        "stage_rendezvous": 2.5,
        "first_minibatch": 2.875,
    }


def test_timeline_before_any_stage_reported() -> None:
    assert startup_timeline(START, {"launcher_ready": START + 0.5}, [], None) == {"launcher_ready": 0.5}


def test_format_timeline_is_in_time_order() -> None:
    line = format_timeline(
        {"ps_ready": 2.0, "launcher_ready": 1.5, "first_minibatch": 3.125, "stage_data": 2.5}
    )
    assert (
        line == "start-up: launcher_ready 1.50 s, ps_ready 2.00 s, stage_data 2.50 s, first_minibatch 3.12 s"
    )

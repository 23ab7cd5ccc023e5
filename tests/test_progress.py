"""The launcher's view of a run (hetpipe.app.progress.Progress): a resumed run starts at its resume wave, so
its waves, leads and samples count from there, not from 0 (issue 36 item 8)."""

from __future__ import annotations

from hetpipe.app.progress import Progress
from hetpipe.compute.build import VwLayout

LAYOUTS = (VwLayout(("a", "b"), (1, 1)), VwLayout(("c",), (2,)))


def _push(progress: Progress, vw: int, stage: int, wave: int) -> None:
    progress.update({"event": "push", "vw": vw, "stage": stage, "wave": wave, "gate_wait_s": 0.0})


def test_a_resumed_run_counts_from_its_resume_wave() -> None:
    progress = Progress(LAYOUTS, start_wave=140)
    assert [row.wave for row in progress.rows()] == [140, 140]
    _push(progress, 1, 0, 140)  # vw 1 completes wave 140; vw 0's stages have not pushed since the resume
    assert [row.wave for row in progress.rows()] == [140, 141]
    assert progress.max_lead == 1 and [row.lead for row in progress.rows()] == [0, 1]


def test_samples_leave_out_the_first_minibatch_and_add_each_vws_own_batch() -> None:
    progress = Progress(LAYOUTS)
    for vw, batch in ((0, 16), (1, 32), (1, 32)):
        event = {"event": "minibatch", "vw": vw, "p": 0, "loss": 1.0, "time": 1.0, "samples_per_s": 1.0}
        progress.update({**event, "batch": batch})
    assert progress.steps == 3 and progress.samples == 64


def test_an_evicted_vw_does_not_count_in_the_lead() -> None:
    progress = Progress(LAYOUTS)
    _push(progress, 1, 0, 0), _push(progress, 0, 0, 0), _push(progress, 0, 1, 0)
    progress.evicted = {0}  # vw 0 stops at wave 1; vw 1 goes on alone
    for wave in range(1, 6):
        _push(progress, 1, 0, wave)
    assert progress.max_lead == 1 and progress.c_global() == 6  # wave 1 reached one VW first; not 5


def test_a_resumed_stage_rates_only_the_samples_it_trained_itself() -> None:
    from hetpipe.worker.stage_actions import ComputeActions

    actions = ComputeActions.__new__(ComputeActions)  # its clock only: no stage behind it
    actions.samples = 20 * 64  # restored from the snapshot of wave 20
    actions.begin(100.0)
    actions.samples += 2 * 64  # two minibatches since the resume, in 4 s
    assert actions.samples_per_s(104.0) == 32.0  # not (22 * 64) / 4

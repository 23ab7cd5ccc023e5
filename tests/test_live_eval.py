"""Tests of hetpipe.app.live_eval's timing rule: which c_global values start an evaluation of the global
weights (the evaluation itself reads a live PS: tests/test_train_runtime.py runs it end to end)."""

from __future__ import annotations

import threading
from dataclasses import replace

from hetpipe.app.live_eval import LiveEvaluator
from hetpipe.core.config.files import default_config_path, load_config


def evaluator(every: int, waves: int) -> tuple[LiveEvaluator, list[int], threading.Event]:
    config = load_config(default_config_path())
    config = replace(config, train=replace(config.train, eval_every=every, waves=waves))
    live = LiveEvaluator(config, None, [], 2, "cpu")  # type: ignore[arg-type]  # no spec or PS needed here
    started: list[int] = []
    release = threading.Event()

    def score(c_global: int) -> None:
        started.append(c_global)
        release.wait(10)

    live._score = score  # type: ignore[method-assign]
    return live, started, release


def test_due_points_start_one_evaluation_at_a_time() -> None:
    live, started, release = evaluator(every=3, waves=10)
    for c in (0, 1, 2, 3, 3, 4):
        live.wave_done(c)
    assert started == [3]
    live.wave_done(6)  # due, but the evaluation of 3 still runs: skipped, not queued
    release.set()
    live.join()
    assert started == [3]
    live.wave_done(7)  # 6 was due and missed: the first call after it starts one
    live.join()
    live.wave_done(8)
    live.wave_done(10)  # the end: the final evaluation covers it
    live.join()
    assert started == [3, 7]


def test_eval_every_zero_never_evaluates() -> None:
    live, started, release = evaluator(every=0, waves=10)
    release.set()
    for c in range(11):
        live.wave_done(c)
    live.join()
    assert started == []

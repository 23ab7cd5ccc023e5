"""hetpipe.core.runs.summary_text: the printed end-of-run block, against literal summaries written here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hetpipe.core.runs.summary_text import format_run_summary, shown_evals

T0 = 1_795_780_000.0  # the run's start, Unix time

BASE: dict[str, Any] = {
    "config": "hetpipe/clusters/local.toml",
    "run_dir": "/tmp/runs/r1",
    "model": "mnist-cnn",
    "virtual_workers": 2,
    "waves": 6,
    "samples": 768,
    "wall_s": 3.13,
    "train_s": 1.43,
    "samples_per_s": 516.08,
    "resumed_from": None,
    "ps_restarts": 0,
    "evicted": [],
    "eval_samples": 1000,
    "test_accuracy": 0.205,
    "test_loss": 1.972,
    "evals": [
        {
            "wave": 2,
            "c_global": 2,
            "time": T0 + 6.04,
            "eval_s": 1.262,
            "test_accuracy": 0.245,
            "test_loss": 2.2503,
        },
        {
            "wave": 4,
            "c_global": 4,
            "time": T0 + 7.51,
            "eval_s": 1.1,
            "test_accuracy": 0.3125,
            "test_loss": 2.01,
        },
    ],
    "gate_wait_s": {"0": 0.188, "1": 0.0},  # below: left to summary.json
}


def test_a_classifier_run() -> None:
    assert format_run_summary(BASE, started=T0) == (
        "hetpipe: trained mnist-cnn on hetpipe/clusters/local.toml with 2 VWs\n"
        "accuracy  0.205  (test loss 1.972, 1000 held-out samples)\n"
        "time      3.13 s wall to the last wave, 1.43 s of it training (from the first minibatch on)\n"
        "speed     516.1 samples/s\n"
        "trained   6 waves, 768 samples\n"
        "model     /tmp/runs/r1/model.pt\n"
        "export    hetpipe export /tmp/runs/r1  (the whole nn.Module, as /tmp/runs/r1/model-module.pt)\n"
        "resume    nothing to resume, all 6 waves ran "
        "(`hetpipe train --resume /tmp/runs/r1` is for a stopped run)\n"
        "summary   /tmp/runs/r1/summary.json (every number)\n"
        "\n"
        "evaluations while training (2):\n"
        "wave  since start   loss  accuracy\n"
        "   2        6.0 s  2.250     0.245\n"
        "   4        7.5 s  2.010     0.312"
    )


def test_no_evaluations_while_training_and_the_summary_copy() -> None:
    text = format_run_summary({**BASE, "evals": []}, started=T0, also_json=Path("s.json"))
    assert "summary   /tmp/runs/r1/summary.json and s.json (every number)" in text.splitlines()
    assert text.endswith(
        "\n\nevaluations while training: none (train.eval_every = N scores the model every N waves)"
    )


def test_a_loss_only_model() -> None:
    summary = {k: v for k, v in BASE.items() if k not in ("test_accuracy", "test_loss")}
    summary.update(
        model="gpt-tiny",
        val_loss=3.5,
        val_perplexity=33.12,
        unigram_loss=4.1,
        evals=[{"wave": 3, "time": T0 + 10.0, "val_loss": 3.9, "val_perplexity": 49.402}],
    )
    lines = format_run_summary(summary, started=T0).splitlines()
    assert lines[1] == "loss      3.5  (perplexity 33.12, a unigram model's loss 4.1, 1000 held-out samples)"
    assert "accuracy" not in "\n".join(lines)
    assert lines[-2:] == ["wave  since start   loss  perplexity", "   3       10.0 s  3.900      49.402"]


def test_more_than_ten_evaluations_show_the_first_the_last_and_between() -> None:
    evals = [{"wave": w, "time": T0 + w, "test_loss": 1.0, "test_accuracy": 0.5} for w in range(1, 26)]
    lines = format_run_summary({**BASE, "evals": evals}, started=T0).splitlines()
    title = lines.index("evaluations while training (25; 10 shown, 15 left out: summary.json has all):")
    waves = [int(line.split()[0]) for line in lines[title + 2 :]]
    assert waves == [1, 4, 6, 9, 12, 14, 17, 20, 22, 25]


def test_without_a_start_the_seconds_count_from_the_first_evaluation() -> None:
    lines = format_run_summary(BASE).splitlines()
    assert lines[-3:] == [
        "wave  since 1st   loss  accuracy",
        "   2      0.0 s  2.250     0.245",
        "   4      1.5 s  2.010     0.312",
    ]


def test_a_resumed_distributed_run_with_notes() -> None:
    summary = {
        **BASE,
        "run_dir": "/shared/my runs/r1",
        "launcher": "distributed",
        "train_s": 3.13,
        "resumed_from": 4,
        "samples": 256,
        "ps_restarts": 1,
        "evicted": [1],
        "checkpoint_failures": 2,
        "audit_checks": 40,
        "audit_final_ledgers_exact": True,
    }
    lines = format_run_summary(summary).splitlines()
    assert lines[2:5] == [
        "time      3.13 s wall to the last wave",
        "speed     516.1 samples/s (over the whole wall time)",
        "trained   2 waves (resumed at wave 4 of 6), 256 samples",
    ]
    assert (
        "export    hetpipe export '/shared/my runs/r1'  "
        "(the whole nn.Module, as /shared/my runs/r1/model-module.pt)" in lines
    )
    assert (
        "notes     audit: 40 checks, final ledgers exact; PS restarts: 1; evicted: vw1; "
        "failed PS checkpoints: 2" in lines
    )


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (0, []),
        (3, [0, 1, 2]),
        (10, list(range(10))),
        (11, [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]),
        (100, [0, 11, 22, 33, 44, 55, 66, 77, 88, 99]),
    ],
)
def test_shown_evals(count: int, expected: list[int]) -> None:
    assert shown_evals(count) == expected

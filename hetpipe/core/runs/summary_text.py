"""The end-of-run summary for people: the result, speed, files and commands of a run. Pure, no I/O."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["MAX_EVAL_ROWS", "format_run_summary", "shown_evals"]

MAX_EVAL_ROWS = 10  # the evaluations table shows at most this many rows: first, last and evenly between
LABEL = 9  # width of the block's labels


def format_run_summary(
    summary: Mapping[str, Any], *, started: float | None = None, also_json: Path | None = None
) -> str:
    """The short block a finished `hetpipe train` (or `hetpipe finish`) prints from its summary dict: the
    result, the time, the speed, what was trained, where the model is and the commands that use it, where
    summary.json is, then the evaluations made while training. `started`: the Unix time the run started
    (the evaluations' seconds count from it; without it they count from the first); `also_json`: the
    `--summary` copy, if any."""
    run_dir = Path(summary["run_dir"])
    lines = [_headline(summary), *_result(summary), *_speed(summary), *_files(summary, run_dir, also_json)]
    lines += _notes(summary)
    return "\n".join([*lines, "", *_evals_table(summary.get("evals") or [], started)])


def _row(label: str, text: str) -> str:
    return f"{label:<{LABEL}} {text}"


def _headline(summary: Mapping[str, Any]) -> str:
    vws = summary.get("virtual_workers")
    return f"hetpipe: trained {summary.get('model', '?')} on {summary.get('config', '?')} with {vws} VWs"


def _result(summary: Mapping[str, Any]) -> list[str]:
    """The final evaluation: test accuracy (with the loss), or for a model without one its loss."""
    held_out = f"{summary['eval_samples']} held-out samples" if "eval_samples" in summary else "held-out data"
    if "test_accuracy" in summary:
        loss = f"test loss {_num(summary.get('test_loss'))}, " if "test_loss" in summary else ""
        return [_row("accuracy", f"{_num(summary['test_accuracy'])}  ({loss}{held_out})")]
    if "val_loss" in summary:
        extra = [f"perplexity {_num(summary['val_perplexity'])}"] if "val_perplexity" in summary else []
        if "unigram_loss" in summary:
            extra.append(f"a unigram model's loss {_num(summary['unigram_loss'])}")
        return [_row("loss", f"{_num(summary['val_loss'])}  ({', '.join([*extra, held_out])})")]
    if "test_loss" in summary:
        return [_row("loss", f"{_num(summary['test_loss'])}  ({held_out})")]
    return [_row("result", "no evaluation in the summary")]


def _speed(summary: Mapping[str, Any]) -> list[str]:
    """Wall time, samples/s and what was trained (waves, samples, where a resumed run started)."""
    wall, train = summary.get("wall_s"), summary.get("train_s")
    time_text = f"{_seconds(wall)} wall to the last wave"
    if train is not None and train != wall:
        time_text += f", {_seconds(train)} of it training (from the first minibatch on)"
    speed = f"{_num(summary.get('samples_per_s'))} samples/s"
    if summary.get("launcher") == "distributed":
        speed += " (over the whole wall time)"
    waves, cut = summary.get("waves"), summary.get("resumed_from")
    trained = f"{waves} waves, {summary.get('samples')} samples"
    if cut is not None and isinstance(waves, int):  # samples: this run's part
        trained = f"{waves - cut} waves (resumed at wave {cut} of {waves}), {summary.get('samples')} samples"
    return [_row("time", time_text), _row("speed", speed), _row("trained", trained)]


def _files(summary: Mapping[str, Any], run_dir: Path, also_json: Path | None) -> list[str]:
    """Where the model and summary.json are, with the commands that export the model and (not) resume."""
    quoted = shlex.quote(str(run_dir))
    json_text = str(run_dir / "summary.json") + (f" and {also_json}" if also_json else "")
    return [
        _row("model", str(run_dir / "model.pt")),
        _row("export", f"hetpipe export {quoted}  (the whole nn.Module, as {run_dir / 'model-module.pt'})"),
        _row(
            "resume",
            f"nothing to resume, all {summary.get('waves')} waves ran (`hetpipe train --resume {quoted}` is "
            "for a stopped run)",
        ),
        _row("summary", f"{json_text} (every number)"),
    ]


def _notes(summary: Mapping[str, Any]) -> list[str]:
    """What went other than plainly: the audit's verdict, PS restarts, evicted VWs, the layers frozen,
    failed checkpoints."""
    notes = []
    if "audit_final_ledgers_exact" in summary:
        verdict = "exact" if summary["audit_final_ledgers_exact"] else "NOT exact (see audit_ledger)"
        notes.append(f"audit: {summary.get('audit_checks', 0)} checks, final ledgers {verdict}")
    if summary.get("ps_restarts"):
        notes.append(f"PS restarts: {summary['ps_restarts']}")
    if summary.get("evicted"):
        notes.append(f"evicted: {', '.join(f'vw{v}' for v in summary['evicted'])}")
    if summary.get("autofreeze"):
        notes.append("frozen: " + ", ".join(f"{n} layers from wave {w}" for w, n in summary["autofreeze"]))
    if summary.get("checkpoint_failures"):
        notes.append(f"failed PS checkpoints: {summary['checkpoint_failures']}")
    return [_row("notes", "; ".join(notes))] if notes else []


def shown_evals(count: int, most: int = MAX_EVAL_ROWS) -> list[int]:
    """Which of `count` evaluations the table shows: all of up to `most`, else the first, the last and
    evenly spaced between (`most` in all)."""
    if count <= most:
        return list(range(count))
    return [round(i * (count - 1) / (most - 1)) for i in range(most)]


def _evals_table(evals: Sequence[Mapping[str, Any]], started: float | None) -> list[str]:
    """The evaluations made while training as an aligned table: wave, seconds since the start, loss and
    accuracy (or perplexity); at most MAX_EVAL_ROWS rows, saying how many were left out."""
    if not evals:
        return ["evaluations while training: none (train.eval_every = N scores the model every N waves)"]
    zero = started if started is not None else evals[0].get("time", 0.0)
    since = "since start" if started is not None else "since 1st"
    second = "perplexity" if any("val_perplexity" in e for e in evals) else "accuracy"
    header = ("wave", since, "loss", second)
    rows = [header] + [
        (
            str(e.get("wave", "-")),
            f"{e['time'] - zero:.1f} s" if "time" in e else "-",
            _fixed(e.get("test_loss", e.get("val_loss"))),
            _fixed(e.get("test_accuracy", e.get("val_perplexity"))),
        )
        for e in (evals[i] for i in shown_evals(len(evals)))
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    table = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    shown = len(rows) - 1
    title = f"evaluations while training ({len(evals)}"
    title += (
        f"; {shown} shown, {len(evals) - shown} left out: summary.json has all):"
        if shown < len(evals)
        else "):"
    )
    return [title, *table]


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def _fixed(value: Any) -> str:
    """A table's score: 3 decimals, so that a column's figures line up."""
    return f"{value:.3f}" if isinstance(value, float) else _num(value)


def _seconds(value: Any) -> str:
    return "-" if value is None else f"{float(value):.2f} s"

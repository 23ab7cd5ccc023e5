"""The benchmarks' PNG figures, drawn with matplotlib when it is installed (the `bench` extra) and skipped
otherwise."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MISSING = "no plot: matplotlib is not installed (pip install -e '.[bench]')"


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _save(draw: Callable[[Any], None], path: Path, size: tuple[float, float] = (7, 3.5)) -> str:
    """Draw on a fresh Agg figure, write it to path; the line to print either way."""
    if not available():
        return MISSING
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    try:
        draw(ax)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return f"wrote {path}"


def throughput_bars(rows: Sequence[dict[str, Any]], capacity: float, path: Path, title: str) -> str:
    """Median samples/s per system with min-max whiskers, and the capacity bound as a line."""

    def draw(ax: Any) -> None:
        med = [r["samples_per_s"]["median"] for r in rows]
        err = [
            [m - r["samples_per_s"]["min"] for m, r in zip(med, rows, strict=True)],
            [r["samples_per_s"]["max"] - m for m, r in zip(med, rows, strict=True)],
        ]
        colors = ["tab:green" if r["system"] == "hetpipe" else "tab:gray" for r in rows]
        ax.bar([r["system"] for r in rows], med, yerr=err, capsize=4, color=colors)
        ax.axhline(capacity, color="tab:red", linestyle="--", label="capacity bound")
        ax.set_ylabel("samples/s")
        ax.set_title(title)
        ax.legend()

    return _save(draw, path)


def metric_curves(
    rows: Sequence[dict[str, Any]],
    metric: str,
    target: float,
    path: Path,
    x_label: str = "training wall time (s)",
) -> str:
    """One line per run (its `label`): the metric of its scored weights against curve["s"], and the target."""

    def draw(ax: Any) -> None:
        for r in rows:
            ax.plot(
                [p["s"] for p in r["curve"]], [p[metric] for p in r["curve"]], marker=".", label=r["label"]
            )
        ax.axhline(target, color="gray", linestyle="--", label="target")
        ax.set_xlabel(x_label)
        ax.set_ylabel(metric.replace("_", " "))
        ax.legend(fontsize="small")

    return _save(draw, path, (8, 4))


def paired_bars(
    labels: Sequence[str], series: dict[str, Sequence[float]], ylabel: str, title: str, path: Path
) -> str:
    """Side-by-side bars per label, one colour per series (e.g. PS vs raw ZeroMQ, predicted vs measured)."""

    def draw(ax: Any) -> None:
        width = 0.8 / max(len(series), 1)
        for i, (name, values) in enumerate(series.items()):
            ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
        ax.set_xticks(
            [x + width * (len(series) - 1) / 2 for x in range(len(labels))], labels, fontsize="small"
        )
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()

    return _save(draw, path)

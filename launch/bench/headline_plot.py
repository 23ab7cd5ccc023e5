"""The README's headline figure: hetpipe against each row's baseline, drawn from the README's Results table.

The figures live in one place, the table under README.md's `## Results`; this script reads them from there and
writes docs/headline.png, so after changing a row of the table run it again:

    python launch/bench/headline_plot.py            # README.md -> docs/headline.png

A row is drawn when both its hetpipe and its baseline cells start with a number and a unit (`**224**
samples/s`, `42.0 s`); the others (no baseline) are left out. A panel's title is the row's link text. Needs
matplotlib (the `bench` extra). Measures nothing.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Results"
NUMBER = re.compile(r"^\**([\d,]+(?:\.\d+)?)\**\s+(\S.*)$")
LINK_TEXT = re.compile(r"\[([^\]]+)\]")


@dataclass(frozen=True)
class Row:
    """One drawable row of the table: hetpipe's and the baseline's figure in one unit."""

    title: str
    unit: str
    hetpipe: float
    baseline: float
    baseline_is: str
    hetpipe_text: str
    baseline_text: str


def table_lines(readme: str) -> list[str]:
    """The lines of the first Markdown table after the Results heading."""
    lines = readme.splitlines()
    start = lines.index(HEADING)
    table: list[str] = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            table.append(line)
        elif table or line.startswith("## "):
            break
    if len(table) < 3:
        raise SystemExit(f"error: no table under {HEADING!r} in the README")
    return table


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def figure(cell: str) -> tuple[float, str, str] | None:
    """(value, unit, the number as written) of a cell like `**224** samples/s`; None if not one."""
    match = NUMBER.match(cell)
    if match is None:
        return None
    return float(match[1].replace(",", "")), match[2].strip(), match[1]


def rows(readme: str) -> list[Row]:
    """Every row of the headline table with a hetpipe and a baseline figure in the same unit."""
    header, _, *body = table_lines(readme)
    names = [name.lower() for name in cells(header)]
    at = {key: names.index(key) for key in ("result", "hetpipe", "baseline", "baseline is")}
    found = []
    for line in body:
        row = cells(line)
        ours, theirs = figure(row[at["hetpipe"]]), figure(row[at["baseline"]])
        if ours is None or theirs is None:
            continue
        if ours[1] != theirs[1]:
            raise SystemExit(f"error: units differ in the row {line!r}: {ours[1]!r} and {theirs[1]!r}")
        title = LINK_TEXT.search(row[at["result"]])
        found.append(
            Row(
                title=title[1] if title else row[at["result"]],
                unit=ours[1],
                hetpipe=ours[0],
                baseline=theirs[0],
                baseline_is=row[at["baseline is"]],
                hetpipe_text=ours[2],
                baseline_text=theirs[2],
            )
        )
    if not found:
        raise SystemExit("error: the headline table has no row with both a hetpipe and a baseline figure")
    return found


def draw(found: list[Row], path: Path, columns: int = 3) -> None:
    """One small panel per row: hetpipe's bar beside its baseline's, labelled with the table's figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = (len(found) + columns - 1) // columns
    fig, axes = plt.subplots(grid, columns, figsize=(3.2 * columns, 2.9 * grid), squeeze=False)
    for ax, row in zip(axes.flat, found, strict=False):
        bars = ax.bar(
            ["hetpipe", row.baseline_is], [row.hetpipe, row.baseline], color=["tab:green", "tab:gray"]
        )
        ax.bar_label(bars, labels=[row.hetpipe_text, row.baseline_text], fontsize=8)
        better = "lower" if row.unit == "s" else "higher"
        ax.set_title(row.title, fontsize=9)
        ax.set_ylabel(f"{row.unit} ({better} is better)", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.margins(y=0.18)
    for ax in list(axes.flat)[len(found) :]:
        ax.set_visible(False)
    fig.suptitle(
        "hetpipe against the baseline of each README row (GPUs emulated on CPU unless real)", fontsize=10
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md", help="the README to read")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "headline.png", help="the PNG to write")
    args = parser.parse_args(argv)
    found = rows(args.readme.read_text())
    try:
        draw(found, args.out)
    except ImportError:
        print("error: no plot: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({len(found)} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Many chaos.py runs of one fault, one seed each, and their totals: runs passed, lost and duplicated updates,
and per fault what it showed (the flood's wave rate before and during it, how the full disk was named).

    python launch/bench/chaos_runs.py --fault flood --runs 20 [--seed 1] [--out-dir DIR] [-- CHAOS ARGS...]
    python launch/bench/chaos_runs.py --fault flood --from-dir DIR     # the totals of runs already made

Each run is `chaos.py --fault F --seed S --run-dir DIR/F-S --out DIR/F-S.json`; its output goes to
DIR/F-S.log. Exit code 0 only when every run passed.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import click

HERE = Path(__file__).resolve().parent


def run_one(fault: str, seed: int, out_dir: Path, extra: tuple[str, ...]) -> int:
    """One chaos.py run; its exit code."""
    with open(out_dir / f"{fault}-{seed}.log", "w") as log:
        return subprocess.call(
            [
                sys.executable,
                str(HERE / "chaos.py"),
                "--fault",
                fault,
                "--seed",
                str(seed),
                "--run-dir",
                str(out_dir / f"{fault}-{seed}"),
                "--out",
                str(out_dir / f"{fault}-{seed}.json"),
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def totals(results: list[dict], codes: list[int]) -> dict:
    """What the runs add up to (`codes`: chaos.py's exit code of each, 0 = passed)."""
    found = {
        "runs": len(codes),
        "passed": sum(code == 0 for code in codes),
        "completed": sum(bool(r.get("completed")) for r in results),
        "lost": sum(r.get("lost") or 0 for r in results),
        "duplicated": sum(r.get("duplicated") or 0 for r in results),
        "stray": sum(r.get("stray") or 0 for r in results),
        "ledger_slots": sum(r.get("ledger_slots") or 0 for r in results),
        "no_result": len(codes) - len(results),
    }
    rates = [
        (r["waves_per_s_before"], r["waves_per_s_during"])
        for r in results
        if r.get("waves_per_s_before") and r.get("waves_per_s_during")
    ]
    if rates:
        for i, name in enumerate(("before", "during")):
            values = [rate[i] for rate in rates]
            found[f"waves_per_s_{name}"] = {
                "median": round(statistics.median(values), 2),
                "min": min(values),
                "max": max(values),
            }
        found["checkpoint_failures"] = sum(r.get("checkpoint_failures") or 0 for r in results)
    named = [r["enospc_named"] for r in results if r.get("enospc_named")]
    if any("enospc_named" in r for r in results):
        found["enospc_named"] = len(named)
        found["tmp_left"] = sum(len(r.get("tmp_left") or []) for r in results)
    return found


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--fault", required=True, help="chaos.py's --fault.")
@click.option("--runs", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True, help="The first run's seed; then +1 each.")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option(
    "--from-dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    help="Make no run: add up the F-S.json of runs already in this directory (a missing one fails).",
)
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def main(
    fault: str, runs: int, seed: int, out_dir: Path | None, from_dir: Path | None, extra: tuple[str, ...]
) -> None:
    seeds = range(seed, seed + runs)
    out_dir = from_dir or out_dir or Path(tempfile.mkdtemp(prefix=f"hetpipe-chaos-{fault}-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    codes, results = [], []
    for s in seeds:
        path = out_dir / f"{fault}-{s}.json"
        if from_dir is None:
            code = run_one(fault, s, out_dir, extra)
            print(f"{fault} seed {s}: {'passed' if code == 0 else f'FAILED (exit {code})'}", flush=True)
        result = json.loads(path.read_text()) if path.exists() else None
        if from_dir is not None:  # chaos.py's verdict again, from the result it wrote
            sys.path.insert(0, str(HERE))
            import chaos

            code = 0 if result is not None and chaos.passed(result, _summary(result)) else 1
        codes.append(code)
        if result is not None:
            results.append(result)
    found = totals(results, codes)
    print(f"{fault}: {json.dumps(found)} ({out_dir})")
    raise SystemExit(0 if found["passed"] == found["runs"] else 1)


def _summary(result: dict) -> dict:
    """The part of the run's summary chaos.passed reads (the evicted VWs), from its result."""
    return {"evicted": result.get("evicted") or []}


if __name__ == "__main__":
    main()

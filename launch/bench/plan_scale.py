"""Time `hetpipe plan` (the default search) on paper-16gpu.toml, a 64-GPU 8-type cluster and a 1,024-GPU
8-type 128-node cluster (launch/synth_cluster.py):
the median of 3 runs with their spread, and each run's peak memory
(resource.getrusage maxrss of the child). With --check, also that the default search's best plan predicts what
the exhaustive search's does on every shipped config (slow: minutes).

    python launch/bench/plan_scale.py [--runs 3] [--only paper,64,1024] [--peer] [--check]

--peer also times the exhaustive search (`hetpipe plan --exhaustive`, every candidate simulated) on
paper-16gpu, side by side.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))
import synth_cluster  # noqa: E402  (launch is not a package)

TARGETS = {"paper": 2.0, "64": 10.0, "1024": 60.0}  # seconds (issue 37)
MEMORY_TARGET_GIB = 2.0


def clusters(folder: Path) -> dict[str, Path]:
    """The three configs, the synthetic ones written to `folder`."""
    out = {"paper": ROOT / "launch" / "clusters" / "paper-16gpu.toml"}
    for name, (gpus, nodes) in {"64": (64, 8), "1024": (1024, 128)}.items():
        path = folder / f"synth-{gpus}.toml"
        path.write_text(synth_cluster.to_toml(synth_cluster.synth_cluster(8, gpus, nodes)))
        out[name] = path
    return out


def run_once(config: Path, extra: list[str]) -> tuple[float, float, str, float]:
    """(seconds, peak memory in GiB, the `best:` line, CPU seconds) of one `hetpipe plan CONFIG` in a child
    process. The CPU seconds (user + system) tell what the wall time means on a loaded machine."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    before, cpu_before = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "hetpipe", "plan", str(config), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    elapsed = time.monotonic() - started
    if done.returncode:
        raise SystemExit(f"error: hetpipe plan {config} failed:\n{done.stderr[-2000:]}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    best = next((line for line in done.stdout.splitlines() if line.startswith("best: ")), "")
    # ru_maxrss of children is the largest child so far: runs go smallest cluster first
    return elapsed, max(usage.ru_maxrss, before) / 2**20, best, usage.ru_utime + usage.ru_stime - cpu_before


def check_shipped() -> int:
    """The default search's best against the exhaustive search's on every shipped config; 1 on a mismatch."""
    configs = sorted((ROOT / "launch" / "clusters").glob("*.toml")) + [
        ROOT / "hetpipe" / "clusters" / "local.toml"
    ]
    bad = 0
    for config in configs:
        lines = []
        for extra in ([], ["--exhaustive"]):
            _, _, best, _ = run_once(config, ["--set", "emulation.enabled=false", *extra])
            lines.append(best)
        same = lines[0] == lines[1]
        bad += not same
        print(
            f"{config.relative_to(ROOT)}: {'same' if same else 'DIFFERENT'}\n"
            f"  fast:       {lines[0]}\n  exhaustive: {lines[1]}"
        )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", default="paper,64,1024")
    parser.add_argument("--check", action="store_true")
    parser.add_argument(
        "--peer", action="store_true", help="also time the exhaustive search (--exhaustive) on paper-16gpu"
    )
    args = parser.parse_args(argv)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")
    with tempfile.TemporaryDirectory() as folder:
        runs = [(name, config, []) for name, config in clusters(Path(folder)).items()]
        if args.peer:
            runs.insert(1, ("paper", runs[0][1], ["--exhaustive"]))
        for name, config, extra in runs:
            if name not in args.only.split(","):
                continue
            times, peaks, cpus, best = [], [], [], ""
            for _ in range(args.runs):
                elapsed, peak, best, cpu = run_once(config, extra)
                times.append(elapsed)
                peaks.append(peak)
                cpus.append(cpu)
            median = statistics.median(times)
            verdict = "met" if median < TARGETS[name] and max(peaks) < MEMORY_TARGET_GIB else "NOT met"
            if extra:
                verdict = "the peer, no target"
            print(
                f"{name:>5}{' '.join(['', *extra])}: median {median:.2f} s "
                f"(spread {min(times):.2f}-{max(times):.2f} s, "
                f"{args.runs} runs; CPU {statistics.median(cpus):.2f} s), "
                f"peak memory {max(peaks):.2f} GiB; target < {TARGETS[name]:g} s: {verdict}\n       {best}"
            )
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    return check_shipped() if args.check else 0


if __name__ == "__main__":
    sys.exit(main())

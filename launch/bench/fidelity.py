"""Simulator fidelity: the planner's predicted samples/s against `hetpipe train` measured on this machine.

For each cluster config: profile the model on this CPU (cached), let the planner plan the config's own
policy with the config's Nm and D, simulate that plan for the config's waves, then train it with
`hetpipe train --plan` and compare. Both rates are taken over the same window by the same function
(throughput.window_rate, as the throughput benchmark does): from the end of every VW's first wave to the
end of the first VW's last minibatch, on the simulated events and on the run's traces alike. The first
wave is left out because the runtime's first minibatches pay one-off costs (lazy initialisation, allocator
growth: ~1 s of a 10 s run here, stretched by the slowdown) that a profile of warm layers does not hold.

    python launch/bench/fidelity.py CONFIG [CONFIG ...] [--out fidelity.json] [--plot FILE.png]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plots  # noqa: E402  (launch/bench is not a package)
import throughput  # noqa: E402

from hetpipe.app.plan_inputs import default_profile_dir  # noqa: E402
from hetpipe.compute.profiler import cached_profile  # noqa: E402
from hetpipe.core.config.files import load_config  # noqa: E402
from hetpipe.core.hardware.emulate import cpu_cores  # noqa: E402
from hetpipe.core.planning.planner import (  # noqa: E402
    EMULATED_P2P_GBPS,
    EMULATED_PS_GBPS,
    emulated_profiles,
    plan_candidates,
)
from hetpipe.core.planning.simulate import simulate  # noqa: E402
from hetpipe.models import get_model  # noqa: E402


def predict(config_path: Path, plan_out: Path) -> dict:
    config = load_config(config_path)
    if not config.emulation.enabled:
        raise SystemExit(
            f"{config_path}: fidelity is measured under emulation; set [emulation] enabled = true"
        )
    spec = get_model(config.model.name, **config.model.options.to_dict())
    torch.set_num_threads(1)
    cpu = cached_profile(
        spec, config.train.batch_size, "cpu", default_profile_dir(), optimizer=config.train.optimizer
    )
    profiles = emulated_profiles(config, cpu, cpu_cores())
    policy = config.allocation.policy
    candidates = plan_candidates(
        config,
        profiles,
        ps_gbps=EMULATED_PS_GBPS,
        link_gbps=lambda a, b: EMULATED_P2P_GBPS,
        policies=[policy],
        d_values=(config.wsp.staleness,),
        nm_max=config.wsp.nm,
        baselines=False,
    )
    chosen = next(c for c in candidates if c.runnable and c.staleness == config.wsp.staleness)
    plan = chosen.plan
    plan_out.write_text(plan.to_json())
    sim = simulate(plan, waves=config.train.waves, ps_gbps=EMULATED_PS_GBPS, ps_shards=config.ps.shards)
    last = {v: len(vw.stages) - 1 for v, vw in enumerate(plan.vws)}
    streams = {
        v: sorted(e.end for e in sim.events if e.vw == v and e.action.kind == "B" and e.stage == last[v])
        for v in last
    }
    rate = throughput.window_rate(
        streams,
        {v: vw.batch(plan.batch_size) for v, vw in enumerate(plan.vws)},
        {v: throughput.WARMUP_WAVES * vw.nm for v, vw in enumerate(plan.vws)},
    )
    return {
        "config": str(config_path),
        "batch_size": config.train.batch_size,
        "policy": policy,
        "nm": chosen.nm,
        "work": [[vw.nm, vw.batch(plan.batch_size)] for vw in plan.vws],
        "staleness": chosen.staleness,
        "vws": [list(vw.gpus) for vw in plan.vws],
        "splits": [list(vw.split) for vw in plan.vws],
        "predicted_samples_per_s": round(rate, 2),
        "predicted_steady_samples_per_s": round(chosen.samples_per_s, 2),
    }


@click.command()
@click.argument(
    "configs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write JSON rows here."
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="PNG plot (needs matplotlib, the `bench` extra); default: --out with .png.",
)
def main(configs: tuple[Path, ...], out: Path | None, plot_path: Path | None) -> None:
    work = Path(tempfile.mkdtemp(prefix="hetpipe-fidelity-"))
    rows = []
    print(
        f"{'config':<28} {'policy':>6} {'nm':>3} {'D':>2} {'predicted':>10} {'measured':>9} {'error':>7}",
        flush=True,
    )
    for config_path in configs:
        plan_path = work / f"{config_path.stem}.plan.json"
        row = predict(config_path, plan_path)
        summary_path = work / f"{config_path.stem}.summary.json"
        cmd = [
            sys.executable,
            "-m",
            "hetpipe",
            "train",
            str(config_path),
            "--plan",
            str(plan_path),
            "--quiet",
            "--summary",
            str(summary_path),
            "--run-dir",
            str(work / f"run-{config_path.stem}"),
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"{config_path}: hetpipe train failed:\n{result.stderr[-3000:]}")
        summary = json.loads(summary_path.read_text())
        measured = throughput.window_rate(
            throughput.trace_streams(work / f"run-{config_path.stem}"),
            row["batch_size"],
            throughput.WARMUP_WAVES * row["nm"],
        )
        row["measured_samples_per_s"] = round(measured, 2)
        row["measured_whole_run_samples_per_s"] = summary["samples_per_s"]
        row["error"] = round(row["predicted_samples_per_s"] / measured - 1, 4)
        rows.append(row)
        print(
            f"{config_path.name:<28} {row['policy']:>6} {row['nm']:>3} {row['staleness']:>2} "
            f"{row['predicted_samples_per_s']:>10.1f} {row['measured_samples_per_s']:>9.1f} "
            f"{row['error']:>+7.1%}",
            flush=True,
        )
    if out is not None:
        out.write_text(json.dumps(rows, indent=1))
        print(f"wrote {out}")
    png = plot_path or (out.with_suffix(".png") if out else None)
    if png is not None:
        series = {
            "predicted": [r["predicted_samples_per_s"] for r in rows],
            "measured": [r["measured_samples_per_s"] for r in rows],
        }
        print(
            plots.paired_bars(
                [Path(r["config"]).stem for r in rows],
                series,
                "samples/s",
                "planner's simulator vs hetpipe train",
                png,
            )
        )


if __name__ == "__main__":
    main()

"""PS placement benchmark: the same VWs with [ps] placement "balanced" (every shard on the PS node) and
"local" (ED-local: a shard on every node, each layer on the node that runs it), side by side in one
shaped-network testbed, interleaved repeats; with the planner's prediction for each
(docs/ps-protocol.md#placement).

    python launch/bench/placement.py [--config launch/clusters/bench-vgg.toml] [--repeats 3] [--seconds 40]
        [--policy ed] [--set K=V ...] [--out placement.json]

The VWs are the planner's for one allocation policy (--policy, default ed: every VW one GPU of every type, the
grouping ED-local is for; explicit: the config's own VWs), with their order, split, Nm and schedule planned
for each placement over the testbed's links (D: the config's). Needs root and `ip netns` (docs/testbed.md).

With "balanced" on bench-vgg.toml every pull of the n1 and n2 stages crosses n0's shaped link, and a pull
parked at the gate can wait longer than [ps] timeout_s's 60 s for the other VW's wave (seen once in three
runs): give `--set ps.timeout_s=300`. A failed run is kept as a row and left out of the medians.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (launch/bench is not a package)
import throughput  # noqa: E402
from testbed_options import profile_option  # noqa: E402

from hetpipe.core.config.files import load_config  # noqa: E402
from hetpipe.core.config.overrides import apply_overrides  # noqa: E402
from hetpipe.core.config.schema import ClusterConfig  # noqa: E402
from hetpipe.core.errors import HetpipeError  # noqa: E402
from hetpipe.core.planning import planner  # noqa: E402

PLACEMENTS = ("balanced", "local")


def placement_settings(config: ClusterConfig, placement: str) -> list[str]:
    """--set overrides for `placement`: "local" runs one shard per node, "balanced" keeps the config's
    shards."""
    shards = (
        len(config.nodes)
        if placement == "local"
        else (config.ps.shards if config.ps.placement != "local" else 1)
    )
    return [f'ps.placement="{placement}"', f"ps.shards={shards}"]


def predicted(config: ClusterConfig, profile: Any, topology: Any, policy: str) -> planner.Candidate:
    """The planner's best candidate of allocation `policy`, over the testbed's links."""
    profiles = planner.emulated_profiles(config, profile, peers.cpu_cores())
    ps_gbps, link, network = throughput.planner_links(topology)
    found = planner.plan_candidates(
        config,
        profiles,
        ps_gbps=ps_gbps,
        link_gbps=link,
        ps_network=network,
        policies=[policy],
        d_values=(config.wsp.staleness,),
        baselines=False,
    )
    return planner.best(found)


@click.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=Path(__file__).resolve().parents[1] / "clusters" / "bench-vgg.toml",
    show_default=True,
)
@click.option(
    "--repeats", type=int, default=3, show_default=True, help="Runs of each placement (interleaved)."
)
@click.option(
    "--seconds", type=float, default=40.0, show_default=True, help="Measured seconds per run (about)."
)
@click.option(
    "--policy",
    type=click.Choice(["ed", "hd", "np", "explicit"]),
    default="ed",
    show_default=True,
    help="Allocation policy whose VWs both placements run (explicit: the config's [[virtual_workers]]).",
)
@click.option(
    "--set", "settings", multiple=True, help="Config override SECTION.KEY=VALUE (TOML value), repeatable."
)
@click.option(
    "--testbed-scale",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Link scale (default: derived, docs/testbed.md).",
)
@click.option("--probe-seconds", type=click.FloatRange(min=0.5), default=1.5, show_default=True)
@profile_option
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("runs/bench/placement"),
    show_default=True,
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write JSON here.")
def main(
    config_path: Path,
    repeats: int,
    seconds: float,
    policy: str,
    settings: tuple[str, ...],
    testbed_scale: float | None,
    probe_seconds: float,
    cached_profile: bool,
    work_dir: Path,
    out: Path | None,
) -> None:
    """Measure hetpipe's samples/s with each PS placement on the same VWs in the testbed."""
    try:
        with contextlib.ExitStack() as stack:
            _main(
                config_path,
                repeats,
                seconds,
                policy,
                settings,
                testbed_scale,
                probe_seconds,
                cached_profile,
                work_dir,
                out,
                stack,
            )
    except HetpipeError as exc:
        raise click.ClickException(str(exc)) from None


def _main(
    config_path: Path,
    repeats: int,
    seconds: float,
    policy: str,
    settings: tuple[str, ...],
    testbed_scale: float | None,
    probe_seconds: float,
    cached_profile: bool,
    work_dir: Path,
    out: Path | None,
    stack: contextlib.ExitStack,
) -> None:
    started = time.monotonic()
    config = apply_overrides(load_config(config_path), settings)
    if policy == "explicit" and not config.virtual_workers:
        raise click.UsageError(
            f"{config_path} lists no [[virtual_workers]]: give the VWs to compare (e.g. ED ones)"
        )
    cache = work_dir / "profiles"
    profile = peers.model_profile(config, config.train.batch_size, cache, refresh=not cached_profile)
    topology, record = throughput.open_testbed(config, cache, testbed_scale, probe_seconds, stack)
    configs = {p: apply_overrides(config, placement_settings(config, p)) for p in PLACEMENTS}
    setups, predictions = {}, {}
    for name, cfg in configs.items():
        top = predicted(cfg, profile, topology, policy)
        predictions[name] = top.samples_per_s
        setups[name] = throughput.HetpipeSetup.of_plan(
            top.plan, cfg.train.batch_size, f"planner: {top.label}", top.samples_per_s
        )
        print(
            f"{name}: {setups[name].label}; predicted {top.samples_per_s:.1f} samples/s ({top.bottleneck})",
            flush=True,
        )
    rows: list[dict[str, Any]] = []
    runs = iter(range(10**6))
    for repeat in range(repeats):
        for name in PLACEMENTS:
            setup, cfg = setups[name], configs[name]
            per_wave = setup.samples_per_wave(cfg.train.batch_size)
            waves = throughput.warmup_waves(setup.staleness, len(setup.vws)) + max(
                5, math.ceil(seconds * (setup.predicted or 1.0) * 0.8 / per_wave)
            )
            run_dir = (work_dir / time.strftime("%Y%m%d-%H%M%S") / f"{name}-{next(runs)}").resolve()
            try:
                summary, rate = throughput.run_hetpipe(
                    throughput.hetpipe_config(cfg, setup, waves, run_dir), setup, run_dir, topology
                )
            except HetpipeError as exc:  # kept as a failed row: the other runs still count
                rows.append(
                    {
                        "placement": name,
                        "repeat": repeat,
                        "samples_per_s": None,
                        "waves": waves,
                        "error": str(exc).splitlines()[-1],
                    }
                )
                print(
                    f"  repeat {repeat} {name}: FAILED ({rows[-1]['error']}; logs in {run_dir / 'logs'})",
                    flush=True,
                )
                continue
            rows.append(
                {
                    "placement": name,
                    "repeat": repeat,
                    "samples_per_s": round(rate, 2),
                    "waves": waves,
                    "wall_s": round(summary["wall_s"], 1),
                    "egress_bytes": summary["egress_bytes"],
                }
            )
            sent = ", ".join(f"{n} {b / 1e6:.1f}" for n, b in summary["egress_bytes"].items())
            print(
                f"  repeat {repeat} {name}: {rate:.1f} samples/s ({waves} waves, {summary['wall_s']:.0f} s; "
                f"MB sent per node: {sent})",
                flush=True,
            )
    result = summarise(rows, predictions)
    print(format_table(result, setups))
    if out is not None:
        out.write_text(
            json.dumps(
                {
                    "config": str(config_path),
                    "policy": policy,
                    "settings": list(settings),
                    "meta": peers.env_note(),
                    "setups": {
                        n: {"vws": s.vws, "nm": s.nm, "staleness": s.staleness, "schedule": s.schedule}
                        for n, s in setups.items()
                    },
                    "testbed": record,
                    "rows": rows,
                    **result,
                    "wall_s": round(time.monotonic() - started, 1),
                },
                indent=1,
            )
        )
        print(f"wrote {out}")


def summarise(rows: list[dict[str, Any]], predictions: dict[str, float]) -> dict[str, Any]:
    """Median (min-max) per placement, the local/balanced ratio within each repeat, and each prediction's
    ratio to the measured median."""
    out: dict[str, Any] = {"placements": {}, "ratio_local_over_balanced": None}
    for name in PLACEMENTS:
        rates = [
            r["samples_per_s"] for r in rows if r["placement"] == name and r["samples_per_s"] is not None
        ]
        failed = sum(1 for r in rows if r["placement"] == name and r["samples_per_s"] is None)
        median = statistics.median(rates) if rates else None
        out["placements"][name] = {
            "median": median,
            "min": min(rates, default=None),
            "max": max(rates, default=None),
            "failed": failed,
            "predicted": round(predictions[name], 2),
            "predicted_over_measured": round(predictions[name] / median, 3) if median else None,
        }
    by_repeat: dict[int, dict[str, float]] = {}
    for r in rows:
        by_repeat.setdefault(r["repeat"], {})[r["placement"]] = r["samples_per_s"]
    ratios = [v["local"] / v["balanced"] for v in by_repeat.values() if v.get("balanced") and v.get("local")]
    if ratios:
        out["ratio_local_over_balanced"] = {
            "median": round(statistics.median(ratios), 3),
            "min": round(min(ratios), 3),
            "max": round(max(ratios), 3),
        }
    return out


def format_table(result: dict[str, Any], setups: dict[str, throughput.HetpipeSetup]) -> str:
    lines = [
        "| placement | VWs | samples/s, median (min-max) | predicted | predicted / measured |",
        "|---|---|---:|---:|---:|",
    ]
    for name, p in result["placements"].items():
        measured = "-" if p["median"] is None else f"{p['median']:.1f} ({p['min']:.1f}-{p['max']:.1f})"
        measured += f", {p['failed']} failed" if p["failed"] else ""
        label = setups[name].label.replace(" | ", "; ")  # a VW separator would split the Markdown row
        lines.append(
            f"| {name} | {label} | {measured} | {p['predicted']:.1f} | {p['predicted_over_measured']} |"
        )
    ratio = result["ratio_local_over_balanced"]
    if ratio:
        lines.append(
            f"\nlocal / balanced, within each repeat: {ratio['median']} ({ratio['min']}-{ratio['max']})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

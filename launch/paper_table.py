"""The README's paper-cluster table: predicted throughput of NP/ED/HD, the baselines and 12 vs 16 GPUs, from a
CPU profile.

We have no GPU, so per-type times are derived, not measured (docs/planning.md#the-papers-cluster): each model
is profiled once on this CPU (one thread) at a small batch, scaled linearly to batch 32 (times and activation
bytes; weights unchanged), taken as the TITAN V's times after a FLOPS conversion (x cpu_tflops / 14.9: the GPU
is assumed to reach the same share of its FP32 peak as this CPU does of its own), and scaled to the other
types by FP32 TFLOPS. Links and the PS use the paper's bandwidths. Absolute samples/s are therefore
"CPU-profile units scaled by FP32 TFLOPS": compare ratios, not values.

    .venv/bin/python launch/paper_table.py [--profile-batch 4] [--cpu-tflops 0.21] [--models resnet152 vgg19]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from hetpipe.core.config.files import load_config
from hetpipe.core.config.schema import ClusterConfig, ModelConfig
from hetpipe.core.errors import HetpipeError
from hetpipe.core.planning.planner import (
    ALLREDUCE,
    SYNC_PIPELINE,
    Candidate,
    best,
    plan_candidates,
    supplied_profiles,
)
from hetpipe.core.planning.profile import ModelProfile, derive_profile

CONFIG = Path(__file__).parent / "clusters" / "paper-16gpu.toml"
REFERENCE = "titan-v"


def reference_profile(
    model: str, config: ClusterConfig, profile_batch: int, cpu_tflops: float, cache: Path
) -> ModelProfile:
    """The model's TITAN V profile at the config's batch size, derived from a CPU profile as the module
    says."""
    import torch

    from hetpipe.compute.profiler import cached_profile, profile_cache_path
    from hetpipe.models import get_model

    torch.set_num_threads(1)
    spec = get_model(model)
    path = profile_cache_path(spec, profile_batch, "cpu", cache, optimizer=config.train.optimizer)
    if not path.exists():
        print(
            f"profiling {model} at batch {profile_batch} on this CPU (once; cached in {cache}) ...",
            file=sys.stderr,
        )
    started = time.monotonic()
    cpu = cached_profile(spec, profile_batch, "cpu", cache, optimizer=config.train.optimizer)
    print(
        f"{model}: CPU profile at batch {profile_batch} ready in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
    )
    scaled = cpu.at_batch(config.train.batch_size)  # by proportion (ModelProfile.at_batch)
    return derive_profile(scaled, config.gpu_types[REFERENCE].speed, cpu_tflops, 1.0, gpu_type=REFERENCE)


def without_node(config: ClusterConfig, gpu_type: str) -> ClusterConfig:
    return dataclasses.replace(config, nodes=tuple(n for n in config.nodes if gpu_type not in n.gpus))


def hetpipe_best(config: ClusterConfig, profiles: dict[str, ModelProfile]) -> Candidate:
    found = plan_candidates(
        config,
        {t: p for t, p in profiles.items() if any(t in n.gpus for n in config.nodes)},
        ps_gbps=config.network.inter_node_gbps,
        link_gbps=config.network.link_gbps,
        baselines=False,
    )
    return best(found)


def _shown(path: Path) -> Path:
    try:
        return path.resolve().relative_to(Path.cwd())
    except ValueError:
        return path


def cell(c: Candidate) -> str:
    if not c.feasible:
        return "does not fit"
    extra = f", D={c.staleness}, nm={c.nm}" if c.plan is not None else ""
    return f"{c.samples_per_s:.0f} ({c.gpus_used} GPUs{extra})"


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--models", nargs="+", default=["resnet152", "vgg19"])
    parser.add_argument("--profile-batch", type=int, default=4, help="batch size the CPU profile is taken at")
    parser.add_argument(
        "--cpu-tflops",
        type=float,
        default=0.21,
        help="FP32 TFLOPS this CPU stands for (docs/emulation.md#measured-limits: one-thread matmul ~0.21); "
        "14.9 = no conversion",
    )
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "hetpipe" / "profiles")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("runs/profiles/paper"),
        help="where the derived titan-v profiles go, for `hetpipe plan --profile-dir`",
    )
    args = parser.parse_args()
    base = load_config(CONFIG)
    rows = []
    details = []
    for model in args.models:
        config = dataclasses.replace(base, model=ModelConfig(model))
        reference = reference_profile(model, config, args.profile_batch, args.cpu_tflops, args.cache)
        out = args.out_dir / model / f"{REFERENCE}.json"
        reference.save(out)
        profiles, _ = supplied_profiles(config, {REFERENCE: reference})
        started = time.monotonic()
        candidates = plan_candidates(
            config, profiles, ps_gbps=config.network.inter_node_gbps, link_gbps=config.network.link_gbps
        )
        planning_s = time.monotonic() - started
        by_policy = {}
        for policy in ("np", "ed", "hd"):
            mine = [c for c in candidates if c.policy == policy]
            try:
                by_policy[policy] = best(mine)
            except HetpipeError:
                by_policy[policy] = mine[0]
        dp = next(c for c in candidates if c.policy == ALLREDUCE)
        sync = next(c for c in candidates if c.policy == SYNC_PIPELINE)
        all16 = best(candidates)
        no2060 = hetpipe_best(without_node(config, "rtx-2060"), profiles)
        nop4000 = hetpipe_best(without_node(config, "p4000"), profiles)
        rows.append(
            (model, by_policy["np"], by_policy["ed"], by_policy["hd"], dp, sync, no2060, nop4000, all16)
        )
        details.append(
            f"{model}: planned {len(candidates)} candidates in {planning_s:.2f} s; best {all16.label} "
            f"nm={all16.nm}; DP: {'; '.join(dp.notes) or 'every GPU holds the model'}\n"
            f"  the same row: hetpipe plan {_shown(CONFIG)} --profile-dir {out.parent} --explain"
            + ("" if model == base.model.name else f'  (with [model] name = "{model}")')
        )
    header = (
        "model",
        "NP",
        "ED",
        "HD",
        "DP all-reduce",
        "sync pipeline",
        "HetPipe 12 (no rtx-2060)",
        "HetPipe 12 (no p4000)",
        "HetPipe 16",
    )
    print(
        f"Predicted samples/s at batch 32 on the paper's cluster (CPU-profile units scaled by FP32 TFLOPS, "
        f"--cpu-tflops {args.cpu_tflops:g}, profile batch {args.profile_batch} scaled to 32):\n"
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for model, *cells in rows:
        print(f"| {model} | " + " | ".join(cell(c) for c in cells) + " |")
    print()
    for line in details:
        print(line)


if __name__ == "__main__":
    main()

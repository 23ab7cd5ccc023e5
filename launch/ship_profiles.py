"""Measure the profiles shipped in hetpipe/profiles/<folder>/: every model of launch/clusters/*.toml at its
batch and optimizer, plus VGG-19 (paper-16gpu.toml's other model); --all-models adds the other built-in image
models.

    .venv/bin/python launch/ship_profiles.py --folder cpu  # this CPU, one thread (what ships now)
    .venv/bin/python launch/ship_profiles.py --folder h100 --device cuda --dtype float32 --dtype bfloat16
        --all-models

On a CPU the big image models are measured at a smaller batch (CPU_BATCH: batch 32 at 224 px would take more
than 5 minutes per model on one core) and `hetpipe plan` rescales them by proportion (ModelProfile.at_batch);
on CUDA every model is measured at its config's batch. Each profile is measured as `hetpipe profile` does (one
thread, WARMUP + --repeats runs per layer, once more when noisy or busy) and records its origin; see
hetpipe/profiles/README.md. Every run also writes hetpipe/profiles/models.json, the catalog that lets `hetpipe
plan` find these profiles without importing torch; `--catalog` writes only it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from hetpipe.app.model_catalog import write_catalog
from hetpipe.app.plan_inputs import SHIPPED_DIR, shipped_name
from hetpipe.compute.profiler import profile_checked
from hetpipe.core.config.files import load_config
from hetpipe.models import get_model, model_names

CLUSTERS = Path(__file__).parent / "clusters"
EXTRA = [("vgg19", {}, 32, "momentum")]  # paper-16gpu.toml with [model] name = "vgg19"
OTHER_BUILTINS = [(name, {}, 32, "momentum") for name in ("resnet18", "resnet50", "vgg11")]
CPU_BATCH = {"resnet152": 8, "resnet50": 8, "vgg19": 4, "vgg11": 8}  # measured at this batch on a CPU


def wanted(all_models: bool) -> list[tuple[str, dict, int, str]]:
    """(model, options, batch, optimizer) of every config in launch/clusters, then EXTRA, without repeats."""
    found: list[tuple[str, dict, int, str]] = []
    for path in sorted(CLUSTERS.glob("*.toml")):
        c = load_config(path)
        found.append((c.model.name, c.model.options.to_dict(), c.train.batch_size, c.train.optimizer))
    found += EXTRA + (OTHER_BUILTINS if all_models else [])
    return [entry for i, entry in enumerate(found) if entry not in found[:i]]


def catalog_variants() -> list[tuple[str, dict]]:
    """(model, options) the catalog lists: every built-in model at its defaults, and every variant shipped."""
    variants = [(name, {}) for name in model_names()]
    variants += [(model, options) for model, options, _, _ in wanted(True)]
    return [entry for i, entry in enumerate(variants) if entry not in variants[:i]]


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--folder", help="hetpipe/profiles/<folder>: the device measured on, e.g. cpu, h100")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype", action="append", choices=["float32", "bfloat16"], help="repeatable; default float32"
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--all-models", action="store_true", help="also resnet18, resnet50 and vgg11 at 224 px"
    )
    parser.add_argument("--models", nargs="*", help="only these model names")
    parser.add_argument("--catalog", action="store_true", help="only write hetpipe/profiles/models.json")
    args = parser.parse_args()
    write_catalog(catalog_variants())
    if args.catalog:
        return
    if not args.folder:
        parser.error("--folder is required (the device measured on, e.g. cpu, h100)")
    torch.set_num_threads(1)  # as every stage process does; on CUDA it only affects the host side
    out = SHIPPED_DIR / args.folder
    for model, options, batch, optimizer in wanted(args.all_models):
        if args.models and model not in args.models:
            continue
        at = CPU_BATCH.get(model, batch) if args.device == "cpu" else batch
        for dtype in args.dtype or ["float32"]:
            started = time.monotonic()
            spec = get_model(model, **options)
            profile = profile_checked(
                spec,
                at,
                optimizer=optimizer,
                repeats=args.repeats,
                device=args.device,
                dtype=dtype,
                on_flagged=lambda p: print(
                    f"  flagged ({'; '.join(p.origin.flags)}): once more", file=sys.stderr
                ),
            )
            path = out / shipped_name(profile)
            profile.save(path)
            flags = "; ".join(profile.origin.flags) or "clean"
            print(
                f"{path.relative_to(SHIPPED_DIR.parent)}: {model} {options or ''} batch {at} "
                f"(config: {batch}) {dtype} {optimizer} in {time.monotonic() - started:.0f} s, "
                f"spread {profile.spread:.1%}, {flags}"
            )


if __name__ == "__main__":
    main()

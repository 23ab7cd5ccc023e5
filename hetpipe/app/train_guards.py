"""The checks `hetpipe train` makes before it starts anything: every stage fits its GPU's memory, the run dir
is writable and holds no earlier run's PS checkpoints, a resumed run has a wave to continue from, the options
go together. Each raises the UsageError or ConfigError that says what to change; none starts a process."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from hetpipe.compute.build import VwLayout, run_work, vw_config
from hetpipe.compute.data import check_dataset
from hetpipe.compute.sizes import model_sizes
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import ConfigError, UsageError
from hetpipe.core.pipeline.profile_window import ProfileWindow
from hetpipe.core.pipeline.resume import common_cuts
from hetpipe.core.planning.fit import changes_that_fit, common_changes, memory_error, stage_needs
from hetpipe.core.planning.memory import MemoryRule
from hetpipe.core.runs.checkpoint import CheckpointError, list_clocks, load_clock
from hetpipe.core.wsp.aggregation import AGGREGATIONS, get_aggregation
from hetpipe.core.wsp.work import sample_weights
from hetpipe.models import ModelSpec
from hetpipe.server.checkpoint import list_manifests
from hetpipe.worker.snapshot import snapshot_dir

__all__ = [
    "STATEFUL_MITIGATIONS",
    "check_memory",
    "check_options",
    "check_work",
    "check_writable_dir",
    "interrupted",
    "not_resumable",
    "refuse_earlier_checkpoints",
    "resume_point",
]

# Mitigations whose StageCompute state (beyond the optimizer's) stage snapshots do not save
# (worker/snapshot.py).
STATEFUL_MITIGATIONS = ("pipemare", "spectrain")


def check_writable_dir(directory: Path, label: str) -> None:
    """Create `directory` if needed and write a probe file in it; UsageError names the path and why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        blocker = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a directory" if blocker else (exc.strerror or str(exc))
        raise UsageError(
            f"{label} {directory}: cannot write there ({why}); choose a writable directory"
        ) from None


def _stderr(text: str) -> None:
    print(f"note: {text}", file=sys.stderr, flush=True)


def check_memory(config: ClusterConfig, spec: ModelSpec, vws: tuple[VwLayout, ...]) -> None:
    """ConfigError when a stage of a VW needs more memory than its GPU type's memory_gib (emulated GPUs
    too), naming the first such VW and the changes that make it fit: the run-wide ones ([train], [wsp]) that
    make every such VW without work of its own fit, or a VW's own."""
    memory = {g: (config.gpu(g).name, int(config.gpu(g).memory_gib * 2**30)) for lay in vws for g in lay.gpus}
    failing = []
    for v, lay in enumerate(vws):  # at each VW's own Nm and batch
        own = vw_config(config, lay)
        sizes = model_sizes(spec, own.train.batch_size, own.train.optimizer)
        rule = MemoryRule.of(own, len(vws))
        needs = [replace(need, vw=v) for need in stage_needs(sizes, [(lay.gpus, lay.split)], memory, rule)]
        if not all(n.fits for n in needs):
            fitting = changes_that_fit(sizes, (lay.gpus, lay.split), memory, rule)
            failing.append((v, lay, own, rule, needs, fitting))
    if not failing:
        return
    v, lay, own, rule, needs, fitting = failing[0]
    if not (lay.nm or lay.batch):  # its batch and Nm are the run's: a change must fit every such VW
        fitting = common_changes([f for _, other, *_, f in failing if not (other.nm or other.batch)])
    problem = memory_error(
        needs,
        model=spec.name,
        batch_size=own.train.batch_size,
        rule=rule,
        fitting=fitting,
        where=f"virtual_workers[{v}] " if lay.nm or lay.batch else "",
    )
    raise ConfigError(f"{config.path}: {problem}")


def check_work(config: ClusterConfig, vws: tuple[VwLayout, ...]) -> None:
    """UsageError for per-VW work (Nm, batch) the run cannot honour: the "average" mitigation adds a VW's own
    updates at 1 / VWs, which is its share only when every VW does the same work."""
    weights = set(sample_weights(run_work(config, vws)))
    if len(weights) > 1 and "average" in config.train.mitigations:
        raise UsageError(
            f'{config.path}: train.mitigation "average" shares each VW\'s own updates equally, but the VWs '
            "do unequal work per wave (per-VW nm or batch_size): drop the mitigation or give every VW the "
            "same nm and batch_size"
        )


def not_resumable(config: ClusterConfig) -> str | None:
    """Why a run of `config` cannot be resumed (its checkpoints are off), or None when it can."""
    if config.checkpoint.enabled and config.checkpoint.every >= 1 and config.checkpoint.stages:
        return None
    return (
        "a run can be resumed with [checkpoint] dir not empty, every >= 1 and stages = true (this config: "
        f"dir = {config.checkpoint.dir!r}, every = {config.checkpoint.every}, stages = "
        f"{str(config.checkpoint.stages).lower()})"
    )


def interrupted(config: ClusterConfig, run_dir: Path) -> str:
    """What `hetpipe train` says when Ctrl-C stopped it: how to go on, or that this run cannot."""
    why_not = not_resumable(config)
    if why_not:
        return f"interrupted: stopped the PS and every stage; this run cannot be resumed: {why_not}"
    return (
        f"interrupted: stopped the PS and every stage; go on with `hetpipe train --resume {run_dir}` (from "
        "the newest wave every shard and stage checkpointed)"
    )


def resume_point(
    config: ClusterConfig, run_dir: Path, vws: tuple[VwLayout, ...], say: Callable[[str], None] = _stderr
) -> int:
    """The newest wave every PS shard and every stage checkpointed intact in `run_dir` (a damaged newer one
    is passed over, and `say` tells which); UsageError saying what is missing when there is none."""
    why_not = not_resumable(config)
    if why_not:
        raise UsageError(f"--resume {run_dir}: {why_not}")
    stateful = [m for m in config.train.mitigations if m in STATEFUL_MITIGATIONS]
    if stateful:
        raise UsageError(
            f"--resume {run_dir}: train.mitigation {'+'.join(stateful)} keeps state that stage snapshots "
            "do not hold yet (PipeMare's moving average, SpecTrain's last step or pull), so the run would "
            "not continue as it was; start the run again without --resume"
        )
    parts = {f"PS shard {s}": run_dir / "ps" / f"shard-{s}" for s in range(config.ps.shards)}
    parts.update(
        {
            f"vw{v}-s{j}": snapshot_dir(run_dir, v, j)
            for v, lay in enumerate(vws)
            for j in range(len(lay.split))
        }
    )
    held = {name: list_clocks(directory) for name, directory in parts.items()}
    # the stages a wave's cut needs: those of the VWs inside their waves there (docs/wsp.md#planned-spans)
    spans = {
        f"vw{v}-s{j}": lay.span(config.train.waves)
        for v, lay in enumerate(vws)
        for j in range(len(lay.split))
    }

    def needed(cut: int) -> dict[str, Path]:
        return {
            name: d for name, d in parts.items() if name not in spans or spans[name][0] < cut < spans[name][1]
        }

    at_ps = common_cuts([c for name, c in held.items() if name not in spans], [])
    cuts = [cut for cut in at_ps if all(cut in held[name] for name in needed(cut))]
    if not cuts:
        kinds = {name: "clocks" if name.startswith("PS") else "waves" for name in held}
        shown = "; ".join(f"{name}: {kinds[name]} {c or 'none'}" for name, c in held.items())
        raise UsageError(
            f"--resume {run_dir}: no wave was checkpointed by every PS shard and every stage ({shown}); "
            "start a new run instead"
        )
    if cuts[0] >= config.train.waves or (run_dir / "model.pt").exists():
        raise UsageError(
            f"--resume {run_dir}: the run finished all {config.train.waves} waves already (its model.pt is "
            "written); start a new run to train further"
        )
    bad: list[str] = []
    for cut in cuts:  # the newest wave that every part holds intact
        broken = [f"{name} at {cut}: {problem}" for name, problem in _damaged(needed(cut), cut)]
        if not broken:
            if bad:
                say(f"--resume {run_dir}: from wave {cut}, not {cuts[0]}: " + "; ".join(bad))
            return cut
        bad.extend(broken)
    raise UsageError(
        f"--resume {run_dir}: no wave that every PS shard and every stage holds is intact "
        f"({'; '.join(bad)}); start a new run instead"
    )


def _damaged(parts: dict[str, Path], cut: int) -> list[tuple[str, str]]:
    """The parts whose checkpoint of `cut` does not verify (truncated, changed, unreadable), with why."""
    found = []
    for name, directory in parts.items():
        try:
            load_clock(directory, cut)
        except CheckpointError as exc:
            found.append((name, str(exc)))
    return found


def refuse_earlier_checkpoints(config: ClusterConfig, run_dir: Path) -> None:
    """A run dir that holds PS checkpoints would make the PS resume from them while the stages start at wave 0
    (stages do not resume yet), and every pull would be refused: say so before starting anything."""
    if not config.checkpoint.enabled:
        return
    found = [
        m for shard in range(config.ps.shards) for m in list_manifests(run_dir / "ps" / f"shard-{shard}")
    ]
    if found:
        raise UsageError(
            f"{run_dir} already holds PS checkpoints of an earlier run ({found[-1]}); a new run would "
            "resume the PS from them while its stages start from wave 0: continue that run with --resume, "
            "give a new "
            f"--run-dir, or remove {run_dir / 'ps'} to train from scratch there"
        )


def check_options(
    config: ClusterConfig, *, audit: bool, resuming: bool, profile: ProfileWindow | None
) -> None:
    """UsageError for options that do not go with the config: --audit where the PS runs the optimizer, --audit
    on a resumed latest-pull run, a --profile window past the run; and a dataset that cannot load (an unknown
    name or option, a missing directory), before any process starts."""
    check_dataset(config.data.name, **config.data.options.to_dict())
    if audit and not get_aggregation(config.ps.aggregation).local_optimizer:
        local = " or ".join(f'"{name}"' for name, rule in AGGREGATIONS.items() if rule.local_optimizer)
        raise UsageError(
            f'--audit proves the additive rules: ps.aggregation "{config.ps.aggregation}" applies no local '
            f"updates to tag; audit with aggregation {local}"
        )
    if audit and resuming and config.wsp.pull == "latest":
        raise UsageError(
            '--resume with --audit needs wsp.pull = "exact": a latest-pull PS cannot forget the updates '
            "of waves after the resume wave, which the VWs that were ahead then compute again"
        )
    if profile is not None:
        profile.check_fits(config.train.waves, config.wsp.nm)

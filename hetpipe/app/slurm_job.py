"""`hetpipe slurm`: write a cluster config's Slurm batch script (hetpipe.core.runs.slurm) and the effective
config it runs, into a run directory on storage every node sees."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.config.serialize import config_toml
from hetpipe.core.errors import UsageError
from hetpipe.core.planning.cluster import vw_gpus
from hetpipe.core.runs.slurm import Address, job_script, slurm_job
from hetpipe.core.runs.testbed import layout_overrides

__all__ = ["SlurmFiles", "slurm_files"]


@dataclass(frozen=True)
class SlurmFiles:
    """The batch script and the effective config, as text, and where they go."""

    script_path: Path
    script: str
    config_path: Path
    config: str


def slurm_files(
    config: ClusterConfig,
    run_dir: Path,
    *,
    plan_path: Path | None = None,
    python: str,
    address: Address = "ip",
    gres: bool | None = None,
    ps_node: str | None = None,
) -> SlurmFiles:
    """The job of `config` (with the VWs, splits, Nm, D and schedule of `plan_path`, a `hetpipe plan --out`
    file, when given) to run in `run_dir`. `gres` (default: when emulation is off) asks Slurm for each node's
    GPUs."""
    if plan_path is not None:
        from hetpipe.app.train import apply_plan

        config, layouts = apply_plan(config, plan_path)
        config = apply_overrides(
            config, layout_overrides((lay.gpus, lay.split, lay.nm, lay.batch) for lay in layouts)
        )
    groups = vw_gpus(config)
    if not groups:
        raise UsageError(
            f"{config.path}: no virtual workers: list [[virtual_workers]] or set [allocation] policy"
        )
    run_dir = run_dir.resolve()
    config_path = run_dir / "config.toml"  # as `hetpipe train` names it: export and --join read it
    job = slurm_job(config, groups, ps_node)
    script = job_script(
        job,
        config_file=str(config_path),
        run_dir=str(run_dir),
        python=python,
        address=address,
        gres=(not config.emulation.enabled) if gres is None else gres,
        shards=config.ps.shards,
        evict=config.ps.on_vw_failure == "evict",
    )
    return SlurmFiles(run_dir / "job.sbatch", script, config_path, config_toml(config))

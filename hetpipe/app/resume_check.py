"""Before `hetpipe train --resume` starts anything: the run it would continue is the one started in the run
dir (the same computing settings, --audit as at the start). Imports no torch, so a refusal comes at once."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hetpipe.core.config.files import load_config
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import UsageError

__all__ = ["RESUMABLE_CHANGES", "check_resume"]

# What a resumed run may change of the config it was started with: how it is watched and served, not what it
# computes (anything else would continue a different run from the first one's state).
RESUMABLE_CHANGES = frozenset(
    {
        "train.eval_every",
        "train.eval_samples",
        "train.out_dir",
        "ps.host",
        "ps.port",
        "ps.timeout_s",
        "ps.heartbeat_s",
        "ps.hung_after_s",
        "ps.max_restarts",
        "ps.on_vw_failure",
        "ps.keys_dir",
        "checkpoint.keep",
        "emulation.time_scale",
        "emulation.link_bandwidth",
    }
)


def check_resume(run_dir: Path, config: ClusterConfig, *, audit: bool) -> None:
    """UsageError, before any process starts, when `--resume run_dir` would continue another run than the one
    started there: a config field that changes what is computed (RESUMABLE_CHANGES lists what may change), or
    --audit given or left out unlike the first start."""
    recorded = _flat(load_config(run_dir / "config.toml").to_dict())
    now = _flat(config.to_dict())
    changed = sorted(k for k in recorded.keys() | now.keys() if recorded.get(k) != now.get(k))
    changed = [k for k in changed if k not in RESUMABLE_CHANGES]
    if changed:
        shown = "; ".join(f"{k}: {recorded.get(k)!r} -> {now.get(k)!r}" for k in changed[:5])
        raise UsageError(
            f"--resume {run_dir}: the run was started with other settings ({shown}); a resume continues the "
            "same run: drop those --set overrides (or the CONFIG argument), or start a new run"
        )
    started = run_dir / "ps.json"
    if started.exists():
        was = bool(json.loads(started.read_text()).get("audit"))
        if was != audit:
            raise UsageError(
                f"--resume {run_dir}: the run was started {'with' if was else 'without'} --audit (its "
                f"ledgers {'are' if was else 'are not'} in the PS's checkpoints): resume it "
                f"{'with' if was else 'without'} --audit"
            )


def _flat(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, Mapping) and key not in ("options", "gpu_types"):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out

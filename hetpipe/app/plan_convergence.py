"""The convergence input of `hetpipe plan`: the calibration of the config's model, batch and optimizer
(hetpipe.core.convergence), from the folder beside the shipped profiles or a file the user names."""

from __future__ import annotations

from pathlib import Path

from hetpipe.app.plan_inputs import SHIPPED_DIR
from hetpipe.core.config import ClusterConfig
from hetpipe.core.convergence import Calibration, find_calibration

__all__ = ["CALIBRATION_DIR", "plan_calibration"]

CALIBRATION_DIR = SHIPPED_DIR.parent / "calibrations"  # beside the profiles; launch/bench/staleness.py --calibrate writes here


def plan_calibration(config: ClusterConfig, path: Path | None = None,
                     folder: Path = CALIBRATION_DIR) -> tuple[Calibration | None, str]:
    """(the calibration to rank candidates by time to target, a note for the user); (None, why) without one.
    `path`: a calibration file to use whatever its model (its own note says what it was measured for)."""
    from hetpipe.compute.build import model_of
    from hetpipe.compute.profiler import options_digest
    from hetpipe.core.errors import UsageError

    if path is not None:
        try:
            cal = Calibration.load(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"--calibration {path}: not a calibration file ({exc}); write one with "
                             "launch/bench/staleness.py --calibrate PATH") from None
        return cal, (f"convergence calibration {path}: {cal.model} at batch {cal.batch_size}, {cal.optimizer}, each "
                     f"setting at its best lr of {', '.join(f'{v:g}' for v in cal.lrs)}, target {cal.metric} "
                     f"{cal.target:g}")
    spec = model_of(config)
    t = config.train
    return find_calibration(folder, spec.name, options_digest(spec), t.batch_size, t.optimizer)

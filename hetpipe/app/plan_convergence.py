"""The convergence input of `hetpipe plan`: the calibration of the config's model, batch and optimizer
(hetpipe.core.planning.convergence), from the folder beside the shipped profiles or a file the user names, and
the searches over the training rules it measured and over minibatch sizes, each priced by its own batch's
calibration."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hetpipe.app.plan_inputs import SHIPPED_DIR
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import ConfigError, UsageError
from hetpipe.core.planning.convergence import (
    Calibration,
    attach_samples,
    controls_of,
    find_calibration,
    rules_of,
)

__all__ = [
    "CALIBRATION_DIR",
    "batch_note",
    "plan_calibration",
    "plan_over_batches",
    "plan_over_rules",
    "rule_of",
    "rule_variants",
    "soonest_batch",
]

CALIBRATION_DIR = (
    SHIPPED_DIR.parent / "calibrations"
)  # beside the profiles; launch/bench/staleness.py --calibrate writes here


def plan_calibration(
    config: ClusterConfig,
    path: Path | None = None,
    folder: Path = CALIBRATION_DIR,
    target: float | None = None,
) -> tuple[Calibration | None, str]:
    """(the calibration to rank candidates by time to target, a note for the user); (None, why) without one.
    `path`: a calibration file to use whatever its model (its own note says what it was measured for);
    `target`: the one in `folder` measured to that target. The note says when the calibration was measured
    with other trainer controls (lr schedule, clipping, loss) than the config's."""
    t = config.train
    controls = controls_of(t.lr_schedule, t.clip_grad_norm, t.loss)
    cal, note = _find_calibration(config, path, folder, target, controls)
    other = cal.controls_note(controls) if cal else None
    return cal, note if other is None else f"{note}; {other}"


def _find_calibration(
    config: ClusterConfig, path: Path | None, folder: Path, target: float | None, controls: dict[str, Any]
) -> tuple[Calibration | None, str]:
    from hetpipe.app.model_catalog import model_key
    from hetpipe.core.errors import UsageError

    if path is not None:
        if target is not None:
            raise UsageError(
                f"--calibration {path} has its own target: give --calibration or --target, not both"
            )
        try:
            cal = Calibration.load(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UsageError(
                f"--calibration {path}: not a calibration file ({exc}); write one with "
                "launch/bench/staleness.py --calibrate PATH"
            ) from None
        return cal, (
            f"convergence calibration {path}: {cal.model} at batch {cal.batch_size}, {cal.optimizer}, each "
            f"setting at its best lr of {', '.join(f'{v:g}' for v in cal.lrs)}, target {cal.metric} "
            f"{cal.target:g}"
        )
    if config.model.init:  # the folder's calibrations measure training from scratch, not from these weights
        return None, (
            f"no convergence calibration for fine-tuning (model.init = {config.model.init}): the shipped "
            "ones measure training from scratch; measure one with launch/bench/staleness.py --set "
            "model.init=... --calibrate PATH (docs/convergence.md) and give --calibration PATH: ranking by "
            "samples/s alone"
        )
    # the seed too, as the calibration's run built the model (hetpipe.compute.build.model_of)
    key = model_key(config.model.name, {"seed": config.seed, **config.model.options.to_dict()})
    t = config.train
    return find_calibration(folder, key.name, key.options_digest, t.batch_size, t.optimizer, target, controls)


def rule_of(config: ClusterConfig) -> str:
    """What a config fixes of its training rule for the planner, which searches the schedule itself: the PS's
    aggregation and the mitigation."""
    return f"aggregation {config.ps.aggregation}, mitigation {config.train.mitigation}"


def rule_variants(config: ClusterConfig, calibration: Calibration | None) -> list[ClusterConfig]:
    """The config, then the config under each other training rule (aggregation, mitigations; its schedule
    first in the planner's search) the calibration measured and the config can run (a rule its validation
    refuses is left out)."""
    out = [config]
    for schedule, aggregation, mitigation in rules_of(calibration) if calibration is not None else []:
        try:
            variant = apply_overrides(
                config,
                [
                    f'train.schedule="{schedule}"',
                    f'ps.aggregation="{aggregation}"',
                    f'train.mitigation="{"+".join(mitigation) or "none"}"',
                ],
            )
        except ConfigError:
            continue
        if rule_of(variant) not in {rule_of(c) for c in out}:
            out.append(variant)
    return out


def plan_over_rules(
    config: ClusterConfig,
    calibration: Calibration | None,
    plan: Callable[[ClusterConfig], Sequence[Any]],
    best: Callable[[Sequence[Any]], Any],
    search: bool = True,
) -> tuple[list[Any], ClusterConfig, int]:
    """(the candidates with their samples to target, the config, the rules tried) of the training rule whose
    best plan reaches the target soonest by prediction: `plan(variant)` plans each of rule_variants (only the
    config without `search`), `best` ranks (hetpipe.core.planning.planner's). Without a calibration, or when
    no rule's best has a predicted time, the config's own rule."""
    found = []
    epoch = cache_epoch(config)
    for variant in rule_variants(config, calibration if search else None):
        candidates = attach_samples(
            plan(variant), calibration, variant.ps.aggregation, variant.train.mitigations
        )
        candidates = [replace(c, epoch_samples=epoch) for c in candidates] if epoch else candidates
        try:
            top = best(candidates)
        except UsageError:
            if variant is config:
                raise
            continue
        found.append((top.time_to_target_s, candidates, variant))
    timed = [f for f in found if f[0] is not None]
    _, candidates, chosen = min(timed, key=lambda f: f[0]) if timed else found[0]
    return candidates, chosen, len(found)


def cache_epoch(config: ClusterConfig) -> int:
    """The training set's samples, where the planner prices the frozen layers' cache ([train] freeze with
    freeze_cache_mib: a VW's rows are all kept an epoch after a freeze point); 0 otherwise."""
    if not (config.train.freeze and config.train.freeze_cache_mib):
        return 0
    from hetpipe.compute.build import dataset_of  # torch: only for a config that caches

    return len(dataset_of(config).train.y)


def soonest_batch(predicted: Mapping[int, float | None]) -> int | None:
    """The batch with the soonest predicted time to target (ties: the first listed); None when none has one
    (no calibration at any of them: times to target across batches cannot be compared by samples/s)."""
    timed = [(t, b) for b, t in predicted.items() if t is not None]
    return min(timed, key=lambda f: f[0])[1] if timed else None


def plan_over_batches(
    config: ClusterConfig,
    batches: Sequence[int],
    plan_batch: Callable[[ClusterConfig], tuple[list[Any], ClusterConfig, int]],
    best: Callable[[Sequence[Any]], Any],
) -> tuple[list[Any], ClusterConfig, int, dict[int, float | None]]:
    """(the candidates, the config, the rules tried, each batch's predicted time to target) of the minibatch
    size per GPU, among `batches`, whose best plan reaches the target soonest: `plan_batch(variant)` plans the
    config at one batch (plan_over_rules with that batch's calibration and profiles). A batch whose best plan
    has no predicted time (no calibration at it) is not ranked; with none ranked, the first batch's plans."""
    found: dict[int, tuple[list[Any], ClusterConfig, int]] = {}
    predicted: dict[int, float | None] = {}
    for batch in dict.fromkeys(batches or (config.train.batch_size,)):
        variant = (
            config
            if batch == config.train.batch_size
            else apply_overrides(config, [f"train.batch_size={batch}"])
        )
        found[batch] = plan_batch(variant)
        predicted[batch] = best(found[batch][0]).time_to_target_s
    chosen = soonest_batch(predicted)
    candidates, ruled, tried = found[next(iter(found)) if chosen is None else chosen]
    return candidates, ruled, tried, predicted


def batch_note(predicted: Mapping[int, float | None], chosen: int) -> str:
    """What `hetpipe plan --batch` says about the batches it weighed."""
    text = ", ".join(
        f"{b} ({'not priced: no calibration covers its plans' if t is None else f'{t:.1f} s'})"
        for b, t in predicted.items()
    )
    return f"batch per GPU: {chosen}, the soonest predicted time to target of {text}"

"""Samples to a target by training setting (docs/convergence.md): the settings the staleness study measures in
the single-process reference (launch/bench/staleness.py), the calibration file it writes beside the shipped
profiles, and the model the planner asks: `samples_to_target(calibration, setting)`, measured where the
calibration has the setting and from a fitted model elsewhere. Pure: no torch, no I/O beyond reading and
writing calibration JSON.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hetpipe.core.errors import UsageError
from hetpipe.core.pipeline.mitigation import format_mitigation, parse_mitigation
from hetpipe.core.pipeline.schedule import DEFAULT_SCHEDULE, SCHEDULES, flushing_schedule, get_schedule
from hetpipe.core.planning.candidates import ALLREDUCE, SYNC_PIPELINE
from hetpipe.core.wsp.aggregation import AGGREGATIONS, DEFAULT_AGGREGATION, get_aggregation

__all__ = [
    "CALIBRATION_VERSION",
    "DEFAULT_CONTROLS",
    "Calibration",
    "ConvergenceModel",
    "Measurement",
    "Setting",
    "attach_samples",
    "calibration_name",
    "canonical",
    "controls_of",
    "describe_fit",
    "lr_of",
    "find_calibration",
    "fit_model",
    "median_samples",
    "mitigation_ratio",
    "parse_setting",
    "parse_settings",
    "rules_of",
    "samples_to_target",
    "setting_of",
]

CALIBRATION_VERSION = 1
# the trainer controls a calibration's samples were measured with (calibrations without the field: these)
DEFAULT_CONTROLS: Mapping[str, Any] = {
    "lr_schedule": "constant",
    "clip_grad_norm": 0.0,
    "loss": "cross_entropy",
}
_SHAPE = re.compile(r"^(\d+)x(\d+)/(\d+)$")
_D = re.compile(r"^D(\d+)$")


@dataclass(frozen=True)
class Setting:
    """One way to train, as far as samples to a target go: VWs x Nm / stages per VW, the schedule, the PS's
    aggregation, the mitigations and D. Written `2x4/3:1f1b-flush:mean:spectrain:D0` (label)."""

    vws: int
    nm: int
    stages: int
    schedule: str = DEFAULT_SCHEDULE
    aggregation: str = DEFAULT_AGGREGATION
    mitigation: tuple[str, ...] = ()
    staleness: int = 0

    @property
    def label(self) -> str:
        return (
            f"{self.vws}x{self.nm}/{self.stages}:{self.schedule}:{self.aggregation}:"
            f"{format_mitigation(self.mitigation)}:D{self.staleness}"
        )

    @property
    def sequential(self) -> bool:
        """One VW, one minibatch at a time, its own optimizer: plain sequential training whatever the schedule
        says (with aggregation "server" each step waits D + 1 waves for the PS: not sequential)."""
        return self.vws == 1 and self.nm == 1 and get_aggregation(self.aggregation).local_optimizer

    def overrides(self) -> list[str]:
        """The `--set` overrides that train this setting (stages and VWs are the reference's splits)."""
        return [
            f"wsp.nm={self.nm}",
            f"wsp.staleness={self.staleness}",
            f'train.schedule="{self.schedule}"',
            f'ps.aggregation="{self.aggregation}"',
            f'train.mitigation="{format_mitigation(self.mitigation)}"',
        ]


def canonical(setting: Setting) -> Setting:
    """The simplest setting that trains bit for bit the same weights (docs/convergence.md#where-samples-go):
    - one VW, Nm 1, its own optimizer: sequential training (every schedule and mitigation reduces to it);
    - gpipe is 1f1b-flush (the same gradient accumulation); flushes do not depend on the number of stages, and
      their mitigations that act on local lag (spectrain, pipemare) have none to act on;
    - aggregation "server": the VWs' weights move only at pulls, so schedule and stages do not matter (weights
      stashed): 1f1b-flush on 1 stage;
    - one VW with local optimizers skips every pull: D, mean vs sum, warmup and average do nothing;
    - so one such VW under pipedream is wsp at Nm = min(Nm, stages) (the same F, B and U; only the pushes fall
      elsewhere), unless pipemare counts its warm-up in waves;
    - pipedream at Nm <= stages is wsp, any VWs (its depth min(Nm, stages) is Nm: the same actions, waves
      and pushes);
    - at Nm 1 nothing is ever in flight across an update, so wsp and the flushes are one schedule and the
      stage count does not matter (unless spectrain or pipemare, which this does not claim for).
    Each step reads the schedule's and the aggregation rule's traits (at_depth_of, trains_as, drains, own_lag;
    local_optimizer), so a registered schedule or rule is canonicalised by what it is, not by its name.
    """
    s = setting
    local = get_aggregation(s.aggregation).local_optimizer
    depth_of = get_schedule(s.schedule).at_depth_of  # pipedream: wsp with min(Nm, stages) in flight
    if depth_of is not None and s.vws == 1 and local and "pipemare" not in s.mitigation:
        return canonical(replace(s, schedule=depth_of, nm=min(s.nm, s.stages)))
    if depth_of is not None and s.nm <= s.stages:
        s = replace(s, schedule=depth_of)
    if s.sequential:
        return Setting(1, 1, 1)
    trains_as = get_schedule(s.schedule).trains_as  # gpipe: 1f1b-flush
    if trains_as is not None:
        s = replace(s, schedule=trains_as)
    if not local:
        s = replace(s, schedule=flushing_schedule().name)
    if get_schedule(s.schedule).drains:
        lagless = ("spectrain", "pipemare") if local else ("pipemare",)
        s = replace(s, stages=1, mitigation=tuple(m for m in s.mitigation if m not in lagless))
    if (
        s.nm == 1
        and get_schedule(s.schedule).own_lag(s.stages, 1) == 0
        and local
        and not {"spectrain", "pipemare"} & set(s.mitigation)
    ):
        s = replace(s, schedule=DEFAULT_SCHEDULE, stages=1)
    if s.vws == 1 and local:
        s = replace(
            s,
            aggregation=DEFAULT_AGGREGATION,
            staleness=0,
            mitigation=tuple(m for m in s.mitigation if m not in ("warmup", "average")),
        )
    return s


def parse_setting(text: str, defaults: Setting | None = None) -> Setting:
    """ "2x4/3" with optional ":"-separated parts in any order: a schedule name, an aggregation (sum, mean,
    server), a mitigation ("none", "spectrain", "pipemare+warmup", ...), D<n>. Parts not given come from
    `defaults` (its VWs, Nm and stages are ignored)."""
    base = defaults or Setting(1, 1, 1)
    shape, *parts = [p.strip() for p in text.strip().split(":")]
    match = _SHAPE.match(shape)
    if not match or min(int(g) for g in match.groups()) < 1:
        raise UsageError(
            f"setting {text!r}: write VWSxNM/STAGES with positive integers, then optional "
            ":SCHEDULE :AGGREGATION :MITIGATION :D<n>, e.g. 2x4/3:1f1b-flush:mean:D0"
        )
    vws, nm, stages = (int(g) for g in match.groups())
    out = replace(base, vws=vws, nm=nm, stages=stages)
    for part in parts:
        if part in SCHEDULES:
            out = replace(out, schedule=part)
        elif part in AGGREGATIONS:
            out = replace(out, aggregation=part)
        elif _D.match(part):
            out = replace(out, staleness=int(part[1:]))
        else:
            try:
                out = replace(out, mitigation=parse_mitigation(part))
            except UsageError as exc:
                raise UsageError(
                    f"setting {text!r}: {part!r} is no schedule ({', '.join(SCHEDULES)}), aggregation "
                    f"({', '.join(AGGREGATIONS)}), D<n> or mitigation: {exc}"
                ) from None
    return out


def parse_settings(text: str, defaults: Setting | None = None) -> list[Setting]:
    """A comma list of parse_setting's forms."""
    return [parse_setting(item, defaults) for item in text.split(",") if item.strip()]


def median_samples(samples: Sequence[float | None]) -> float | None:
    """Median over seeds with a seed that never reached the target counted as infinitely many samples; None
    when the median itself did not reach it."""
    if not samples:
        return None
    value = statistics.median(math.inf if s is None else float(s) for s in samples)
    return None if math.isinf(value) else value


@dataclass(frozen=True)
class Measurement:
    """A setting measured over seeds at its learning rate `lr` (the one of the calibration's grid that needed
    the fewest samples for the first seed, `sweep`): samples to the target per seed (None: not within
    `budget`)."""

    setting: Setting
    samples: tuple[float | None, ...]
    best: tuple[float | None, ...] = ()  # per seed, the best metric reached (None: the seed was not run)
    budget: int = 0  # samples each seed trained at most
    lr: float = 0.0
    sweep: tuple[
        tuple[float, float | None], ...
    ] = ()  # (lr, samples of the first seed; None: not reached / beaten)

    @property
    def median(self) -> float | None:
        return median_samples(self.samples)

    def to_json(self) -> dict[str, Any]:
        return {
            "setting": self.setting.label,
            "lr": self.lr,
            "samples": list(self.samples),
            "median": self.median,
            "best": list(self.best),
            "budget": self.budget,
            "sweep": [list(p) for p in self.sweep],
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Measurement:
        return cls(
            parse_setting(doc["setting"]),
            tuple(doc["samples"]),
            tuple(doc.get("best", ())),
            int(doc.get("budget", 0)),
            float(doc.get("lr", 0.0)),
            tuple((float(a), b) for a, b in doc.get("sweep", ())),
        )


@dataclass(frozen=True)
class Calibration:
    """What the staleness study measured for one model variant, batch and optimizer: each setting at its best
    learning rate of the grid `lrs`."""

    model: str
    options_digest: str  # hetpipe.compute.profiler.options_digest of the model's options
    batch_size: int
    optimizer: str
    lrs: tuple[float, ...]
    metric: str  # "test_accuracy" (higher is better) or "val_loss"
    target: float
    seeds: tuple[int, ...]
    measurements: tuple[Measurement, ...]
    command: str = ""  # how it was measured
    notes: tuple[str, ...] = ()
    # [train] controls that change samples to target, as measured (controls_of); a run with others differs
    controls: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_CONTROLS))

    def controls_note(self, wanted: Mapping[str, Any]) -> str | None:
        """What to tell a user whose run's controls (controls_of) are not the ones this was measured with;
        None when they are."""
        if dict(wanted) == dict(self.controls):
            return None
        return (
            f"the calibration measured {_controls_text(self.controls)}; this config trains with "
            f"{_controls_text(wanted)}, whose samples to target it has not measured (it assumes the same): "
            "measure them with launch/bench/staleness.py --set ... --calibrate PATH and give --calibration "
            "PATH"
        )

    @property
    def sequential(self) -> Measurement | None:
        """The plain sequential run (1 VW, Nm 1): the unit of every samples factor."""
        return next((m for m in self.measurements if m.setting.sequential), None)

    def find(self, setting: Setting) -> Measurement | None:
        """The measurement of `setting` or of a setting that trains the same weights (canonical)."""
        want = canonical(setting)
        return next((m for m in self.measurements if canonical(m.setting) == want), None)

    def to_json(self) -> str:
        doc = {
            "version": CALIBRATION_VERSION,
            **{k: v for k, v in asdict(self).items() if k != "measurements"},
            "measurements": [m.to_json() for m in self.measurements],
        }
        return json.dumps(doc, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        doc = json.loads(text)
        if doc.get("version") != CALIBRATION_VERSION:
            raise ValueError(f"calibration version {doc.get('version')!r}, expected {CALIBRATION_VERSION}")
        return cls(
            doc["model"],
            doc["options_digest"],
            int(doc["batch_size"]),
            doc["optimizer"],
            tuple(float(v) for v in doc["lrs"]),
            doc["metric"],
            float(doc["target"]),
            tuple(doc["seeds"]),
            tuple(Measurement.from_json(m) for m in doc["measurements"]),
            doc.get("command", ""),
            tuple(doc.get("notes", ())),
            dict(doc.get("controls", DEFAULT_CONTROLS)),
        )

    @classmethod
    def load(cls, path: Path) -> Calibration:
        return cls.from_json(path.read_text())

    def merged(self, other: Calibration) -> Calibration:
        """This calibration with `other`'s measurements added (other's win for the same setting); ValueError
        when the two were measured with other trainer controls."""
        if dict(self.controls) != dict(other.controls):
            raise ValueError(
                f"it measured {_controls_text(self.controls)}, this run {_controls_text(other.controls)}"
            )
        keep = [m for m in self.measurements if other.find(m.setting) is None]
        return replace(
            self,
            measurements=tuple(keep) + other.measurements,
            seeds=other.seeds,
            lrs=tuple(sorted({*self.lrs, *other.lrs})),
            command="; ".join(c for c in (self.command, other.command) if c),
        )


def controls_of(lr_schedule: str, clip_grad_norm: float, loss: str) -> dict[str, Any]:
    """The [train] controls a calibration records (DEFAULT_CONTROLS' keys): they change samples to target."""
    return {"lr_schedule": lr_schedule, "clip_grad_norm": float(clip_grad_norm), "loss": loss}


def _controls_text(controls: Mapping[str, Any]) -> str:
    clip = controls.get("clip_grad_norm", 0.0)
    clipping = f"clip_grad_norm {clip:g}" if clip else "no clipping"
    return f"lr_schedule {controls.get('lr_schedule')}, {clipping}, loss {controls.get('loss')}"


def calibration_name(
    model: str,
    options_digest: str,
    batch_size: int,
    optimizer: str,
    target: float | None = None,
    controls: Mapping[str, Any] | None = None,
) -> str:
    """File name of a calibration under the calibrations folder (hetpipe/calibrations/, beside the shipped
    profiles): the model variant's default one, or with `target` one measured to that target (`-to0.97`), and
    with trainer `controls` other than DEFAULT_CONTROLS one measured with them (`-cosine`, `-clip1`,
    `-loss-mse`)."""
    suffix = "" if target is None else f"-to{target:g}"
    return f"{model}-{options_digest}-b{batch_size}-{optimizer}{suffix}{_controls_suffix(controls)}.json"


def _controls_suffix(controls: Mapping[str, Any] | None) -> str:
    c = {**DEFAULT_CONTROLS, **(controls or {})}
    parts = [] if c["lr_schedule"] == "constant" else [str(c["lr_schedule"])]
    parts += [f"clip{c['clip_grad_norm']:g}"] if c["clip_grad_norm"] else []
    parts += [] if c["loss"] == "cross_entropy" else ["loss-" + re.sub(r"[^A-Za-z0-9]+", "_", str(c["loss"]))]
    return "".join(f"-{p}" for p in parts)


def find_calibration(
    folder: Path,
    model: str,
    options_digest: str,
    batch_size: int,
    optimizer: str,
    target: float | None = None,
    controls: Mapping[str, Any] | None = None,
) -> tuple[Calibration | None, str]:
    """(the calibration of this model variant, batch and optimizer in `folder`, a note for the user); (None,
    why) without one. With `target`: the one measured to that target (the default file when its target is
    that). With `controls`: the one measured with them first, else the one without (whose note the caller
    adds: Calibration.controls_note)."""
    measured_with = ([controls] if _controls_suffix(controls) else []) + [None]  # the config's controls first
    targets = ([target] if target is not None else []) + [None]  # the target's own file first
    names = [
        calibration_name(model, options_digest, batch_size, optimizer, t, c)
        for c in measured_with
        for t in targets
    ]
    other: Calibration | None = None
    for name in names:
        if not (folder / name).is_file():
            continue
        cal = Calibration.load(folder / name)
        if target is None or math.isclose(cal.target, target):
            return cal, (
                f"convergence calibration {name}: target {cal.metric} {cal.target:g}, "
                f"{len(cal.measurements)} settings, each at its best lr of "
                f"{', '.join(f'{v:g}' for v in cal.lrs)} (samples to target assume it); "
                f"{describe_fit(fit_model(cal))}"
            )
        other = other or cal
    to = "" if target is None else f" to target {target:g}"
    have = "" if other is None else f" (there is one to {other.metric} {other.target:g})"
    return None, (
        f"no convergence calibration for {model} ({options_digest}) at batch {batch_size} with {optimizer}"
        f"{to} in {folder}{have}: ranking by samples/s alone (docs/convergence.md: how to measure one)"
    )


def describe_fit(model: ConvergenceModel | None) -> str:
    """One line on the fitted model: its coefficients and errors, or why there is none."""
    if model is None:
        return (
            "no fitted model (fewer than three reached settings without mitigations): "
            "unmeasured settings unknown"
        )
    coef = ", ".join(f"{k} {v:+.3f}" for k, v in model.coefficients.items())
    return (
        f"fitted model over {model.points} settings ({coef}): leave-one-out error up to "
        f"{model.fit_error:.0%}, in-sample rms {model.rms_log:.2f} in log samples"
    )


# ---------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class ConvergenceModel:
    """log(samples / sequential samples) = sum of coefficients x features (`features`), least squares over a
    calibration's reached settings with the staleness features' coefficients >= 0 (`_costs_fit`);
    `fit_error` is the largest |predicted / measured - 1| over them when each is left out of its own fit
    (leave-one-out), `rms_log` the in-sample root mean square of the log error."""

    coefficients: Mapping[str, float]
    fit_error: float
    rms_log: float
    points: int
    residuals: Mapping[str, float] = field(
        default_factory=dict
    )  # setting label -> predicted / measured - 1 (LOO)
    span: Mapping[str, float] = field(default_factory=dict)  # feature -> the largest value a fitted point has

    def factor(self, setting: Setting) -> float:
        x = features(canonical(setting))
        return math.exp(sum(self.coefficients.get(k, 0.0) * v for k, v in x.items()))

    def unseen(self, setting: Setting) -> list[str]:
        """The setting's features the fit cannot price: those it has no coefficient for (no reached point had
        them, or too few points to fit them: a factor would count them as free) and those beyond the largest
        value a fitted point had (an exponential fit extrapolated runs away), each named with its value."""
        out = []
        for k, v in features(canonical(setting)).items():
            if v != 0.0 and k not in self.coefficients:
                out.append(k)
            elif v > self.span.get(k, 0.0) * (1 + 1e-9) + 1e-12:
                out.append(f"{k} {v:g} (calibrated up to {self.span.get(k, 0.0):g})")
        return out


def features(setting: Setting) -> dict[str, float]:
    """What the fitted model sees of a setting (docs/convergence.md#calibration-and-the-fitted-model)."""
    s = setting
    kind, rule = get_schedule(s.schedule), get_aggregation(s.aggregation)
    per_update = s.nm if kind.update_every == "wave" else 1  # minibatches in one local update
    global_batch = per_update * (s.vws if rule.share == "mean" else 1)
    # own minibatches whose updates a forward misses at stage 0 (ScheduleKind.own_lag: wsp Nm - 1, pipedream
    # min(Nm, stages) - 1, pipedream-2bw about a wave, flushes none); none where the PS runs the optimizer
    # (weights move only at pulls)
    local_lag = float(kind.own_lag(s.stages, s.nm)) if rule.local_optimizer else 0.0
    # other VWs' updates a minibatch misses, in minibatches of one VW: a wave and a half on average, plus D
    # waves
    global_lag = (s.vws - 1) * s.nm * (1.5 + s.staleness) if s.vws > 1 else 0.0
    return {
        "log_batch": math.log2(global_batch),
        "local_lag": local_lag,
        "global_lag": global_lag,
        # every VW's update applied whole: n VWs take n steps' worth
        "sum_overshoot": math.log2(s.vws) if rule.local_optimizer and rule.share == "whole" else 0.0,
    }


def fit_model(calibration: Calibration, names: Iterable[str] | None = None) -> ConvergenceModel | None:
    """Least squares (no intercept: the sequential setting has every feature 0) of log samples factors on the
    features (those some point has, in the order given, at most one fewer than the points); None without a
    reached sequential run or with fewer than two other reached settings."""
    seq = calibration.sequential
    if seq is None or seq.median is None:
        return None
    points = [
        (canonical(m.setting), math.log(m.median / seq.median))
        for m in calibration.measurements
        if m.median is not None and m is not seq and not canonical(m.setting).mitigation
    ]
    keys = list(names) if names is not None else ["log_batch", "local_lag", "global_lag", "sum_overshoot"]
    keys = [k for k in keys if any(features(s)[k] != 0.0 for s, _ in points)][: max(0, len(points) - 1)]
    if not keys:
        return None
    coef = _costs_fit(points, keys)
    rms = math.sqrt(sum((_predict(coef, s) - y) ** 2 for s, y in points) / len(points))
    residuals = {}
    for i, (s, y) in enumerate(points):
        rest = points[:i] + points[i + 1 :]
        loo = _costs_fit(rest, keys)
        residuals[s.label] = math.exp(_predict(loo, s) - y) - 1.0
    worst = max((abs(r) for r in residuals.values()), default=0.0)
    span = {k: max(features(s)[k] for s, _ in points) for k in keys}
    return ConvergenceModel(coef, worst, rms, len(points), residuals, span)


# features that can only cost samples: staleness and summed steps' overshoot never make training need fewer
# (a least-squares fit over noisy medians can give them a negative sign, which the planner would then follow
# to the stalest plans it can find)
COST_FEATURES = ("local_lag", "global_lag", "sum_overshoot")


def _costs_fit(points: Sequence[tuple[Setting, float]], keys: Sequence[str]) -> dict[str, float]:
    """Least squares with COST_FEATURES' coefficients >= 0: while one comes out negative, the most negative
    is fixed at 0 and the rest refitted (an active set; four features at most). A fixed feature keeps its
    coefficient, 0: the fit has seen it and found it costs nothing measurable."""
    free = list(keys)
    while True:
        coef = _least_squares(points, free)
        negative = [k for k in free if k in COST_FEATURES and coef[k] < 0.0]
        if not negative:
            return {k: coef.get(k, 0.0) for k in keys}
        free.remove(min(negative, key=lambda k: coef[k]))
        if not free:
            return dict.fromkeys(keys, 0.0)


def _predict(coef: Mapping[str, float], setting: Setting) -> float:
    x = features(canonical(setting))
    return sum(coef.get(k, 0.0) * x[k] for k in coef)


def _least_squares(points: Sequence[tuple[Setting, float]], keys: Sequence[str]) -> dict[str, float]:
    """Normal equations with a tiny ridge (keeps a feature every point has 0 of, or two collinear ones,
    finite)."""
    n = len(keys)
    a = [[0.0] * n for _ in range(n)]
    b = [0.0] * n
    for s, y in points:
        x = features(canonical(s))
        for i, ki in enumerate(keys):
            b[i] += x[ki] * y
            for j, kj in enumerate(keys):
                a[i][j] += x[ki] * x[kj]
    for i in range(n):
        a[i][i] += 1e-6
    return dict(zip(keys, _solve(a, b), strict=True))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (n is 4 at most)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col and m[col][col]:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] if m[i][i] else 0.0 for i in range(n)]


def samples_to_target(
    calibration: Calibration, setting: Setting, model: ConvergenceModel | None = None
) -> tuple[float | None, str]:
    """(samples to the calibration's target for `setting`, where the number comes from): the measured median
    when the calibration has the setting ("measured", None when it did not get there), else the sequential
    samples x the fitted model's factor ("fitted") when the fit has a coefficient for every feature the
    setting has, within the values it saw (ConvergenceModel.unseen); (None, why) when neither can answer."""
    found = calibration.find(setting)
    if found is not None:
        return (
            found.median,
            f"measured at lr {found.lr:g}" if found.median is not None else "measured: not reached",
        )
    seq = calibration.sequential
    if seq is None or seq.median is None:
        return None, "no sequential run in the calibration"
    fitted = model if model is not None else fit_model(calibration)
    if fitted is None:
        return None, "too few reached settings to fit a model"
    want = canonical(setting)
    plain = replace(want, mitigation=())
    ratio, source = 1.0, "fitted"
    if want.mitigation:
        ratio_of = mitigation_ratio(calibration, want)
        if ratio_of is None:
            return None, f"fitted, but no measurement of {format_mitigation(want.mitigation)} to scale it by"
        ratio, pairs = ratio_of
        source = (
            f"fitted x {format_mitigation(want.mitigation)} ratio of {pairs} pair{'s' if pairs > 1 else ''}"
        )
    found = calibration.find(plain)
    if found is not None and found.median is not None:
        return found.median * ratio, source.replace("fitted", "measured")
    unseen = fitted.unseen(plain)
    if unseen:
        return None, f"unknown: the fit has not seen {', '.join(unseen)} (calibrate a setting that has it)"
    return seq.median * fitted.factor(plain) * ratio, source


def lr_of(calibration: Calibration, setting: Setting) -> float | None:
    """The learning rate the calibration measured `setting` at (its best of the grid), or None."""
    found = calibration.find(setting)
    return None if found is None else found.lr


def mitigation_ratio(calibration: Calibration, setting: Setting) -> tuple[float, int] | None:
    """(median over measured pairs of samples with the setting's mitigations / samples without, pairs): pairs
    of the same schedule and aggregation when there are any, else every pair with these mitigations; None
    without one. A mitigated run that did not get there counts as the run's budget (a lower bound)."""
    want = canonical(setting)
    pairs: list[tuple[Setting, float]] = []
    for m in calibration.measurements:
        s = canonical(m.setting)
        if s.mitigation != want.mitigation:
            continue
        plain = calibration.find(replace(s, mitigation=()))
        if plain is None or plain.median is None:
            continue
        value = m.median if m.median is not None else float(m.budget or math.inf)
        pairs.append((s, value / plain.median))
    close = [r for s, r in pairs if (s.schedule, s.aggregation) == (want.schedule, want.aggregation)]
    chosen = close or [r for _, r in pairs]
    if not chosen or math.isinf(statistics.median(chosen)):
        return None
    return statistics.median(chosen), len(chosen)


# ----------------------------------------------------------------------------------------- the planner's hook


def setting_of(candidate: Any, aggregation: str, mitigation: tuple[str, ...]) -> Setting | None:
    """The training setting a planner candidate runs, for samples to target: a hetpipe plan's VWs, Nm (the
    largest VW's), stages (the deepest VW's), schedule and D with the config's aggregation and mitigations;
    all-reduce over G GPUs is gradient accumulation of G minibatches (1xG/1 with a flush schedule); the
    synchronous pipeline is sequential training (1x1/1); None for a candidate that cannot run."""
    if not candidate.feasible:
        return None
    if candidate.policy == ALLREDUCE:
        return Setting(1, max(1, candidate.gpus_used), 1, flushing_schedule().name)
    if candidate.policy == SYNC_PIPELINE:
        return Setting(1, 1, 1)
    plan = candidate.plan
    if plan is None:
        return None
    stages = max(len(vw.stages) for vw in plan.vws)
    nm = max(vw.nm for vw in plan.vws)  # per-VW work: priced at the largest Nm, the most staleness
    return Setting(len(plan.vws), nm, stages, plan.schedule, aggregation, mitigation, plan.staleness)


def attach_samples(
    candidates: Sequence[Any], calibration: Calibration | None, aggregation: str, mitigation: tuple[str, ...]
) -> list[Any]:
    """The planner's candidates with samples_to_target and samples_source filled in from `calibration` (then
    hetpipe.core.planning.planner.best ranks them by predicted time to target); unchanged without a
    calibration."""
    if calibration is None:
        return list(candidates)
    model = fit_model(calibration)
    out = []
    for c in candidates:
        setting = setting_of(c, aggregation, mitigation)
        if setting is None:
            out.append(c)
            continue
        samples, source = samples_to_target(calibration, setting, model)
        out.append(replace(c, samples_to_target=samples, samples_source=source))
    return out


def rules_of(calibration: Calibration) -> list[tuple[str, str, tuple[str, ...]]]:
    """The training rules (schedule, aggregation, mitigations) the calibration measured, with any number of
    VWs, in file order: what a search over rules can rank by predicted time to target (a rule measured on one
    VW prices the planner's one-VW plans; its several-VW plans stay unknown unless the fit has seen what they
    add)."""
    out: list[tuple[str, str, tuple[str, ...]]] = []
    for m in calibration.measurements:
        s = m.setting
        rule = (s.schedule, s.aggregation, s.mitigation)
        if rule not in out:
            out.append(rule)
    return out

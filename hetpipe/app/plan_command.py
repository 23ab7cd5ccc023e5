"""The work of `hetpipe plan` once its options are parsed: search the config's plans (over minibatch sizes and
training rules, each with its own profiles and calibration), print them, and write the best one to --out."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import click

from hetpipe.app.plan_convergence import (
    batch_note,
    plan_calibration,
    plan_over_batches,
    plan_over_rules,
    rule_of,
)
from hetpipe.app.plan_inputs import default_profile_dir, plan_profiles
from hetpipe.app.plan_replan import Replan, plan_file, replan_lines, replans, replans_json
from hetpipe.app.progress_line import ProgressLine
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.planning.capacity import CAPACITY_TARGET
from hetpipe.core.planning.planner import (
    ALLREDUCE,
    D_VALUES,
    SYNC_PIPELINE,
    Candidate,
    best,
    candidates_json,
    explain,
    format_plan,
    format_table,
    plan_candidates,
    ranked,
    search_space,
)
from hetpipe.core.planning.search import SearchResult, search_candidates
from hetpipe.core.planning.summary import default_view, wrap
from hetpipe.core.wsp.aggregation import get_aggregation

__all__ = [
    "NODE_SETTING",
    "WIRE_SETTING",
    "LinkSetting",
    "PlanRequest",
    "PlanSearch",
    "link_note",
    "node_note",
    "optimizer_note",
    "print_plans",
    "run_plan",
    "search_plans",
    "wire_note",
    "write_best",
]


@dataclass(frozen=True)
class PlanRequest:
    """What `hetpipe plan` was asked to search: where the profiles are, the space of candidates, and how to
    price them (the calibration, its target, whether to choose the training rule and the batch)."""

    config_path: Path
    profile_dir: Path | None
    waves: int
    d_values: tuple[int, ...]
    nm_max: int | None
    reserve_gib: float
    policies: tuple[str, ...]
    schedules: tuple[str, ...]
    refresh: bool
    calibration_path: Path | None
    target: float | None
    search_rules: bool
    batches: tuple[int, ...]
    budget_s: float | None = None  # stop the fast search after this many seconds: the best found so far
    exhaustive: bool = False  # plan and simulate every candidate (plan_candidates), as before the fast search
    frozen_layers: int = (
        0  # > 0: a re-plan's search, the model's first layers frozen (hetpipe.app.plan_replan)
    )


@dataclass(frozen=True)
class PlanSearch:
    """What the search found: the candidates at the chosen batch, the config with the chosen training rule
    and batch, the notes for the user, the PS's Gbit/s and the seconds the search took."""

    candidates: list[Candidate]
    ruled: ClusterConfig
    notes: list[str]
    ps_gbps: float
    elapsed: float
    searched: SearchResult | None = None  # the fast search's counts (None for the exhaustive search)
    waves: int = 10  # the waves each finalist was simulated for

    @property
    def footer(self) -> str:
        """What the fast search counted but does not show ("" for the exhaustive search)."""
        return self.searched.footer(self.waves) if self.searched is not None else ""


def run_plan(
    config: ClusterConfig,
    request: PlanRequest,
    *,
    out_path: Path | None,
    show_why: bool,
    as_json: bool,
    show_all: bool = False,
) -> None:
    """`hetpipe plan`: search, print the candidates (the best few, all of them, or JSON) and write the best
    plan to `out_path`."""
    found = search_plans(config, request)
    chosen = best(found.candidates)
    for note in (
        wire_note(config, request, chosen),
        node_note(config, request, chosen),
        optimizer_note(found.ruled, request, chosen),
    ):
        if note:
            found.notes.append(note)
    later = replans(found.ruled, chosen, lambda plain, layers: _replanned(plain, layers, request, chosen))
    print_plans(
        config, request, found, chosen, show_why=show_why, as_json=as_json, show_all=show_all, replans=later
    )
    if out_path is not None:
        write_best(request.config_path, found, chosen, out_path, later)


def _replanned(
    config: ClusterConfig, layers: int, request: PlanRequest, chosen: Candidate
) -> list[Candidate]:
    """Every candidate for `config` with its first `layers` layers frozen, at the chosen plan's D, schedule
    and batch (a run keeps them across a re-plan); every one simulated (no bound prunes: the fast search's
    bounds do not know what freezing leaves off the wire)."""
    assert chosen.plan is not None and chosen.staleness is not None
    asked = dataclasses.replace(
        request,
        d_values=(chosen.staleness,),
        schedules=(chosen.plan.schedule,),
        batches=(config.train.batch_size,),
        search_rules=False,
        exhaustive=True,
        frozen_layers=layers,
    )
    return search_plans(config, asked).candidates


LINK_BUSY = 0.85  # a chosen plan whose PS link is at least this busy is planned again with fewer bytes on it
LINK_GAIN = 1.02  # and the note given when that plan predicts more than this factor


@dataclass(frozen=True)
class LinkSetting:
    """A [ps] setting that moves fewer bytes over the PS's links: when the config does not have it on
    (`off`), the override that turns it on, and what the note says it does."""

    off: Callable[[ClusterConfig], bool]
    override: str
    says: str


WIRE_SETTING = LinkSetting(
    lambda config: config.ps.wire_dtype == "float32",
    'ps.wire_dtype="bfloat16"',
    'with the weights on the wire as bfloat16 (set [ps] wire_dtype = "bfloat16"; half the bytes, not the '
    "float32 run's numbers bit for bit)",
)
NODE_SETTING = LinkSetting(
    lambda config: not config.ps.node_aggregation,
    "ps.node_aggregation=true",
    "with node-local aggregation (set [ps] node_aggregation = true; the VWs wholly on one node push and pull "
    "through one relay there, one copy of the weights per node and wave over the PS's links)",
)


def link_note(
    config: ClusterConfig,
    request: PlanRequest,
    chosen: Candidate,
    setting: LinkSetting,
    search: Callable[[ClusterConfig, PlanRequest], PlanSearch] | None = None,
) -> str | None:
    """When the chosen plan's busiest PS link (the PS's, or a node's) is at least LINK_BUSY busy and the
    config has `setting` off: the same search (`search`, default search_plans) with it on, and a note of that
    search's best plan when it predicts more than LINK_GAIN x the chosen one. The user chooses. None when the
    config refuses the setting beside its others (node aggregation with latest pulls, say)."""
    if not setting.off(config) or chosen.ps_utilisation < LINK_BUSY:
        return None
    gained = _planned_again(config, request, chosen, setting.override, search)
    if gained is None:
        return None
    other, gain = gained
    return (
        f"the PS link is {chosen.ps_utilisation:.0%} busy: {setting.says} the best plan would be "
        f"{other.label}: {other.samples_per_s:.4g} samples/s predicted, {gain:.2f}x"
    )


SERVER_OVERRIDE = 'ps.aggregation="server"'


def optimizer_note(
    config: ClusterConfig,
    request: PlanRequest,
    chosen: Candidate,
    search: Callable[[ClusterConfig, PlanRequest], PlanSearch] | None = None,
) -> str | None:
    """When the chosen plan is below CAPACITY_TARGET of the capacity and every stage keeps optimizer state
    ([train] optimizer momentum or adam under a rule with a local optimizer): the same search with the
    optimizer on the PS ([ps] aggregation = "server": the stages hold no moments, so a slow GPU of little
    memory may hold a whole replica), and a note of that search's best plan when it predicts more than
    LINK_GAIN x the chosen one. Another training rule: the user chooses, so the search keeps to it (no rule
    search) and the note says to compare time to target. None when the config refuses it."""
    below = chosen.capacity > 0 and chosen.samples_per_s < CAPACITY_TARGET * chosen.capacity
    stateful = config.train.optimizer != "sgd" and get_aggregation(config.ps.aggregation).local_optimizer
    if not (below and stateful):
        return None
    one_rule = dataclasses.replace(request, search_rules=False)
    gained = _planned_again(config, one_rule, chosen, SERVER_OVERRIDE, search)
    if gained is None:
        return None
    other, gain = gained
    state = "two moments" if config.train.optimizer == "adam" else "one buffer"
    share = f" ({other.samples_per_s / other.capacity:.0%} of capacity)" if other.capacity > 0 else ""
    return (
        f"the best plan makes {chosen.samples_per_s / chosen.capacity:.0%} of capacity and every stage holds "
        f"the optimizer's state ({config.train.optimizer}: {state} per weight): with the optimizer on the PS "
        f'(set [ps] aggregation = "server"; the VWs push gradients and hold no optimizer state; another '
        f'training rule than "{config.ps.aggregation}", so compare time to target) the best plan would be '
        f"{other.label}: {other.samples_per_s:.4g} samples/s predicted{share}, {gain:.2f}x"
    )


def _planned_again(
    config: ClusterConfig,
    request: PlanRequest,
    chosen: Candidate,
    override: str,
    search: Callable[[ClusterConfig, PlanRequest], PlanSearch] | None,
) -> tuple[Candidate, float] | None:
    """The best plan of the same search (`search`, default search_plans) with `override` applied, and its
    gain over `chosen`, when that gain is above LINK_GAIN; None otherwise, and when the config refuses the
    override beside its other settings."""
    from hetpipe.core.config.overrides import apply_overrides
    from hetpipe.core.errors import ConfigError

    try:
        changed = apply_overrides(config, [override])
    except ConfigError:
        return None
    other = best((search or search_plans)(changed, request).candidates)
    gain = other.samples_per_s / chosen.samples_per_s if chosen.samples_per_s > 0 else 0.0
    return (other, gain) if gain > LINK_GAIN else None


def wire_note(config: ClusterConfig, request: PlanRequest, chosen: Candidate) -> str | None:
    """link_note for [ps] wire_dtype = "bfloat16" (half the bytes): bfloat16 weights on the wire train other
    numbers than float32 (docs/ps-protocol.md)."""
    return link_note(config, request, chosen, WIRE_SETTING)


def node_note(config: ClusterConfig, request: PlanRequest, chosen: Candidate) -> str | None:
    """link_note for [ps] node_aggregation = true: each node's VWs push and pull one copy of the weights
    through a relay (docs/planning.md#node-local-aggregation)."""
    return link_note(config, request, chosen, NODE_SETTING)


def search_plans(config: ClusterConfig, request: PlanRequest) -> PlanSearch:
    """Plan every batch of request.batches (default: the config's) under every training rule its calibration
    measured (or only the config's), and keep the batch and rule soonest to target, with notes saying so."""
    started = time.monotonic()
    inputs_of: dict[int, tuple[list[str], float]] = {}  # per batch: its notes, the PS's Gbit/s
    footers: dict[int, SearchResult] = {}
    at_batch = _batch_planner(request, inputs_of, footers, ProgressLine(_progress))
    candidates, ruled, tried, predicted = plan_over_batches(config, request.batches, at_batch, best)
    batch = ruled.train.batch_size
    notes, ps_gbps = inputs_of[batch]
    if len(predicted) > 1:
        notes.append(batch_note(predicted, batch))
    _add_rule_note(notes, config, ruled, tried, request)
    if config.train.autofreeze_every:
        notes.append(
            "[train] autofreeze_every: the run decides its freeze points as it goes, so these plans are "
            "predicted without freezing (docs/planning.md#after-a-freeze-point)"
        )
    elapsed = time.monotonic() - started
    return PlanSearch(candidates, ruled, notes, ps_gbps, elapsed, footers.get(batch), request.waves)


def _batch_planner(
    request: PlanRequest,
    inputs_of: dict[int, tuple[list[str], float]],
    footers: dict[int, SearchResult],
    progress: Callable[[str], None],
) -> Callable[[ClusterConfig], tuple[list, ClusterConfig, int]]:
    """The function plan_over_batches calls per variant of the config: plan_over_rules at the variant's batch,
    with that batch's profiles and calibration; it records the batch's notes and PS Gbit/s in `inputs_of`,
    and the fast search's counts in `footers`; both searches report to `progress`. The fast search
    (hetpipe.core.planning.search) unless the request is exhaustive or a calibration ranks by time to target
    (not the samples/s the bounds prune by): then every candidate (plan_candidates)."""

    def at_batch(variant: ClusterConfig) -> tuple[list, ClusterConfig, int]:
        """plan_over_rules at the variant's batch, with that batch's profiles and calibration."""
        profiles, ps_gbps, link, notes = plan_profiles(
            variant, request.profile_dir or default_profile_dir(), refresh=request.refresh
        )
        calibration, calibration_note = plan_calibration(
            variant, request.calibration_path, target=request.target
        )
        inputs_of[variant.train.batch_size] = ([*notes, calibration_note], ps_gbps)

        def planned(ruled: ClusterConfig) -> list:
            shared = {
                "ps_gbps": ps_gbps,
                "link_gbps": link,
                "d_values": request.d_values or D_VALUES,
                "nm_max": request.nm_max,
                "waves": request.waves,
                "reserve_bytes": int(request.reserve_gib * 2**30),
                "policies": request.policies or None,
                "schedules": request.schedules or None,
            }
            if not request.exhaustive and calibration is None:
                found = search_candidates(
                    ruled,
                    profiles,
                    **shared,
                    budget_s=request.budget_s,
                    progress=progress,
                )
                footers[ruled.train.batch_size] = found
                return found.candidates
            return plan_candidates(
                ruled,
                profiles,
                **shared,
                slower_but_fewer=calibration is not None,
                progress=progress,
                frozen_layers=request.frozen_layers,
            )

        return plan_over_rules(variant, calibration, planned, best, search=request.search_rules)

    return at_batch


def _progress(line: str) -> None:
    """The search's progress, on stderr (stdout stays the table or the JSON)."""
    click.echo(line, err=True)


def _add_rule_note(
    notes: list[str], config: ClusterConfig, ruled: ClusterConfig, tried: int, request: PlanRequest
) -> None:
    """Append the note on the training rule the search chose (another than the config's, or the config's
    among several measured); none when no rule was searched."""
    if rule_of(ruled) != rule_of(config):
        notes.append(
            f"training rule: {rule_of(ruled)}, the soonest to target of the {tried} rules the calibration "
            f"measured (the config's: {rule_of(config)}); --out carries it, or set [ps] aggregation = "
            f'"{ruled.ps.aggregation}" and [train] mitigation = "{ruled.train.mitigation}" in '
            f"{request.config_path}"
        )
    elif request.search_rules and tried > 1:
        notes.append(
            f"training rule: the config's ({rule_of(config)}), the soonest to target of the {tried} rules "
            "the calibration measured"
        )


def print_plans(
    config: ClusterConfig,
    request: PlanRequest,
    found: PlanSearch,
    chosen: Candidate,
    *,
    show_why: bool,
    as_json: bool,
    show_all: bool = False,
    replans: Sequence[Replan] = (),
) -> None:
    """Print the candidates on stdout: as JSON with the search's inputs; or a header, the notes and the best
    few distinct plans with why each lost (summary.default_view); or (show_all, show_why) every candidate in
    the planner's order, the best plan and (show_why) why each other candidate lost, wrapped to the
    terminal. Then the re-plan at each freeze point (`replans`; JSON: "replans")."""
    if as_json:
        doc = candidates_json(found.candidates, _json_inputs(config, request, found, chosen))
        click.echo(json.dumps({**doc, "replans": replans_json(replans)}, indent=1))
        return
    _print_table(config, request, found, chosen, show_why=show_why, show_all=show_all)
    for line in replan_lines(replans):
        click.echo(line)


def _print_table(
    config: ClusterConfig,
    request: PlanRequest,
    found: PlanSearch,
    chosen: Candidate,
    *,
    show_why: bool,
    show_all: bool,
) -> None:
    """print_plans' text: the header, the notes, the best few plans or every candidate, and why."""
    width = shutil.get_terminal_size((100, 24)).columns
    _, _, ds = _space(found.ruled, request)
    click.echo("\n".join(_header(config, request, found, chosen)))
    for note in found.notes:
        click.echo(f"note: {note}")
    click.echo("")
    if not (show_all or show_why):
        click.echo(default_view(found.candidates, ds, _considered(found), width))
        return
    click.echo(format_table(ranked(found.candidates)))
    if found.footer:
        click.echo(found.footer)
    click.echo("")
    click.echo("best: " + format_plan(chosen))
    if show_why:
        click.echo("")
        click.echo(wrap(explain(found.candidates), width))
        if found.footer:
            click.echo(wrap(f"search: {found.footer}", width))


def _json_inputs(config: ClusterConfig, request: PlanRequest, found: PlanSearch, chosen: Candidate) -> dict:
    """The search's inputs, for --json."""
    return {
        "config": str(request.config_path),
        "model": config.model.name,
        "batch_size": found.ruled.train.batch_size,
        "waves": request.waves,
        "ps_gbps": found.ps_gbps,
        "notes": found.notes,
        "planning_s": round(found.elapsed, 3),
        "aggregation": found.ruled.ps.aggregation,
        "mitigation": found.ruled.train.mitigation,
        "node_aggregation": found.ruled.ps.node_aggregation,
        "capacity_samples_per_s": chosen.capacity,
        "search": found.footer or "exhaustive: every candidate planned and simulated",
    }


def _space(ruled: ClusterConfig, request: PlanRequest) -> tuple[list[str], list[str], list[int]]:
    """The policies, schedules and D values searched."""
    return search_space(
        ruled,
        request.policies or None,
        request.schedules or None,
        request.d_values or D_VALUES,
        request.waves,
    )


def _header(config: ClusterConfig, request: PlanRequest, found: PlanSearch, chosen: Candidate) -> list[str]:
    """The cluster, model, batch, GPUs and capacity; what was searched, in how long, and what came of it."""
    policies, schedules, ds = _space(found.ruled, request)
    batch = found.ruled.train.batch_size
    lines = [
        f"{config.name} ({request.config_path}): {config.model.name} at batch {batch}, "
        f"{len(config.all_gpus())} GPUs"
        + (
            f"; capacity {chosen.capacity:.4g} samples/s (every GPU's standalone rate summed; the capacity "
            "column is each candidate's share)"
            if chosen.capacity > 0
            else ""
        ),
        f"searched: policies {', '.join(policies)} x schedules {', '.join(schedules)} x D "
        f"{', '.join(map(str, ds))} in {found.elapsed:.2f} s",
    ]
    counted = found.searched
    if counted is None:
        lines.append(
            f"candidates: {len(found.candidates)}, every one planned and simulated for {request.waves} waves"
        )
        return lines
    lines.append(f"candidates: {counted.counts(request.waves)}")
    return lines


def _considered(found: PlanSearch) -> int:
    """Every candidate the search looked at: those it counted (the fast search) or kept, and the baselines."""
    if found.searched is None:
        return len(found.candidates)
    counted = found.searched
    baselines = sum(c.policy in (ALLREDUCE, SYNC_PIPELINE) for c in found.candidates)
    return counted.planned + counted.skipped + counted.infeasible + baselines


def write_best(
    config_path: Path, found: PlanSearch, chosen: Candidate, out_path: Path, later: Sequence[Replan] = ()
) -> None:
    """Write the best candidate's plan (with the re-plans that pay, `later`) to `out_path` and say on stderr
    how to train with it."""
    assert chosen.plan is not None
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(plan_file(chosen.plan, later))
    paying = [r.wave for r in later if r.chosen.plan is not None and r.gain > 1.0]
    click.echo(
        f"wrote {out_path}: run it with `hetpipe train {config_path} --plan {out_path}` "
        f"(its VWs, splits, {_work(chosen)}, D={chosen.staleness}, schedule {chosen.plan.schedule}, "
        f"{rule_of(found.ruled)}, batch {found.ruled.train.batch_size}"
        + (f"; re-planned at waves {', '.join(map(str, paying))}" if paying else "")
        + ")",
        err=True,
    )


def _work(chosen: Candidate) -> str:
    """`nm=4`, or each VW's Nm x batch when they differ."""
    assert chosen.plan is not None
    plan = chosen.plan
    if len({(vw.nm, vw.batch(plan.batch_size)) for vw in plan.vws}) == 1:
        return f"nm={chosen.nm}"
    return "per VW nm x batch " + ", ".join(f"{vw.nm}x{vw.batch(plan.batch_size)}" for vw in plan.vws)

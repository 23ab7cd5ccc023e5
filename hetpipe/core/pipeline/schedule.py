"""Pipeline schedules as data: per-stage action lists of one virtual worker, the five generators (wsp,
pipedream, pipedream-2bw, 1f1b-flush, gpipe), the dependency rules every engine runs by, a validator, a timing
model and text forms (docs/schedules.md). Pure, no I/O.

The dependency rules (`needs`, `gate_of`) are the one engine: the validator and timing model below, the
WSP simulator (hetpipe.core.planning.simulate), the single-process reference (hetpipe.compute.reference) and
the runtime's stage executor all run action lists by them.
"""

from __future__ import annotations

import functools
import heapq
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.core.registry import Registry
from hetpipe.core.wsp.clock import first_pulled_wave, gate_version

__all__ = [
    "BACKWARD",
    "FORWARD",
    "KINDS",
    "PUSH",
    "DEFAULT_SCHEDULE",
    "SCHEDULES",
    "UPDATE",
    "WAIT",
    "Action",
    "Event",
    "Guarantee",
    "Schedule",
    "ScheduleError",
    "StageProfile",
    "ScheduleKind",
    "StageModes",
    "Timeline",
    "first_schedule",
    "flushing_schedule",
    "format_grid",
    "format_lists",
    "gate_of",
    "get_schedule",
    "needs",
    "own_through_required",
    "parse_action",
    "parse_actions",
    "register_schedule",
    "simulate",
    "stage_profile",
    "steps",
    "unstashed_forwards",
    "validate",
    "validate_lists",
    "wsp_schedule",
]

FORWARD = "F"
BACKWARD = "B"
UPDATE = "U"
PUSH = "PUSH"
WAIT = "WAIT"
KINDS = (FORWARD, BACKWARD, UPDATE, PUSH, WAIT)
_ZERO_TIME = (UPDATE, PUSH, WAIT)  # the optimizer step's time is part of the profiled backward

_ACTION_RE = re.compile(r"(F|B|U|PUSH|WAIT)(\d+)")

# What the forward of minibatch p is guaranteed to see of its own VW's updates (guarantee L), per schedule:
#   "minibatch":      every minibatch <= p - Nm                 (wsp, pipedream: 1F1B, an update per
#                                                                 minibatch; pipedream sees more:
#                                                                 p - min(Nm, k) + j)
#   "wave":           every minibatch of the waves before p's    (1f1b-flush, gpipe: no local staleness)
#   "previous-wave":  every minibatch of the waves before the last (pipedream-2bw: one update of delay)
Guarantee = Literal["minibatch", "wave", "previous-wave"]
Stashing = Literal["optional", "required", "none"]


class ScheduleError(HetpipeError):
    """A schedule that cannot run as written: the message names stage, position and action, and the fix."""


@dataclass(frozen=True)
class Action:
    """One step of a stage's static list; `str()` gives `F3`, `B3`, `U3`, `PUSH1`, `WAIT2`.

    F p     forward of minibatch p. Stage j > 0 first receives p's activation from stage j - 1.
    B p     backward of minibatch p; its gradient is kept for the next U. Stage j < k - 1 first receives
            p's output gradient from stage j + 1.
    U p     the optimizer step on the mean gradient of the backwards since the previous U (p is the last of
            them, all of one wave); the step's update is added to the wave's update sum.
    PUSH c  push this stage's update sum of wave c to the parameter server.
    WAIT c  gate of wave c: wait until c_global >= c - D - 1, pull W_{c-D-1}, rebase.

    Activation and gradient sends are non-blocking and the receives are implied by F and B, so they are
    not separate actions: the executor derives them from the stage index.
    """

    kind: str
    index: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"unknown action kind {self.kind!r}: use one of {', '.join(KINDS)}")
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ScheduleError(
                f"action {self.kind} needs a minibatch or wave index >= 0, got {self.index!r}"
            )

    def __str__(self) -> str:
        return f"{self.kind}{self.index}"


def parse_action(text: str) -> Action:
    """`"F3"` -> Action("F", 3); the inverse of `str(action)`."""
    match = _ACTION_RE.fullmatch(text.strip())
    if match is None:
        raise ScheduleError(
            f"cannot parse action {text!r}: write F<p>, B<p>, U<p>, PUSH<c> or WAIT<c>, "
            "e.g. F3, B3, U3, PUSH1, WAIT2"
        )
    return Action(match.group(1), int(match.group(2)))


def parse_actions(text: str) -> tuple[Action, ...]:
    """`"F0 F1 B0"` -> three actions; separators are whitespace."""
    return tuple(parse_action(word) for word in text.split())


@dataclass(frozen=True)
class Schedule:
    """The static action list of every stage of one virtual worker (all VWs run the same lists)."""

    num_stages: int
    nm: int
    num_waves: int
    staleness: int  # D, in waves
    name: str
    stages: tuple[tuple[Action, ...], ...]
    guarantee: Guarantee = "minibatch"
    stashing: Stashing = "optional"  # may an update or a rebase fall between a minibatch's F and its B?

    @property
    def num_minibatches(self) -> int:
        return self.num_waves * self.nm

    @property
    def header(self) -> str:
        return f"{self.name}: stages={self.num_stages} nm={self.nm} waves={self.num_waves} D={self.staleness}"

    def own_through(self, stage: int, p: int) -> int:
        """The last own minibatch whose update the forward of p at `stage` sees (all before it too): the
        updates (U) that run before F p in this stage's list; -1 for none."""
        through = -1
        for action in self.stages[stage]:
            if action == Action(FORWARD, p):
                return through
            if action.kind == UPDATE:
                through = action.index
        raise ScheduleError(f"stage {stage} has no F{p}")


def own_through_required(guarantee: Guarantee, p: int, nm: int) -> int:
    """The last own minibatch the forward of p must see under `guarantee` (see Guarantee)."""
    wave_start = (p // nm) * nm
    return {"minibatch": p - nm, "wave": wave_start - 1, "previous-wave": wave_start - nm - 1}[guarantee]


# ---------------------------------------------------------------------------------------------
# the dependency rules: what an action waits for outside its own stage's list order


def needs(action: Action, stage: int, num_stages: int) -> tuple[tuple[int, Action], ...]:
    """Actions of other stages of the same VW that must be done before `action` starts: F p waits for
    F p of the stage before (the activation), B p for B p of the stage after (the gradient)."""
    if action.kind == FORWARD and stage > 0:
        return ((stage - 1, action),)
    if action.kind == BACKWARD and stage < num_stages - 1:
        return ((stage + 1, action),)
    return ()


def unstashed_forwards(actions: Sequence[Action]) -> frozenset[int]:
    """Minibatches of one stage's list whose weights cannot change between their F and their B: no U (the
    optimizer step) and no WAIT (the rebase rewrites the weights) lies between them. Their forward may run on
    the live weights, without a stashed copy, and computes exactly what it computes on one (the last stage of
    every schedule, and every stage of a one-stage VW, run each F p right before its B p)."""
    opened: set[int] = set()
    out: set[int] = set()
    for action in actions:
        if action.kind == FORWARD:
            opened.add(action.index)
        elif action.kind == BACKWARD and action.index in opened:
            opened.discard(action.index)
            out.add(action.index)
        elif action.kind in (UPDATE, WAIT):
            opened.clear()
    return frozenset(out)


def gate_of(action: Action, staleness: int) -> int | None:
    """For WAIT c: the c_global it waits for (c - D - 1, hetpipe.core.wsp.clock.gate_version); None
    otherwise."""
    return gate_version(action.index, staleness) if action.kind == WAIT else None


# ---------------------------------------------------------------------------------------------
# registry


def _deepest_vw_or_config(config_nm: int, deepest: int) -> int:
    """The planner's default Nm cap: the config's nm, or enough to fill the deepest VW's pipe."""
    return max(config_nm, deepest)


@dataclass(frozen=True)
class StageModes:
    """How a stage computes under a schedule and the config's wishes (ScheduleKind.modes)."""

    stashing: bool  # forwards run on a stashed copy of their weight version
    recompute: bool  # forwards keep only their input; the backward runs the forward again


@dataclass(frozen=True)
class ScheduleKind:
    """A named schedule: its generator and the traits every consumer reads (docs/schedules.md): the
    validator, memory model, partitioner, simulator, planner, convergence model, reference and runtime ask
    these, never the schedule's name."""

    name: str
    order: Callable[[int, int, int, int], list[tuple[str, int]]]  # (stage, stages, nm, waves) -> F/B order
    update_every: Literal["minibatch", "wave"]  # the update period: one U per backward, or per wave
    guarantee: Guarantee
    stashing: Stashing
    recompute: bool  # train.recompute allowed (no update or rebase ever falls between F and B)
    drains: (
        bool  # the pipe flushes every wave: a full pipe's time per minibatch is not its bottleneck's alone
    )
    summary: str
    trains_as: str | None = None  # a schedule that trains the same weights bit for bit (gpipe: 1f1b-flush)
    # the lists of this schedule are those of `at_depth_of` with min(Nm, k) in flight: the same F, B and U
    # (pipedream: wsp), waves and pushes at Nm
    at_depth_of: str | None = None
    searched: bool = True  # `hetpipe plan` tries it unless --schedule names others
    # the largest Nm `hetpipe plan` tries: (the config's nm, the deepest VW's stages) -> cap
    nm_cap: Callable[[int, int], int] = _deepest_vw_or_config

    def __call__(self, num_stages: int, nm: int, num_waves: int, staleness: int = 0) -> Schedule:
        _check_parameters(num_stages, nm, num_waves, staleness)
        return _built(self, num_stages, nm, num_waves, staleness)

    def modes(self, weight_stashing: bool, recompute: bool) -> StageModes:
        """The stage's effective modes from [train] weight_stashing and recompute: stashing where the schedule
        has versions to keep and the config wants it; recomputation where asked, and where the schedule could
        stash but the config turned stashing off (a backward then runs on the weights live at that time, as
        PipeDream without weight stashing does)."""
        stashing = self.stashing != "none" and weight_stashing
        return StageModes(stashing, recompute or (self.stashing == "optional" and not weight_stashing))

    def own_lag(self, num_stages: int, nm: int) -> int:
        """Local staleness: the own minibatches whose updates the forward of a wave's first minibatch misses
        at the first stage, past the pipe's fill (wsp Nm - 1, pipedream min(Nm, k) - 1, pipedream-2bw Nm, the
        flushes 0), read off the lists."""
        return _own_lag(self, num_stages, nm)


@functools.lru_cache(maxsize=1024)
@functools.lru_cache(maxsize=1024)
def _built(kind: ScheduleKind, num_stages: int, nm: int, num_waves: int, staleness: int) -> Schedule:
    """The kind's lists for these arguments, built once: a Schedule is immutable, and the planner asks for
    the same one for every stage's memory and every alike VW it simulates."""
    lists = tuple(
        _decorate(kind.order(j, num_stages, nm, num_waves), nm, staleness, kind.update_every)
        for j in range(num_stages)
    )
    return Schedule(num_stages, nm, num_waves, staleness, kind.name, lists, kind.guarantee, kind.stashing)


def _own_lag(kind: ScheduleKind, num_stages: int, nm: int) -> int:
    return 2 * nm - 1 - kind(num_stages, nm, 3, 0).own_through(0, 2 * nm)


SCHEDULES: Registry[ScheduleKind] = Registry(
    "schedule", "schedules", lambda item: isinstance(item, ScheduleKind), "mylab.schedules:ZIGZAG"
)
DEFAULT_SCHEDULE = "wsp"  # [train] schedule when the config names none


def register_schedule(kind: ScheduleKind) -> ScheduleKind:
    """Make a schedule known by its name (a new schedule is one ScheduleKind and its tests)."""
    return SCHEDULES.register(kind.name, kind)


def get_schedule(name: str) -> ScheduleKind:
    """The schedule registered as `name`, or named "package.module:NAME"; UsageError listing the known
    ones."""
    return SCHEDULES.get(name)


def first_schedule(where: Callable[[ScheduleKind], bool]) -> ScheduleKind:
    """The first registered schedule with the traits `where` asks for (e.g. the first that drains)."""
    return next(kind for _, kind in SCHEDULES.items() if where(kind))


def flushing_schedule() -> ScheduleKind:
    """The first registered schedule that flushes every wave and trains as itself (1f1b-flush)."""
    return first_schedule(lambda kind: kind.drains and kind.trains_as is None)


def _check_parameters(num_stages: int, nm: int, num_waves: int, staleness: int) -> None:
    for what, value, least in (
        ("num_stages (--stages)", num_stages, 1),
        ("nm (--nm)", nm, 1),
        ("num_waves (--waves)", num_waves, 1),
        ("staleness D (--staleness)", staleness, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise UsageError(f"{what} must be an integer >= {least}, got {value!r}")


def _needs_wait(wave: int, staleness: int) -> bool:
    """Wave c gates on W_{c-D-1}; for c - D - 1 <= 0 the stage already holds W_0 (docs/wsp.md)."""
    return wave >= first_pulled_wave(staleness)


def _one_f_one_b(first: int, count: int, warmup: int) -> list[tuple[str, int]]:
    """Minibatches first .. first+count-1: `warmup` forwards, then alternate B and F, then the last Bs."""
    order = [(FORWARD, first + i) for i in range(warmup)]
    for i in range(warmup, count):
        order += [(BACKWARD, first + i - warmup), (FORWARD, first + i)]
    order += [(BACKWARD, first + i) for i in range(count - warmup, count)]
    return order


def _async_order(stage: int, num_stages: int, nm: int, num_waves: int) -> list[tuple[str, int]]:
    # With nm <= stage the stage still needs one forward before its first backward; plain 1F1B (one in
    # flight) then follows the minibatch down and back.
    total = num_waves * nm
    return _one_f_one_b(0, total, max(1, min(nm - stage, total)))


def _depth_order(stage: int, num_stages: int, nm: int, num_waves: int) -> list[tuple[str, int]]:
    # The wsp order with at most as many in flight as the pipe is deep (min(Nm, k)): a full pipe needs no
    # more, so Nm beyond k lengthens the wave (the push period) without adding local staleness or memory.
    total = num_waves * nm
    return _one_f_one_b(0, total, max(1, min(min(nm, num_stages) - stage, total)))


def _flush_order(stage: int, num_stages: int, nm: int, num_waves: int) -> list[tuple[str, int]]:
    warmup = max(1, min(num_stages - stage, nm))
    return [step for c in range(num_waves) for step in _one_f_one_b(c * nm, nm, warmup)]


def _fill_drain_order(stage: int, num_stages: int, nm: int, num_waves: int) -> list[tuple[str, int]]:
    return [step for c in range(num_waves) for step in _one_f_one_b(c * nm, nm, nm)]


def _decorate(order: list[tuple[str, int]], nm: int, staleness: int, update_every: str) -> tuple[Action, ...]:
    """F/B order -> actions: U after each B (or after the last B of each wave), PUSH c right after the update
    that completes wave c, WAIT c right before the first F of wave c (when c needs a gate)."""
    actions: list[Action] = []
    for kind, p in order:
        wave = p // nm
        last_of_wave = p % nm == nm - 1
        if kind == FORWARD:
            if p % nm == 0 and _needs_wait(wave, staleness):
                actions.append(Action(WAIT, wave))
            actions.append(Action(FORWARD, p))
        else:
            actions.append(Action(BACKWARD, p))
            if update_every == "minibatch" or last_of_wave:
                actions.append(Action(UPDATE, p))
            if last_of_wave:
                actions.append(Action(PUSH, wave))
    return tuple(actions)


wsp_schedule = register_schedule(
    ScheduleKind(
        "wsp",
        _async_order,
        update_every="minibatch",
        guarantee="minibatch",
        stashing="optional",
        recompute=False,
        drains=False,
        summary="PipeDream 1F1B with Nm in flight and an update after every backward (weight stashing by "
        "default); the paper's HetPipe schedule",
    )
)
register_schedule(
    ScheduleKind(
        "pipedream",
        _depth_order,
        update_every="minibatch",
        guarantee="minibatch",
        stashing="optional",
        recompute=False,
        drains=False,
        summary="PipeDream 1F1B at the pipe's depth: stage j keeps min(Nm, k) - j in flight and updates "
        "after every backward; Nm only sets the wave (how often stages push), so a larger Nm adds no local "
        "staleness",
        at_depth_of="wsp",
    )
)
register_schedule(
    ScheduleKind(
        "pipedream-2bw",
        _async_order,
        update_every="wave",
        guarantee="previous-wave",
        stashing="required",
        recompute=False,
        drains=False,
        summary="PipeDream-2BW: 1F1B without flushes, gradients accumulated over a wave and one update per "
        "wave; two weight versions live (forwards straddling an update keep the older one)",
    )
)
register_schedule(
    ScheduleKind(
        "1f1b-flush",
        _flush_order,
        update_every="wave",
        guarantee="wave",
        stashing="none",
        recompute=True,
        drains=True,
        summary="PipeDream-Flush / DAPPLE: 1F1B inside a wave, then a flush and one update per wave; "
        "no local staleness",
    )
)
register_schedule(
    ScheduleKind(
        "gpipe",
        _fill_drain_order,
        update_every="wave",
        guarantee="wave",
        stashing="none",
        recompute=True,
        drains=True,
        summary="GPipe: every forward of a wave, then every backward, then one update; "
        "optional activation recomputation",
        trains_as="1f1b-flush",
    )
)


# ---------------------------------------------------------------------------------------------
# validation


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError naming the first problem of `schedule`; None when it can run."""
    if len(schedule.stages) != schedule.num_stages:
        raise ScheduleError(
            f"{schedule.name}: num_stages={schedule.num_stages} but {len(schedule.stages)} stage lists; "
            "give one list per stage"
        )
    validate_lists(
        schedule.stages,
        schedule.nm,
        schedule.num_waves,
        schedule.staleness,
        guarantee=schedule.guarantee,
        stashing=schedule.stashing,
    )


def validate_lists(
    stages: Sequence[Sequence[Action]],
    nm: int,
    num_waves: int,
    staleness: int = 0,
    *,
    guarantee: Guarantee = "minibatch",
    stashing: Stashing = "optional",
) -> None:
    """Check hand-written stage lists: each list on its own, then all of them run together."""
    _check_parameters(len(stages), nm, num_waves, staleness)
    for j, actions in enumerate(stages):
        _StageCheck(j, nm, num_waves, staleness, guarantee, stashing).run(actions)
    _execute(stages, staleness, [1.0] * len(stages), [1.0] * len(stages))


def _at(stage: int, position: int, action: Action) -> str:
    return f"stage {stage}, position {position} ({action})"


@dataclass
class _StageCheck:
    """The rules one list must keep whatever the other stages do."""

    stage: int
    nm: int
    num_waves: int
    staleness: int
    guarantee: Guarantee
    stashing: Stashing

    def run(self, actions: Sequence[Action]) -> None:
        total = self.num_waves * self.nm
        seen: dict[Action, int] = {}
        in_flight: set[int] = set()
        pending: list[int] = []  # backwards not yet covered by an update
        updated: set[int] = set()
        for i, action in enumerate(actions):
            if not isinstance(action, Action):
                raise ScheduleError(
                    f"stage {self.stage}, position {i}: {action!r} is not an Action; use parse_action()"
                )
            where = _at(self.stage, i, action)
            if action in seen:
                raise ScheduleError(
                    f"{where}: {action} already at position {seen[action]}; each action runs once"
                )
            kind, n = action.kind, action.index
            if kind in (FORWARD, BACKWARD, UPDATE) and n >= total:
                raise ScheduleError(
                    f"{where}: no minibatch {n}; with nm={self.nm} and {self.num_waves} waves "
                    f"minibatches are 0..{total - 1}"
                )
            if kind in (PUSH, WAIT) and n >= self.num_waves:
                raise ScheduleError(f"{where}: no wave {n}; waves are 0..{self.num_waves - 1}")
            wave = n if kind in (PUSH, WAIT) else n // self.nm
            if kind == FORWARD:
                self._forward(where, action, in_flight, updated)
                in_flight.add(n)
            elif kind == BACKWARD:
                if Action(FORWARD, n) not in seen:
                    raise ScheduleError(
                        f"{where}: backward before its forward at this stage; put F{n} before {action}"
                    )
                in_flight.discard(n)
                pending.append(n)
            elif kind == UPDATE:
                self._update(where, action, pending, in_flight)
                updated.update(pending)
                pending.clear()
            elif kind == PUSH:
                missing = [p for p in range(n * self.nm, n * self.nm + self.nm) if p not in updated]
                if missing:
                    what = (
                        f"B{missing[0]} has not run"
                        if Action(BACKWARD, missing[0]) not in seen
                        else f"B{missing[0]}'s update (U) has not run"
                    )
                    raise ScheduleError(
                        f"{where}: wave {n}'s update is not complete, {what}; "
                        f"put {action} right after the update of the last backward of wave {n}"
                    )
            elif kind == WAIT:
                if not _needs_wait(n, self.staleness):
                    raise ScheduleError(
                        f"{where}: wave {n} needs no gate with D={self.staleness} "
                        "(W_0 is the initial model); "
                        f"only waves c >= D + 2 = {self.staleness + 2} wait, so remove {action}"
                    )
                if self.stashing == "none" and in_flight:
                    raise ScheduleError(
                        f"{where}: F{min(in_flight)} is in flight "
                        "and this schedule keeps no stashed weights, "
                        "so a rebase here would change the weights of its backward; flush the wave first"
                    )
            # A gate must precede every action of its wave; B p needs F p first, so checking at the
            # wave's first F or B also catches a WAIT placed after any action of its wave.
            gate = Action(WAIT, wave)
            if kind in (FORWARD, BACKWARD) and _needs_wait(wave, self.staleness) and gate not in seen:
                later = [k for k in range(i + 1, len(actions)) if actions[k] == gate]
                state = f"{gate} comes later (position {later[0]})" if later else f"{gate} is missing"
                raise ScheduleError(
                    f"{where}: first action of wave {wave}, but {state}; with D={self.staleness} wave {wave} "
                    f"must wait for W_{wave - self.staleness - 1}, so put {gate} right before {action}"
                )
            seen[action] = i
        self._complete(seen, updated, total)

    def _forward(self, where: str, action: Action, in_flight: set[int], updated: set[int]) -> None:
        if len(in_flight) + 1 > self.nm:
            raise ScheduleError(
                f"{where}: {len(in_flight) + 1} minibatches in flight at this stage, more than nm={self.nm}; "
                f"run a backward before {action}"
            )
        need = own_through_required(self.guarantee, action.index, self.nm)
        missing = [q for q in range(need + 1) if q not in updated]
        if missing:
            raise ScheduleError(
                f"{where}: comes before B{missing[0]} and its update; guarantee L ({self.guarantee}) needs "
                f"every own minibatch <= {need} applied before {action}, "
                f"so put B{missing[0]} and its U before {action}"
            )

    def _update(self, where: str, action: Action, pending: list[int], in_flight: set[int]) -> None:
        if not pending or pending[-1] != action.index:
            last = (
                f"the last backward before it is B{pending[-1]}" if pending else "no backward runs before it"
            )
            raise ScheduleError(f"{where}: an update names the last backward it applies, but {last}")
        waves = {p // self.nm for p in pending}
        if len(waves) > 1:
            raise ScheduleError(
                f"{where}: applies backwards of waves {sorted(waves)}; an update belongs to one wave's sum, "
                f"so put a U after B{max(p for p in pending if p // self.nm == min(waves))}"
            )
        if self.stashing == "none" and in_flight:
            raise ScheduleError(
                f"{where}: F{min(in_flight)} is in flight and this schedule keeps no stashed weights, so its "
                "backward would see the updated weights; update after the wave's last backward"
            )

    def _complete(self, seen: dict[Action, int], updated: set[int], total: int) -> None:
        for p in range(total):
            for kind in (FORWARD, BACKWARD):
                if Action(kind, p) not in seen:
                    raise ScheduleError(
                        f"stage {self.stage}: {kind}{p} is missing; "
                        "every stage runs F and B of every minibatch"
                    )
            if p not in updated:
                raise ScheduleError(f"stage {self.stage}: B{p} is never applied; put a U after it")
        for c in range(self.num_waves):
            push = Action(PUSH, c)
            if push not in seen:
                last = [a for a in seen if a.kind == UPDATE and a.index // self.nm == c]
                after = (
                    max(last, key=lambda a: seen[a]) if last else Action(BACKWARD, c * self.nm + self.nm - 1)
                )
                raise ScheduleError(
                    f"stage {self.stage}: {push} is missing; put it right after {after} "
                    f"(position {seen[after]}), the update that completes wave {c}"
                )


# ---------------------------------------------------------------------------------------------
# execution: the dependency rules with per-stage times, used by the validator and the timing model


@dataclass(frozen=True)
class Event:
    """One action of one stage in a simulated run; U, PUSH and WAIT have end == start."""

    stage: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """A simulated run of one virtual worker: every action with its start and end time."""

    schedule: Schedule
    events: tuple[Event, ...]

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.events), default=0.0)

    @property
    def throughput(self) -> float:
        """Minibatches per time unit over the whole run, fill and drain included."""
        return self.schedule.num_minibatches / self.makespan if self.makespan else math.inf


def _blocker(
    stages: Sequence[Sequence[Action]],
    done: list[dict[Action, float]],
    j: int,
    action: Action,
    staleness: int,
    now: float,
) -> str | None:
    """What `action` at stage j still waits for at time `now` (one VW: c_global is its own clock)."""
    for peer, other in needs(action, j, len(stages)):
        if done[peer].get(other, math.inf) > now:
            what = "the activation" if action.kind == FORWARD else "the gradient"
            return f"{other} at stage {peer} ({what})"
    gate = gate_of(action, staleness)
    if gate is not None:
        for c in range(gate):
            for i in range(len(stages)):
                if done[i].get(Action(PUSH, c), math.inf) > now:
                    return f"PUSH{c} at stage {i}"
    return None


def _execute(
    stages: Sequence[Sequence[Action]],
    staleness: int,
    forward_time: Sequence[float],
    backward_time: Sequence[float],
) -> list[Event]:
    """Run all lists together: each stage takes its next action as soon as its dependencies are done."""
    k = len(stages)
    done: list[dict[Action, float]] = [{} for _ in range(k)]
    position = [0] * k
    free_at = [0.0] * k
    events: list[Event] = []
    upcoming: list[float] = []
    now = 0.0
    while True:
        progressed = True
        while progressed:  # zero-time actions at `now` may unblock other stages at `now`
            progressed = False
            for j in range(k):
                while free_at[j] <= now and position[j] < len(stages[j]):
                    action = stages[j][position[j]]
                    if _blocker(stages, done, j, action, staleness, now) is not None:
                        break
                    duration = {FORWARD: forward_time[j], BACKWARD: backward_time[j]}.get(action.kind, 0.0)
                    done[j][action] = now + duration
                    events.append(Event(j, action, now, now + duration))
                    position[j] += 1
                    progressed = True
                    if duration > 0:
                        free_at[j] = now + duration
                        heapq.heappush(upcoming, now + duration)
        if all(position[j] == len(stages[j]) for j in range(k)):
            return events
        while upcoming and upcoming[0] <= now:
            heapq.heappop(upcoming)
        if not upcoming:
            stuck = [
                f"  {_at(j, position[j], stages[j][position[j]])} waits for "
                f"{_blocker(stages, done, j, stages[j][position[j]], staleness, now)}"
                for j in range(k)
                if position[j] < len(stages[j])
            ]
            raise ScheduleError(
                "deadlock: no stage can proceed\n"
                + "\n".join(stuck)
                + "\n  reorder the lists so that what each stage waits for comes earlier in the other lists"
            )
        now = heapq.heappop(upcoming)


def _per_stage(value: Sequence[float] | float, num_stages: int, what: str) -> list[float]:
    values = [float(value)] * num_stages if isinstance(value, int | float) else [float(v) for v in value]
    if len(values) != num_stages:
        raise UsageError(
            f"{what} has {len(values)} entries for {num_stages} stages; give one per stage or one number"
        )
    if any(not v > 0 or math.isinf(v) for v in values):
        raise UsageError(f"{what} must be finite and > 0, got {values}")
    return values


def simulate(
    schedule: Schedule,
    forward_time: Sequence[float] | float = 1.0,
    backward_time: Sequence[float] | float = 2.0,
    *,
    check: bool = True,
) -> Timeline:
    """Run `schedule` with per-stage forward and backward times (one number or one per stage).

    Communication, U, PUSH and WAIT take no time; WAIT blocks only as the gate rule says. `check=False` skips
    the validation, for lists validated once and run many times with other times (the partitioner).
    """
    if check:
        validate(schedule)
    k = schedule.num_stages
    events = _execute(
        schedule.stages,
        schedule.staleness,
        _per_stage(forward_time, k, "forward_time"),
        _per_stage(backward_time, k, "backward_time"),
    )
    return Timeline(schedule, tuple(events))


def steps(schedule: Schedule) -> list[tuple[tuple[Action, ...], ...]]:
    """Unit-time run: per step, per stage, the actions started in that step (empty when idle).

    F and B take one step; a U, PUSH or WAIT appears in the step where it runs, before the F or B that
    follows it there (e.g. `(U3, PUSH0, F7)`), or alone when the stage then idles.
    """
    timeline = simulate(schedule, 1.0, 1.0)
    count = 1 + int(max((e.start for e in timeline.events), default=-1.0))
    cells: list[list[list[Action]]] = [[[] for _ in range(schedule.num_stages)] for _ in range(count)]
    for event in timeline.events:
        cells[int(event.start)][event.stage].append(event.action)
    return [tuple(tuple(cell) for cell in row) for row in cells]


# ---------------------------------------------------------------------------------------------
# what a stage holds at its peak (the memory model reads these)


@dataclass(frozen=True)
class StageProfile:
    """The most a stage holds at once under a schedule: minibatches in flight (activations kept) and weight
    versions those minibatches ran on (each a stashed copy while weight stashing is on)."""

    in_flight: int
    versions: int


def stage_profile(schedule: Schedule, stage: int) -> StageProfile:
    """Scan one stage's list: a version begins at every U and WAIT; a forward keeps the version it ran on
    until its backward, shared with the other forwards of that version."""
    version = 0
    alive: dict[int, int] = {}  # minibatch in flight -> the version its forward used
    peak_flight = peak_versions = 0
    for action in schedule.stages[stage]:
        if action.kind == FORWARD:
            alive[action.index] = version
        elif action.kind == BACKWARD:
            del alive[action.index]
        elif action.kind in (UPDATE, WAIT):
            version += 1
        peak_flight = max(peak_flight, len(alive))
        peak_versions = max(peak_versions, len(set(alive.values())))
    return StageProfile(peak_flight, peak_versions)


# ---------------------------------------------------------------------------------------------
# text


def format_lists(schedule: Schedule) -> str:
    """A header line, then one line per stage: `stage 0: F0 F1 B0 ...`."""
    lines = [schedule.header]
    lines += [f"stage {j}: " + " ".join(map(str, actions)) for j, actions in enumerate(schedule.stages)]
    return "\n".join(lines)


def format_grid(schedule: Schedule) -> str:
    """A header line, then a step x stage table of the unit-time run; `.` marks an idle stage."""
    rows = steps(schedule)
    titles = [f"stage {j}" for j in range(schedule.num_stages)]
    cells = [[" ".join(map(str, cell)) or "." for cell in row] for row in rows]
    widths = [max([len(titles[j])] + [len(row[j]) for row in cells]) for j in range(schedule.num_stages)]
    step_width = max(len("step"), len(str(len(rows) - 1)))

    def line(first: str, values: list[str]) -> str:
        return "  ".join(
            [first.rjust(step_width)] + [v.ljust(w) for v, w in zip(values, widths, strict=True)]
        ).rstrip()

    return "\n".join(
        [schedule.header, line("step", titles)] + [line(str(t), row) for t, row in enumerate(cells)]
    )

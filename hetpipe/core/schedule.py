"""Per-stage action lists of one virtual worker: generators by name, a validator, unit-step grids. Pure, no I/O."""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetpipe.core.errors import HetpipeError, UsageError, did_you_mean

__all__ = [
    "FORWARD",
    "BACKWARD",
    "PUSH",
    "WAIT",
    "KINDS",
    "Action",
    "Event",
    "Schedule",
    "ScheduleError",
    "SCHEDULES",
    "Timeline",
    "format_grid",
    "format_lists",
    "get_schedule",
    "parse_action",
    "parse_actions",
    "register_schedule",
    "simulate",
    "steps",
    "validate",
    "validate_lists",
    "wsp_schedule",
]

FORWARD = "F"
BACKWARD = "B"
PUSH = "PUSH"
WAIT = "WAIT"
KINDS = (FORWARD, BACKWARD, PUSH, WAIT)
_ZERO_TIME = (PUSH, WAIT)

_ACTION_RE = re.compile(r"(F|B|PUSH|WAIT)(\d+)")


class ScheduleError(HetpipeError):
    """A schedule that cannot run as written: the message names stage, position and action, and the fix."""


@dataclass(frozen=True)
class Action:
    """One step of a stage's static list (hetpipe.md §2, §3); `str()` gives `F3`, `B3`, `PUSH1`, `WAIT2`.

    F p   forward of minibatch p. Stage j > 0 first receives p's activation from stage j - 1.
    B p   backward of minibatch p, then at once the local optimizer step. Stage j < k - 1 first
          receives p's gradient from stage j + 1.
    PUSH c  push this stage's summed update of wave c to the parameter server.
    WAIT c  gate of wave c: wait until c_global >= c - D - 1, pull W_{c-D-1}, rebase.

    Activation and gradient sends are non-blocking and the receives are implied by F and B, so
    they are not separate actions: the executor derives them from the stage index.
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
            f"cannot parse action {text!r}: write F<p>, B<p>, PUSH<c> or WAIT<c>, e.g. F3, B3, PUSH1, WAIT2"
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

    @property
    def num_minibatches(self) -> int:
        return self.num_waves * self.nm

    @property
    def header(self) -> str:
        return f"{self.name}: stages={self.num_stages} nm={self.nm} waves={self.num_waves} D={self.staleness}"


# ---------------------------------------------------------------------------------------------
# registry


SCHEDULES: dict[str, Callable[..., Schedule]] = {}


def register_schedule(name: str) -> Callable[[Callable[..., Schedule]], Callable[..., Schedule]]:
    """Decorator: make a generator `(num_stages, nm, num_waves, staleness) -> Schedule` known by name."""

    def decorate(generator: Callable[..., Schedule]) -> Callable[..., Schedule]:
        if name in SCHEDULES:
            raise ValueError(f"schedule {name!r} is registered twice; pick another name")
        SCHEDULES[name] = generator
        return generator

    return decorate


def get_schedule(name: str) -> Callable[..., Schedule]:
    """The generator registered under `name`; UsageError listing the known names otherwise."""
    try:
        return SCHEDULES[name]
    except KeyError:
        known = sorted(SCHEDULES)
        hint = did_you_mean(name, known)
        raise UsageError(
            f'unknown schedule "{name}"\n       known schedules: {", ".join(known)}{hint}'
        ) from None


def _check_parameters(num_stages: int, nm: int, num_waves: int, staleness: int) -> None:
    for what, value, least in (
        ("num_stages (--stages)", num_stages, 1),
        ("nm (--nm)", nm, 1),
        ("num_waves (--waves)", num_waves, 1),
        ("staleness D (--staleness)", staleness, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise UsageError(f"{what} must be an integer >= {least}, got {value!r}")


def _wave_of(minibatch: int, nm: int) -> int:
    return minibatch // nm


def _needs_wait(wave: int, staleness: int) -> bool:
    """Wave c gates on W_{c-D-1}; for c - D - 1 <= 0 the stage already holds W_0 (hetpipe.md §3)."""
    return wave - staleness - 1 >= 1


# ---------------------------------------------------------------------------------------------
# the "wsp" generator


@register_schedule("wsp")
def wsp_schedule(num_stages: int, nm: int, num_waves: int, staleness: int = 0) -> Schedule:
    """PipeDream-style one-forward-one-backward with up to nm in flight, plus WSP push and gate (hetpipe.md §2).

    Stage j does max(1, min(nm - j, M)) forwards, then alternates B and F, then drains the Bs.
    PUSH c follows the backward of wave c's last minibatch at once; WAIT c (for c - D - 1 >= 1)
    comes right before the forward of wave c's first minibatch.
    """
    _check_parameters(num_stages, nm, num_waves, staleness)
    stages = tuple(_wsp_stage(j, nm, num_waves, staleness) for j in range(num_stages))
    return Schedule(num_stages, nm, num_waves, staleness, "wsp", stages)


def _wsp_stage(stage: int, nm: int, num_waves: int, staleness: int) -> tuple[Action, ...]:
    total = num_waves * nm
    # With nm <= stage, nm - stage <= 0: the stage still needs one forward before its first
    # backward, and plain 1F1B (one in flight) then follows the minibatch down and back.
    warmup = max(1, min(nm - stage, total))
    actions: list[Action] = []

    def forward(p: int) -> None:
        wave = _wave_of(p, nm)
        if p % nm == 0 and _needs_wait(wave, staleness):
            actions.append(Action(WAIT, wave))
        actions.append(Action(FORWARD, p))

    def backward(p: int) -> None:
        actions.append(Action(BACKWARD, p))
        if p % nm == nm - 1:
            actions.append(Action(PUSH, _wave_of(p, nm)))

    for p in range(warmup):
        forward(p)
    next_backward = 0
    for p in range(warmup, total):
        backward(next_backward)
        next_backward += 1
        forward(p)
    for p in range(next_backward, total):
        backward(p)
    return tuple(actions)


# ---------------------------------------------------------------------------------------------
# validation


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError naming the first problem of `schedule`; None when it can run."""
    if len(schedule.stages) != schedule.num_stages:
        raise ScheduleError(
            f"{schedule.name}: num_stages={schedule.num_stages} but {len(schedule.stages)} stage lists; "
            "give one list per stage"
        )
    validate_lists(schedule.stages, schedule.nm, schedule.num_waves, schedule.staleness)


def validate_lists(stages: Sequence[Sequence[Action]], nm: int, num_waves: int, staleness: int = 0) -> None:
    """Check hand-written stage lists: each list on its own, then all of them run together."""
    _check_parameters(len(stages), nm, num_waves, staleness)
    for j, actions in enumerate(stages):
        _check_stage(j, actions, nm, num_waves, staleness)
    _execute(stages, nm, staleness, [1.0] * len(stages), [1.0] * len(stages))


def _at(stage: int, position: int, action: Action) -> str:
    return f"stage {stage}, position {position} ({action})"


def _check_stage(stage: int, actions: Sequence[Action], nm: int, num_waves: int, staleness: int) -> None:
    """The rules one list must keep whatever the other stages do."""
    total = num_waves * nm
    seen: dict[Action, int] = {}
    in_flight = 0
    for i, action in enumerate(actions):
        if not isinstance(action, Action):
            raise ScheduleError(
                f"stage {stage}, position {i}: {action!r} is not an Action; use parse_action()"
            )
        where = _at(stage, i, action)
        if action in seen:
            raise ScheduleError(
                f"{where}: {action} already at position {seen[action]}; each action runs once"
            )
        kind, n = action.kind, action.index
        if kind in (FORWARD, BACKWARD) and n >= total:
            raise ScheduleError(
                f"{where}: no minibatch {n}; with nm={nm} and {num_waves} waves minibatches are 0..{total - 1}"
            )
        if kind in _ZERO_TIME and n >= num_waves:
            raise ScheduleError(f"{where}: no wave {n}; waves are 0..{num_waves - 1}")
        wave = n if kind in _ZERO_TIME else _wave_of(n, nm)
        gate = Action(WAIT, wave)

        if kind == FORWARD:
            in_flight += 1
            if in_flight > nm:
                raise ScheduleError(
                    f"{where}: {in_flight} minibatches in flight at this stage, more than nm={nm}; "
                    f"run a backward before {action}"
                )
            if n >= nm and Action(BACKWARD, n - nm) not in seen:
                raise ScheduleError(
                    f"{where}: comes before B{n - nm}; guarantee L needs minibatch p - nm's update "
                    f"before p's forward, so put B{n - nm} before {action}"
                )
        elif kind == BACKWARD:
            if Action(FORWARD, n) not in seen:
                raise ScheduleError(
                    f"{where}: backward before its forward at this stage; put F{n} before {action}"
                )
            in_flight -= 1
        elif kind == PUSH:
            missing = [p for p in range(n * nm, n * nm + nm) if Action(BACKWARD, p) not in seen]
            if missing:
                raise ScheduleError(
                    f"{where}: wave {n}'s update is not complete, B{missing[0]} has not run; "
                    f"put {action} right after the last backward of wave {n}"
                )
        elif kind == WAIT and not _needs_wait(n, staleness):
            raise ScheduleError(
                f"{where}: wave {n} needs no gate with D={staleness} (W_0 is the initial model); "
                f"only waves c >= D + 2 = {staleness + 2} wait, so remove {action}"
            )

        # A gate must precede every action of its wave; B p needs F p first, so checking at the
        # wave's first F or B also catches a WAIT placed after any action of its wave.
        if kind in (FORWARD, BACKWARD) and _needs_wait(wave, staleness) and gate not in seen:
            later = [k for k in range(i + 1, len(actions)) if actions[k] == gate]
            state = f"{gate} comes later (position {later[0]})" if later else f"{gate} is missing"
            raise ScheduleError(
                f"{where}: first action of wave {wave}, but {state}; with D={staleness} wave {wave} "
                f"must wait for W_{wave - staleness - 1}, so put {gate} right before {action}"
            )
        seen[action] = i

    for p in range(total):
        for kind in (FORWARD, BACKWARD):
            if Action(kind, p) not in seen:
                raise ScheduleError(
                    f"stage {stage}: {kind}{p} is missing; every stage runs F and B of every minibatch"
                )
    for c in range(num_waves):
        push = Action(PUSH, c)
        if push not in seen:
            last = Action(BACKWARD, c * nm + nm - 1)
            raise ScheduleError(
                f"stage {stage}: {push} is missing; put it right after {last} (position {seen[last]}), "
                f"the last backward of wave {c}"
            )


# ---------------------------------------------------------------------------------------------
# execution: the dependency rules, used by the validator and the timing model alike


@dataclass(frozen=True)
class Event:
    """One action of one stage in a simulated run; PUSH and WAIT have end == start."""

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


class _Run:
    """Completion times of the actions that have run so far, and the rules that read them."""

    def __init__(self, num_stages: int, nm: int, staleness: int) -> None:
        self.num_stages = num_stages
        self.nm = nm
        self.staleness = staleness
        self.done: list[dict[Action, float]] = [{} for _ in range(num_stages)]

    def finished(self, stage: int, action: Action, now: float) -> bool:
        return self.done[stage].get(action, math.inf) <= now

    def blocker(self, stage: int, action: Action, now: float) -> str | None:
        """What `action` at `stage` still waits for at time `now`; None when it may start."""
        kind, n = action.kind, action.index
        if kind == FORWARD:
            if stage > 0 and not self.finished(stage - 1, action, now):
                return f"{action} at stage {stage - 1} (the activation)"
        elif kind == BACKWARD:
            if not self.finished(stage, Action(FORWARD, n), now):
                return f"F{n} at stage {stage}"
            if stage < self.num_stages - 1 and not self.finished(stage + 1, action, now):
                return f"{action} at stage {stage + 1} (the gradient)"
        elif kind == PUSH:
            for p in range(n * self.nm, n * self.nm + self.nm):
                if not self.finished(stage, Action(BACKWARD, p), now):
                    return f"B{p} at stage {stage}"
        else:  # WAIT: c_global >= c - D - 1, i.e. every stage pushed every wave <= c - D - 2
            for c in range(n - self.staleness - 1):
                for j in range(self.num_stages):
                    if not self.finished(j, Action(PUSH, c), now):
                        return f"PUSH{c} at stage {j}"
        return None


def _execute(
    stages: Sequence[Sequence[Action]],
    nm: int,
    staleness: int,
    forward_time: Sequence[float],
    backward_time: Sequence[float],
) -> list[Event]:
    """Run all lists together: each stage takes its next action as soon as its dependencies are done."""
    k = len(stages)
    run = _Run(k, nm, staleness)
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
                    if run.blocker(j, action, now) is not None:
                        break
                    duration = {FORWARD: forward_time[j], BACKWARD: backward_time[j]}.get(action.kind, 0.0)
                    run.done[j][action] = now + duration
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
                f"{run.blocker(j, stages[j][position[j]], now)}"
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
) -> Timeline:
    """Run `schedule` with per-stage forward and backward times (one number or one per stage).

    Communication and PUSH/WAIT take no time; WAIT blocks only as the gate rule says.
    """
    validate(schedule)
    k = schedule.num_stages
    events = _execute(
        schedule.stages,
        schedule.nm,
        schedule.staleness,
        _per_stage(forward_time, k, "forward_time"),
        _per_stage(backward_time, k, "backward_time"),
    )
    return Timeline(schedule, tuple(events))


def steps(schedule: Schedule) -> list[tuple[tuple[Action, ...], ...]]:
    """Unit-time run: per step, per stage, the actions started in that step (empty when idle).

    F and B take one step; a PUSH or WAIT appears in the step where it runs, before the F or B
    that follows it there (e.g. `(PUSH0, F7)`), or alone when the stage then idles.
    """
    timeline = simulate(schedule, 1.0, 1.0)
    count = 1 + int(max((e.start for e in timeline.events), default=-1.0))
    cells: list[list[list[Action]]] = [[[] for _ in range(schedule.num_stages)] for _ in range(count)]
    for event in timeline.events:
        cells[int(event.start)][event.stage].append(event.action)
    return [tuple(tuple(cell) for cell in row) for row in cells]


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

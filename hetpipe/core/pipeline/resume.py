"""Where a stopped run continues and a failed VW comes back, on the static action lists (docs/recovery.md).
Pure.

A checkpoint "at wave c" is the cut right after each stage's PUSH c-1: every stage of a VW has then run the
backwards of exactly the minibatches of waves < c, and each stage has forwarded at least what the next one
has (checked for every schedule in tests/test_resume.py), so the only messages crossing the cut are
activations a stage sent that its successor had not received: the sender sends them again on resume.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetpipe.core.pipeline.schedule import BACKWARD, FORWARD, PUSH, UPDATE, Action

__all__ = [
    "common_cut",
    "common_cuts",
    "cut_position",
    "forwarded_before",
    "rejoin_actions",
    "snapshot_floor",
    "wave_of_action",
]


def cut_position(actions: Sequence[Action], wave: int) -> int:
    """The index of the action after this stage's PUSH wave-1 (0 for wave 0): where a resume from `wave`
    starts."""
    if wave == 0:
        return 0
    for i, action in enumerate(actions):
        if action.kind == PUSH and action.index == wave - 1:
            return i + 1
    raise ValueError(f"no PUSH{wave - 1} in this stage's actions")


def forwarded_before(actions: Sequence[Action], position: int) -> set[int]:
    """The minibatches whose forward this stage ran before `position`."""
    return {a.index for a in actions[:position] if a.kind == FORWARD}


def wave_of_action(action: Action, nm: int) -> int:
    return action.index // nm if action.kind in (FORWARD, BACKWARD, UPDATE) else action.index


def rejoin_actions(actions: Sequence[Action], start_wave: int, nm: int) -> list[Action]:
    """A stage's actions from wave `start_wave` on (a rejoining VW skips the waves it missed). Every stage
    keeps the same subsequence of its list, so the lists still run against each other without deadlock."""
    return [a for a in actions if wave_of_action(a, nm) >= start_wave]


def snapshot_floor(c_global: int, every: int, keep: int, ps_oldest: int | None = None) -> int:
    """The oldest stage snapshot worth keeping: one that may match a checkpoint the PS still keeps. Its newest
    `keep` ones would be at multiples of `every` up to c_global; but checkpoints that failed (a full disk) or
    were passed over leave the PS's on disk older, so `ps_oldest`, the oldest checkpoint any shard says it
    keeps (0: none yet), lowers the floor to it."""
    floor = max(0, (c_global // every - keep + 1) * every)
    return floor if ps_oldest is None else min(floor, ps_oldest)


def common_cuts(ps_clocks: Sequence[Sequence[int]], stage_waves: Sequence[Sequence[int]]) -> list[int]:
    """The waves > 0 at which every shard has a checkpoint and every stage a snapshot, newest first."""
    sets = [set(c) for c in ps_clocks] + [set(w) for w in stage_waves]
    common = set.intersection(*sets) if sets else set()
    common.discard(0)
    return sorted(common, reverse=True)


def common_cut(ps_clocks: Sequence[Sequence[int]], stage_waves: Sequence[Sequence[int]]) -> int | None:
    """The newest wave at which every shard has a checkpoint and every stage a snapshot (None: there is
    none)."""
    return next(iter(common_cuts(ps_clocks, stage_waves)), None)

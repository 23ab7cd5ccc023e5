"""A shard's checkpoints: restoring from one at start, writing them, and how far each stage's pushes are safe.

docs/recovery.md: a push is durable once a checkpoint on disk holds it; clients keep their pushes from
`keep_from` on. The socket loop and the WSP state live elsewhere (server/shard.py, hetpipe.core.wsp.state).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hetpipe.core.wsp.state import ShardState, WspError
from hetpipe.server.checkpoint import (
    BackgroundWriter,
    discard_after,
    list_clocks,
    load_clock,
    load_newest,
    write_checkpoint,
)

if TYPE_CHECKING:
    from hetpipe.server.shard import ShardSettings

__all__ = ["ShardCheckpoints", "local_clocks"]


class ShardCheckpoints:
    """This shard's checkpoints: the newest clock written, the pushes on disk per stage, the writer thread."""

    def __init__(self, settings: ShardSettings, say: Callable[[str], None]) -> None:
        self.settings = settings
        self.say = say  # logs one line as this shard
        self.last_clock = -1  # the clock of the newest checkpoint written (or resumed from)
        self.durable: dict[tuple[int, int], int] = {}  # (vw, stage) -> its pushes in the newest checkpoint
        self.kept: list[int] = []  # clocks of the checkpoints on disk, oldest first (pruned as they are)
        self.writer: BackgroundWriter | None = None

    def restore(self) -> ShardState | None:
        """The state of the newest valid checkpoint (or of `resume_clock`'s, with the later ones dropped);
        None when there is none to restore."""
        settings = self.settings
        directory = settings.checkpoint_dir
        if directory is None:
            return None
        cut = settings.resume_clock
        ckpt = load_newest(directory, self.say) if cut is None else load_clock(directory, cut)
        if ckpt is None:
            return None
        meta = ckpt.meta
        if meta.get("run") != settings.run or meta["wsp"]["staleness"] != settings.staleness:
            self.say(
                f"note: checkpoint {ckpt.path.name} is of run "
                f"{meta.get('run')!r} with D={meta['wsp']['staleness']}; resuming it as it was written"
            )
        exact = meta["wsp"]["pull_mode"] == "exact"
        try:
            state = ShardState.from_state(
                meta["wsp"],
                ckpt.arrays,
                settings.make_aggregation(),
                cut=cut if exact else None,
                freeze=settings.freeze_schedule,
            )
        except WspError as exc:
            from hetpipe.core.errors import HetpipeError

            raise HetpipeError(f"shard {settings.shard}: cannot resume from {ckpt.path}: {exc}") from None
        if cut is not None:
            dropped = discard_after(directory, cut)
            if dropped:
                self.say(f"resuming from clock {cut}: dropped the later checkpoints {dropped}")
        self.last_clock = ckpt.clock
        self.durable = dict(state.pushed)
        self.kept = [c for c in list_clocks(directory) if c <= ckpt.clock]
        self.say(f"resumed from {ckpt.path} at clock {ckpt.clock} (c_local {state.status()['c_local']})")
        return state

    def start_writer(self) -> None:
        """Start the background writer when checkpoints come every few clocks."""
        settings = self.settings
        if settings.checkpoint_dir is not None and settings.checkpoint_every > 0:
            self.writer = BackgroundWriter(settings.checkpoint_dir, settings.checkpoint_keep, self.say)

    def close(self) -> None:
        """Wait for the checkpoint being written, then end the writer thread."""
        if self.writer is not None:
            self.writer.close()

    def due(self, clock: int, num_waves: int | None) -> str | None:
        """Why a checkpoint is due at this clock ("every N clocks", "the last clock"), or None."""
        every = self.settings.checkpoint_every
        if every and clock != self.last_clock and (clock % every == 0 or clock == num_waves):
            return f"every {every} clocks" if clock % every == 0 else "the last clock"
        return None

    def write(self, state: ShardState, reason: str, background: bool = False) -> Path | None:
        """Write a checkpoint of the state now (`background`: by the writer thread, while requests go on; the
        pushes it holds count as durable once it is on disk)."""
        settings = self.settings
        directory = settings.checkpoint_dir
        if directory is None:
            return None
        meta, arrays = state.to_state(detached=background)
        clock = state.c_global
        full_meta = {
            "run": settings.run,
            "shard": settings.shard,
            "c_local": local_clocks(state),
            "wsp": meta,
        }
        pushed = dict(state.pushed)
        self.last_clock = clock

        def done(path: Path) -> None:
            self.durable = pushed  # one assignment: the loop thread sees the old dict or this one
            kept = [*self.kept, clock]
            self.kept = kept[-settings.checkpoint_keep :] if settings.checkpoint_keep > 0 else kept
            self.say(f"checkpoint {path.name} written ({reason})")

        if background and self.writer is not None:
            self.writer.submit(clock, full_meta, arrays, done)
            return None
        if self.writer is not None:
            self.writer.drain()  # one writer at a time: the files and their pruning stay in order
        path = write_checkpoint(directory, clock, full_meta, arrays, settings.checkpoint_keep)
        done(path)
        return path

    @property
    def oldest(self) -> int:
        """The clock of the oldest checkpoint on disk (0: none yet): a stage keeps its snapshots from there,
        so that a resume finds a wave both hold though newer checkpoints failed (a full disk)."""
        return self.kept[0] if self.kept else 0

    def keep_from(self, state: ShardState, sid: tuple[int, int]) -> int:
        """The first wave of this stage whose push the client must keep: the shard may lose it in a crash."""
        if not self.settings.recoverable:
            return state.pushed[sid]  # nothing survives a crash here: keeping pushes would not help
        return min(self.durable.get(sid, state.epoch_start(sid[0])), state.pushed[sid])


def local_clocks(state: ShardState) -> list[int]:
    """c_local of every VW, in VW order (checkpoint meta and the status line)."""
    return [state.c_local(v) for v in range(state.num_vws or 0)]

"""A client surviving a shard's restart: it keeps its registration and pushes, registers again, resends."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hetpipe.core.protocol import wire
from hetpipe.worker.ps_calls import Call, PSError, Request, ShardCalls

__all__ = ["ShardRecovery"]


class ShardRecovery:
    """What a client keeps so that a shard's restart reaches no caller (docs/recovery.md#shard-crashes), and,
    as the ReplyWatcher of its ShardCalls, what it does when one happens.

    It keeps a copy of the registration and every push the shards have not all put in a checkpoint yet (acks
    say how far: `keep_from`). A restarted shard does not know the connection and answers `not_registered`:
    the client registers again (the reply says how many of its waves the shard holds), resends the pushes
    from there in order, then everything still unanswered. Only pushes it acknowledged and lost for good
    reach the caller (`fatal`, "lost").

    `push_requests(wave, tensors)` builds a push's requests, one per shard; `who` names the stage in
    messages."""

    def __init__(
        self,
        shards: int,
        push_requests: Callable[[int, Mapping[str, np.ndarray]], list[Request]],
        who: str,
    ) -> None:
        self.shards, self.push_requests, self.who = shards, push_requests, who
        self.registration: list[
            tuple[dict[str, Any], dict[str, np.ndarray]]
        ] = []  # per shard: fields, copies
        self.keep_from = [0] * shards  # per shard: pushes of earlier waves are in its checkpoint
        self.ckpt_from = [0] * shards  # per shard: the clock of its oldest checkpoint on disk (0: none)
        self.retained: dict[
            int, tuple[Mapping[str, np.ndarray], Call]
        ] = {}  # wave -> its push, until durable
        self.next_wave = 0  # pushes handed over so far (the next wave to push)
        self.restarts_seen = 0
        self._copy_on_retain: set[int] = (
            set()
        )  # waves whose arrays the caller will reuse (copy before keeping)
        self._rejoining: dict[int, int] = {}  # shard -> id of the registration sent to it again

    # ---- what the client keeps -------------------------------------------------------------------------
    def keep_registration(self, fields: dict[str, Any], part: Mapping[str, np.ndarray]) -> None:
        """Keep a copy of the registration sent to the next shard (without asking for W_0 again)."""
        self.registration.append(
            ({**fields, "want_weights": False}, {k: np.array(v) for k, v in part.items()})
        )

    def registered(self, start_wave: int, replies: Sequence[wire.Message]) -> None:
        """The shards answered the registration: how many of this stage's waves they hold, and from which
        wave on each still needs the pushes kept."""
        self.next_wave = max(start_wave, min(r.fields["pushed"] for r in replies))
        self.keep_from = [r.fields["keep_from"] for r in replies]
        self.ckpt_from = [r.fields["ckpt_from"] for r in replies]

    def keep_push(self, wave: int, tensors: Mapping[str, np.ndarray], call: Call, reused: bool) -> None:
        """Keep the push of `wave` until every shard has it in a checkpoint; `reused`: the caller will change
        its arrays once the call is done (they are copied then if they must still be kept)."""
        self.next_wave = max(self.next_wave, wave + 1)
        self.retained[wave] = (tensors, call)
        if reused:
            self._copy_on_retain.add(wave)

    def checkpoint_floor(self) -> int:
        """The oldest wave a stage snapshot may be needed for: the oldest checkpoint any shard keeps (a
        resume needs a wave every shard and every stage holds)."""
        return min(self.ckpt_from, default=0)

    def durable(self) -> bool:
        """Every shard has this stage's pushes in a checkpoint (a shard restarting now would lose none)."""
        return not (min(self.keep_from, default=0) < self.next_wave and self.registration)

    # ---- ReplyWatcher ------------------------------------------------------------------------------------
    def holds_back(self, shard: int, rid: int) -> bool:
        """A shard being registered again gets nothing else until it answers."""
        return shard in self._rejoining and self._rejoining[shard] != rid

    def refused(self, calls: ShardCalls, shard: int, msg: wire.Message) -> bool:
        """`not_registered` from a shard this client registered with: it restarted, so register again (the
        call stays open and goes again afterwards)."""
        if (
            msg.fields["code"] == "not_registered"
            and self.registration
            and self._rejoining.get(shard) != msg.fields["id"]
        ):
            self._rejoin(calls, shard)
            return True
        return False

    def answered(self, calls: ShardCalls, shard: int, msg: wire.Message, call: Call) -> None:
        """Acks and heartbeat replies say how far the shard's checkpoint goes; a registration again says
        what the restarted shard holds."""
        if msg.type in ("ack", "beat", "registered"):
            self.ckpt_from[shard] = msg.fields["ckpt_from"]
        if msg.type in ("ack", "beat"):
            self._acknowledged(shard, msg.fields["keep_from"], call)
        elif msg.type == "registered" and self._rejoining.get(shard) == msg.fields["id"]:
            self._registered_again(calls, shard, msg.fields["pushed"], msg.fields["keep_from"])

    # ---- what it does ------------------------------------------------------------------------------------
    def _acknowledged(self, shard: int, keep_from: int, call: Call) -> None:
        """Drop the pushes every shard has in a checkpoint; copy one about to be kept whose arrays get
        reused."""
        self.keep_from[shard] = max(self.keep_from[shard], keep_from)
        oldest = min(self.keep_from)
        for wave in [w for w in self.retained if w < oldest]:
            del self.retained[wave]
            self._copy_on_retain.discard(wave)
        if call.done and call.wave in self._copy_on_retain:
            tensors, _ = self.retained[call.wave]
            self.retained[call.wave] = ({k: np.array(v) for k, v in tensors.items()}, call)
            self._copy_on_retain.discard(call.wave)

    def _rejoin(self, calls: ShardCalls, shard: int) -> None:
        """Register with a restarted shard again (once; other requests to it wait for the answer)."""
        if shard in self._rejoining:
            return
        self.restarts_seen += 1
        fields, part = self.registration[shard]
        requests: list[Request | None] = [None] * self.shards
        requests[shard] = ("register", fields, part)
        self._rejoining[shard] = -2  # nothing goes to the shard until the registration is on its way
        call = calls.send(requests, what=f"registration with restarted shard {shard}", background="rejoin")
        self._rejoining[shard] = call.ids[shard]
        calls.send_due(time.monotonic())

    def _registered_again(self, calls: ShardCalls, shard: int, pushed: int, keep_from: int) -> None:
        """The restarted shard holds `pushed` of this stage's waves: resend the later ones it acknowledged
        before (in order), then let everything unanswered go again."""
        del self._rejoining[shard]
        self.keep_from[shard] = keep_from
        kept = sorted(self.retained)
        if pushed < self.next_wave and (not kept or kept[0] > pushed):
            calls.fatal = PSError(
                "lost",
                (
                    f"shard {shard} restarted holding {pushed} waves of {self.who}, "
                    f"but this stage pushed {self.next_wave} and kept only waves {kept[:1] + kept[-1:]}: "
                    "the shard's newest checkpoint is older than it said (corrupted?); the pushes in between "
                    "are gone. Restart the run with --resume"
                ),
            )
            return
        for wave in kept:
            tensors, call = self.retained[wave]
            if wave < pushed or (call.replies[shard] is None and not call.done):
                continue  # in the shard's state, or still open (it goes again below)
            requests: list[Request | None] = [None] * self.shards
            requests[shard] = self.push_requests(wave, tensors)[shard]
            calls.send(
                requests,
                what=f"push of wave {wave} again to restarted shard {shard}",
                wave=wave,
                background="resend",
            )
        calls.resend_to(shard)
        calls.send_due(time.monotonic())

"""Which virtual workers take part in which waves: the run's VWs, each one's epochs (the wave spans it
contributes), the spans a re-plan sets before the run (docs/wsp.md#planned-spans), eviction at a wave
boundary and rejoin from a later wave (docs/recovery.md#failed-vws)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetpipe.core.wsp.results import WspError

__all__ = ["OPEN", "Membership"]

OPEN = -1  # the end of a live VW's epoch


@dataclass
class Membership:
    """The run's VWs and their epochs: vw -> [[start, end or OPEN], ...], [[0, OPEN]] until a first eviction.
    A VW is live while its last epoch is open; wave t sums the VWs whose epoch covers t."""

    num_vws: int | None = None  # set by the first registration
    epochs: dict[int, list[list[int]]] = field(default_factory=dict)
    weights: tuple[int, ...] = ()  # each VW's weight by samples (hetpipe.core.wsp.work); (): every VW 1
    # node-local aggregation (docs/wsp.md#node-local-aggregation): each VW of a relayed group -> the group's
    # first VW, as which its relay registers and pushes the group's sum; VWs not listed push for themselves
    leaders: dict[int, int] = field(default_factory=dict)
    # planned spans: VW -> [start, end) it trains (end OPEN: to the run's end); a VW not listed: [0, OPEN)
    planned: dict[int, tuple[int, int]] = field(default_factory=dict)

    def plan(self, spans: dict[int, tuple[int, int]]) -> None:
        """Record the VWs' planned spans (before any of their epochs is)."""
        self.planned = dict(spans)

    def planned_end(self, vw: int) -> int:
        """The wave boundary VW `vw` retires at by plan (OPEN: none, it trains to the run's end)."""
        return self.planned.get(vw, (0, OPEN))[1]

    def due(self, vw: int, completed: int) -> bool:
        """Whether live VW `vw`, having `completed` waves, has reached its planned end (it retires now)."""
        end = self.planned_end(vw)
        return end != OPEN and completed >= end and self.live(vw)

    def retired(self, vw: int) -> bool:
        """Whether VW `vw` ended by plan: its epochs are its planned span, closed at the planned end."""
        start, end = self.planned.get(vw, (0, OPEN))
        return end != OPEN and self.spans(vw) == [[start, end]]

    def leader(self, vw: int) -> int:
        """The VW whose pushes carry VW `vw`'s updates: its group's first VW, or itself."""
        return self.leaders.get(vw, vw)

    def push_weight(self, vw: int) -> int:
        """What VW `vw`'s pushes are multiplied by where the rule weighs a key: its weight, or 1 for a relay's
        (its group's sum, each member's part already times its weight)."""
        return 1 if self.leaders.get(vw) == vw else self.weight(vw)

    def join_group(self, leader: int, members: list[int]) -> None:
        """Record a relay's group (its first VW `leader` and every member); refused when a member belongs to
        another group already."""
        if leader not in members or min(members) != leader:
            raise WspError("bad_message", f"a relay registers as its group's first VW, not vw {leader}")
        for m in members:
            if self.leaders.get(m, leader) != leader:
                raise WspError(
                    "conflict", f"vw {m} is relayed by vw {self.leaders[m]}'s relay, not vw {leader}'s"
                )
        self.leaders.update(dict.fromkeys(members, leader))

    def weight(self, vw: int) -> int:
        """VW `vw`'s weight by samples in a fold (1 when every VW does the same work)."""
        return self.weights[vw] if self.weights else 1

    def total(self, wave: int) -> int:
        """The summed weight of wave `wave`'s VWs (at least 1), the relayed ones included."""
        return max(1, sum(self.weight(v) for v in self._covering(wave)))

    def spans(self, vw: int) -> list[list[int]]:
        """VW `vw`'s epochs (recorded as [[planned start or 0, OPEN]] the first time it is asked about)."""
        return self.epochs.setdefault(vw, [[self.planned.get(vw, (0, OPEN))[0], OPEN]])

    def live(self, vw: int) -> bool:
        """A VW is live until evicted, and again once it rejoins."""
        return self.spans(vw)[-1][1] == OPEN

    def live_vws(self) -> list[int]:
        return [v for v in range(self.num_vws or 0) if self.live(v)]

    def start(self, vw: int) -> int:
        """The first wave of VW `vw`'s last epoch."""
        return self.spans(vw)[-1][0]

    def end(self, vw: int) -> int:
        """The wave boundary VW `vw` was last evicted at (OPEN while it is live)."""
        return self.spans(vw)[-1][1]

    def contributors(self, wave: int) -> list[int]:
        """Whose pushes wave `wave` sums, in order: the VWs whose epoch covers it, each relayed group as its
        first VW."""
        return [v for v in self._covering(wave) if self.leader(v) == v]

    def _covering(self, wave: int) -> list[int]:
        """The VWs whose epoch covers wave `wave`, in order (an open epoch no further than its planned end:
        a VW that will retire is no contributor of the waves after it, even before it retires)."""
        return [
            v
            for v in range(self.num_vws or 0)
            if any(s <= wave and (e == OPEN or wave < e) for s, e in self.spans(v))
            and (self.planned_end(v) == OPEN or wave < self.planned_end(v))
        ]

    def gaps(self) -> list[list[int]]:
        """[vw, from, to) wave ranges a VW contributes nothing to (before a planned start; evicted or retired,
        until it rejoined; to = -1: open)."""
        out = []
        for v in range(self.num_vws or 0):
            spans = self.spans(v)
            if spans[0][0] > 0:
                out.append([v, 0, spans[0][0]])
            for (_, end), nxt in zip(spans, [*spans[1:], None], strict=True):
                if end != OPEN:
                    out.append([v, end, OPEN if nxt is None else nxt[0]])
        return out

    def close(self, vw: int, completed: int) -> int:
        """End live VW `vw`'s epoch at its wave boundary (it is evicted): the waves it `completed`, at least
        its epoch's start. Returns that boundary."""
        boundary = max(completed, self.start(vw))
        self.spans(vw)[-1][1] = boundary
        return boundary

    def reopen(self, vw: int, start_wave: int, earliest: int, num_waves: int | None) -> bool:
        """Start a new epoch of evicted VW `vw` at wave `start_wave` (it rejoins); False for a retried rejoin
        (live from that wave already). Refused for a VW live from another wave, before `earliest`, or at or
        past the run's `num_waves`."""
        if self.live(vw):
            start = self.start(vw)
            if start == start_wave:
                return False
            raise WspError("conflict", f"vw {vw} is live (since wave {start}): only an evicted VW rejoins")
        if start_wave < earliest:
            raise WspError(
                "stale", f"vw {vw} cannot rejoin at wave {start_wave}: the earliest it may is {earliest}"
            )
        if num_waves is not None and start_wave >= num_waves:
            raise WspError(
                "stale", f"vw {vw} cannot rejoin at wave {start_wave}: the run has {num_waves} waves"
            )
        self.spans(vw).append([start_wave, OPEN])
        return True

    def ever_changed(self) -> bool:
        """Whether any VW was evicted (or rejoined) in this run: its epochs are not its planned span (open, or
        closed at the planned end)."""
        return any(
            spans != [[self.planned.get(v, (0, OPEN))[0], OPEN]] and not self.retired(v)
            for v, spans in self.epochs.items()
        )

    def check(self, vw: int) -> None:
        """Refuse a VW index that is not one of the run's."""
        if self.num_vws is None or not 0 <= vw < self.num_vws:
            raise WspError(
                "bad_message", f"vw {vw} is not a virtual worker of this run ({self.num_vws or 0} known)"
            )

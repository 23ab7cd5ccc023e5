"""Fuzz a live PS shard with N bad messages (launch/bench/fuzz_cases.py) and check every answer: no crash,
each message answered as the rules say (an error reply for every malformed or refused request; none only for a
frame over the size limit, which costs its connection), weights and clocks unchanged, a good client still
served, and the shard's resident memory flat (measured after a warm-up and at the end).

    python launch/bench/fuzz.py [--frames 100000] [--seed 1] [--out fuzz.json]

--frames counts messages (each one or more ZeroMQ frames; both counts are reported). Exit 1 on any failure.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuzz_cases import MEMBER_VW, REGISTER, RUN, WAVES_DONE, Case, CaseGenerator, model  # noqa: E402

from hetpipe.core.protocol import wire  # noqa: E402

__all__ = ["FuzzReport", "FuzzSession", "shard_rss"]

_PROBE_IDS = 2**61  # ids of the probes that wait out a reconnect; their late answers are skipped


def shard_rss(pid: int) -> int:
    """Resident memory of a process in bytes (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class FuzzReport:
    messages: int = 0
    zmq_frames: int = 0
    replies: int = 0
    error_replies: int = 0
    dropped: int = 0  # frames over the size limit: no reply, the connection is dropped and comes back
    parked: int = 0
    unanswered: int = 0
    crashes: int = 0
    unexpected: list[str] = field(default_factory=list)  # the first few answers that broke the rules
    unexpected_count: int = 0
    codes: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)

    def wrong(self, case: Case, what: str) -> None:
        self.unexpected_count += 1
        if len(self.unexpected) < 20:
            self.unexpected.append(f"{case.kind} ({case.sender}): {what}")

    @property
    def ok(self) -> bool:
        return self.crashes == 0 and self.unanswered == 0 and self.unexpected_count == 0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["codes"], out["kinds"] = dict(self.codes), dict(self.kinds)
        return out


class FuzzSession:
    """Three connections to a live shard of run RUN: good (vw 0), member (vw 1) and a stranger."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self.ctx = zmq.Context()
        self.socks: dict[str, zmq.Socket] = {}
        for name in ("good", "member", "stranger"):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 10)
            sock.setsockopt(zmq.ROUTING_ID, f"fuzz-{name}".encode())
            sock.connect(endpoint)
            self.socks[name] = sock
        self._ids = iter(range(2**60, _PROBE_IDS))  # apart from the cases' ids
        self._probes = iter(range(_PROBE_IDS, 2**62))
        self._probes_sent: set[int] = (
            set()
        )  # probes whose late answers may still come (a case may use such ids too)
        self._parked: int | None = None  # the member's pull waiting for its gate

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()
        self.ctx.term()

    # ---- plain requests ---------------------------------------------------------------------------------
    def _receive(self, sock: zmq.Socket, timeout_s: float, want: int | None = None) -> wire.Message | None:
        deadline = time.monotonic() + timeout_s
        while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            reply = wire.decode(sock.recv_multipart())
            rid = reply.fields.get("id")
            if isinstance(rid, int) and rid in self._probes_sent and reply.type == "status_reply":
                self._probes_sent.discard(rid)
                continue  # a late answer to a probe
            if want is None or rid == want:
                return reply
        return None

    def request(self, who: str, msg_type: str, fields: dict, tensors: dict | None = None) -> wire.Message:
        rid = next(self._ids)
        self.socks[who].send_multipart(wire.encode(msg_type, {"id": rid, "run": RUN, **fields}, tensors))
        reply = self._receive(self.socks[who], self.timeout_s, want=rid)
        if reply is None or reply.type == "error":
            raise AssertionError(f"{who} {msg_type} {fields}: {reply.fields if reply else 'no answer'}")
        return reply

    def setup(self) -> None:
        """Both VWs register the model and push waves 0..2 of ones: c_global 3, W = 0 + folded waves."""
        for who, vw in (("good", 0), ("member", MEMBER_VW)):
            self.request(
                who, "register", {"vw": vw, "stage": 0, **REGISTER, "want_weights": False}, model(0.0)
            )
        for wave in range(WAVES_DONE):
            for who, vw in (("good", 0), ("member", MEMBER_VW)):
                self.request(who, "push", {"vw": vw, "stage": 0, "wave": wave}, model(1.0))

    def snapshot(self) -> tuple[dict[str, np.ndarray], dict]:
        """The weights (read) and the clocks (status) as the good client sees them."""
        weights = {k: np.array(v.to_array()) for k, v in self.request("good", "read", {}).tensors.items()}
        return weights, self.request("good", "status", {}).fields["info"]

    def still_served(self) -> bool:
        """Wave 3 from both VWs, then the good client's pull of wave 5 holds W_4 = 4 waves x 2 VWs x 1.0."""
        for who, vw in (("good", 0), ("member", MEMBER_VW)):
            self.request(who, "push", {"vw": vw, "stage": 0, "wave": WAVES_DONE}, model(1.0))
        pulled = self.request("good", "pull", {"vw": 0, "stage": 0, "wave": WAVES_DONE + 2})
        return all(bool((v.to_array() == 2.0 * (WAVES_DONE + 1)).all()) for v in pulled.tensors.values())

    # ---- fuzz -------------------------------------------------------------------------------------------
    def run(self, cases: Iterable[Case], count: int, report: FuzzReport, alive: Callable[[], bool]) -> None:
        for i, case in zip(range(count), cases, strict=False):
            self.send(case, report)
            if i % 500 == 0 and not alive():
                report.crashes += 1
                return

    def send(self, case: Case, report: FuzzReport) -> None:
        sock = self.socks[case.sender]
        report.messages += 1
        report.zmq_frames += len(case.frames)
        report.kinds[case.kind] += 1
        sock.send_multipart(case.frames)
        if case.expect.dropped:
            report.dropped += 1
            self._wait_reconnect(sock, report, case)
            return
        if case.expect.parked:
            report.parked += 1
            if self._parked is not None:  # the pull it replaces is answered now
                self._check(
                    case, self._receive(sock, self.timeout_s, want=self._parked), report, replaced=True
                )
            self._parked = case.request_id
            return
        self._check(case, self._receive(sock, self.timeout_s), report)

    def _check(
        self, case: Case, reply: wire.Message | None, report: FuzzReport, replaced: bool = False
    ) -> None:
        if reply is None:
            report.unanswered += 1
            report.wrong(case, "no answer")
            return
        report.replies += 1
        if reply.type == "error":
            report.error_replies += 1
            report.codes[reply.fields["code"]] += 1
        if replaced:
            if reply.type != "error" or reply.fields["code"] != "conflict":
                report.wrong(case, f"the replaced pull got {reply.type} {reply.fields}")
            return
        if not case.expect.allows(reply):
            report.wrong(case, f"got {reply.type} {str(reply.fields)[:200]}, expected {case.expect}")
        elif case.request_id is not None and reply.fields.get("id") != case.request_id:
            report.wrong(case, f"reply id {reply.fields.get('id')} for request {case.request_id}")

    def _wait_reconnect(self, sock: zmq.Socket, report: FuzzReport, case: Case) -> None:
        """An oversized frame dropped the connection: probe with status until it answers again."""
        for _ in range(100):
            probe = next(self._probes)
            self._probes_sent.add(probe)
            sock.send_multipart(wire.encode("status", {"id": probe, "run": RUN}))
            if sock.poll(200):
                while sock.poll(0):
                    reply = wire.decode(sock.recv_multipart())
                    if reply.type == "error" and reply.fields.get("id") != probe:
                        report.wrong(case, f"an oversized frame got an answer: {reply.fields}")
                return
        report.unanswered += 1
        report.wrong(case, "the connection never came back after an oversized frame")


# ---------------------------------------------------------------------------------------------------------


@click.command()
@click.option(
    "--frames",
    "count",
    type=click.IntRange(min=1),
    default=100_000,
    show_default=True,
    help="Fuzzed messages to send.",
)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=1000,
    show_default=True,
    help="Messages sent before the first memory reading.",
)
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the report as JSON."
)
def main(count: int, seed: int, warmup: int, out: Path | None) -> None:
    from hetpipe.core.runs.procs import ChildGroup
    from hetpipe.server.launch import serve_settings
    from hetpipe.server.shard import ShardSettings

    logs = Path(tempfile.mkdtemp(prefix="hetpipe-fuzz-"))
    report = FuzzReport()
    started = time.monotonic()
    with ChildGroup(logs) as group:
        queue = group.ctx.Queue()
        child = group.start("ps", serve_settings, ShardSettings(RUN, 0, "tcp://127.0.0.1:0", 0), queue)
        session = FuzzSession(f"tcp://127.0.0.1:{queue.get(timeout=60)}")
        try:
            session.setup()
            before = session.snapshot()
            cases = CaseGenerator(seed)
            session.run(cases, min(warmup, count), report, child.process.is_alive)
            rss_before = shard_rss(child.process.pid)
            session.run(cases, count - min(warmup, count), report, child.process.is_alive)
            alive = child.process.is_alive()
            report.crashes += 0 if alive else 1
            rss_after = shard_rss(child.process.pid) if alive else 0
            after = session.snapshot() if alive else before
            unchanged = all(np.array_equal(before[0][k], after[0][k]) for k in before[0]) and all(
                before[1][k] == after[1][k] for k in ("c_global", "c_local", "version", "registered")
            )
            served = alive and session.still_served()
        finally:
            session.close()
    took = time.monotonic() - started
    result = {
        "seed": seed,
        **report.to_dict(),
        "rss_before": rss_before,
        "rss_after": rss_after,
        "state_unchanged": unchanged,
        "good_client_served": served,
        "seconds": round(took, 1),
        "shard_log": str(logs / "ps.log"),
    }
    print(
        f"messages {report.messages} ({report.zmq_frames} ZeroMQ frames) in {took:.0f} s; "
        f"replies {report.replies} ({report.error_replies} errors); "
        f"dropped with their connection (oversized) {report.dropped}; parked {report.parked}; "
        f"unanswered {report.unanswered}; crashes {report.crashes}"
    )
    print(
        f"shard RSS after {warmup} warm-up messages {rss_before / 2**20:.1f} MiB, "
        f"at the end {rss_after / 2**20:.1f} MiB; "
        f"weights and clocks unchanged: {unchanged}; a good client still served: {served}"
    )
    print("error codes: " + ", ".join(f"{k} {v}" for k, v in report.codes.most_common()))
    for line in report.unexpected:
        print(f"UNEXPECTED {line}")
    if out is not None:
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    if not (report.ok and unchanged and served):
        raise SystemExit(1)


if __name__ == "__main__":
    main()

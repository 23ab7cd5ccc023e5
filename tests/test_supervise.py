"""What `hetpipe train` does about a child that died (hetpipe.app.supervise.on_exit)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import types

import pytest

from hetpipe.app.supervise import Supervisor, first_failure, on_exit
from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.errors import HetpipeError
from hetpipe.core.runs.procs import Child, ChildFailed

from conftest import write_config


@pytest.mark.parametrize(
    ("settings", "name", "code", "restarts", "evicted", "live", "action", "text"),
    [
        ([], "ps-shard-1", -9, 0, False, 2, "stop", "with [checkpoint] every = 0 it cannot be restarted"),
        (
            ["checkpoint.every=1"],
            "ps-shard-1",
            -9,
            0,
            False,
            2,
            "restart",
            "killed by SIGKILL; restarting it from its newest checkpoint (restart 1 of at most 10)",
        ),
        (
            ["checkpoint.every=1", "ps.max_restarts=3"],
            "ps-shard-0",
            1,
            3,
            False,
            2,
            "stop",
            "after 3 restarts",
        ),
        ([], "vw1-s0", -9, 0, False, 2, "stop", "vw1-s0 killed by SIGKILL"),
        (["ps.on_vw_failure=evict"], "vw1-s0", -9, 0, False, 2, "evict", "evicting its VW, the others go on"),
        (["ps.on_vw_failure=evict"], "vw1-s0", 3, 0, False, 2, "evict", "the PS evicted its VW"),
        (["ps.on_vw_failure=evict"], "vw1-s1", -9, 0, True, 1, "gone", "its VW is evicted already"),
        (["ps.on_vw_failure=evict"], "vw0-s0", 1, 0, False, 1, "stop", "was the last one live"),
    ],
)
def test_what_a_dead_child_leads_to(tmp_path, settings, name, code, restarts, evicted, live, action, text):
    config = load_config(write_config(tmp_path, vws=[["n0:0"], ["n0:1"]], nm=2, staleness=0, waves=4))
    config = apply_overrides(config, ['checkpoint.dir="ps"', *settings])
    decision = on_exit(config, name, code, restarts, evicted, live)
    assert decision.action == action and text in decision.why, decision


class _FakePS:
    """The admin client's status call, answering what the shards would (or failing like a restarting
    shard)."""

    def __init__(self, lives: list[list[int]] | None) -> None:
        self.lives, self.timeout_s = lives, 60.0

    def __enter__(self) -> _FakePS:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def status(self) -> list[dict]:
        if self.lives is None:
            raise HetpipeError("no answer from shard 1")
        return [{"live": live} for live in self.lives]


def _supervisor(tmp_path, lives: list[list[int]] | None) -> Supervisor:
    config = load_config(write_config(tmp_path, vws=[["n0:0"], ["n0:1"]], nm=2, staleness=0, waves=4))
    return Supervisor(
        config,
        group=None,
        run_dir=tmp_path,
        shard_jobs=[],
        shards=[],
        stages={(0, 0): None, (1, 0): None},
        admin=lambda: _FakePS(lives),
    )


def test_a_vw_that_rejoined_through_a_worker_counts_as_live(tmp_path):
    """chaos.py found it: the launcher evicted vw 1, `hetpipe worker --join` brought it back, and when vw 0
    then failed the launcher, counting vw 1 out, stopped the run as if vw 0 were the last VW live."""
    supervisor = _supervisor(tmp_path, [[0, 1], [0, 1]])
    supervisor.evicted.add(1)
    assert supervisor.live_vws() == [0]
    assert supervisor.live_at_ps() == 2
    assert _supervisor(tmp_path, [[0], [0, 1]]).live_at_ps() == 2  # live at any shard (one may lag a wave)


def test_without_an_answer_from_the_ps_the_launchers_own_count_decides(tmp_path):
    supervisor = _supervisor(tmp_path, None)
    supervisor.evicted.add(1)
    assert supervisor.live_at_ps() == 1


def test_the_run_ends_once_every_live_vw_is_done_and_in_a_checkpoint(tmp_path):
    supervisor = _supervisor(tmp_path, [[0, 1]])
    assert supervisor.all_live_done(4)  # nobody evicted: the launcher's own stages were all there was
    supervisor.evicted.add(1)
    for infos, done in [
        ([{"c_global": 4, "not_durable": []}] * 2, True),
        ([{"c_global": 4, "not_durable": []}, {"c_global": 3, "not_durable": []}], False),
        ([{"c_global": 4, "not_durable": ["1/0"]}, {"c_global": 4, "not_durable": []}], False),
    ]:
        supervisor.admin = lambda infos=infos: _StatusPS(infos)
        assert supervisor.all_live_done(4) is done, infos
    supervisor.admin = lambda: _FakePS(None)
    assert not supervisor.all_live_done(4)  # no answer: keep serving


class _StatusPS(_FakePS):
    def __init__(self, infos: list[dict]) -> None:
        super().__init__([])
        self.infos = infos

    def status(self) -> list[dict]:
        return self.infos


class _Proc:
    """A child's process as the supervisor reads it: a real `sleep` (to stop and kill), or one that ended."""

    def __init__(self, code: int | None = None, stopped: bool = False) -> None:
        self.popen = None if code is not None else subprocess.Popen(["sleep", "60"])
        self.code = code
        if stopped and self.popen is not None:
            os.kill(self.popen.pid, signal.SIGSTOP)

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else 2**22 + 7

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll() if self.popen is not None else self.code

    def join(self, timeout: float | None = None) -> None:
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout)

    def end(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


class _EvictingPS(_StatusPS):
    """Shards that answer status with `infos` and take evict requests (recording them)."""

    def __init__(self, infos: list[dict], asked: list[int]) -> None:
        super().__init__(infos)
        self.sockets, self.asked = [None] * len(infos), asked

    def send(self, requests: list, what: str = "") -> list:
        self.asked.extend(fields["vw"] for _, fields, _ in requests)
        return requests

    def wait(self, calls: list) -> list:
        return [types.SimpleNamespace(fields={"at_wave": 2}) for _ in calls]


def _stages_supervisor(tmp_path, settings, procs: dict, infos: list[dict], asked: list[int], events: list):
    config = load_config(write_config(tmp_path, vws=[["n0:0"], ["n0:1", "n0:2"]], nm=2, staleness=0, waves=4))
    config = apply_overrides(config, settings)
    stages = {(v, s): Child(f"vw{v}-s{s}", proc, None) for (v, s), proc in procs.items()}
    return Supervisor(
        config,
        group=None,
        run_dir=tmp_path,
        shard_jobs=[],
        shards=[],
        stages=stages,
        admin=lambda: _EvictingPS(infos, asked),
        say=lambda line: None,
        record=lambda event, **fields: events.append((event, fields)),
    )


def _info(live: list[int], ages: dict[str, float] | None = None) -> dict:
    return {"live": live, "num_vws": 2, "heartbeat_age_s": ages or {}, "c_global": 1, "not_durable": []}


def test_a_vw_the_ps_evicted_for_a_hung_stage_is_evicted_not_the_run_stopped(tmp_path):
    """Issue 36: vw1-s1 was stopped (SIGSTOP), the PS evicted vw 1 after hung_after_s, vw1-s0 heard so and
    exited 3; the launcher, counting live VWs as the PS saw them after that eviction (1), stopped the run as
    if vw 1 had been the last VW live, and left the stopped stage behind."""
    procs = {(0, 0): _Proc(), (1, 0): _Proc(code=3), (1, 1): _Proc(stopped=True)}
    asked, events = [], []
    try:
        supervisor = _stages_supervisor(
            tmp_path, ["ps.on_vw_failure=evict"], procs, [_info([0]), _info([0])], asked, events
        )
        supervisor.tick()
        assert supervisor.evicted == {1} and asked == [1, 1]
        assert procs[(1, 1)].exitcode == -signal.SIGKILL  # the stopped stage is killed, not left behind
        assert procs[(0, 0)].exitcode is None
        assert ("vw_evicted", {"vw": 1, "at_wave": [2, 2]}) in events
    finally:
        for proc in procs.values():
            proc.end()


def test_a_vw_the_ps_evicted_while_its_only_stage_hangs_is_seen_and_its_stage_killed(tmp_path):
    """A one-stage VW whose stage is stopped: no process of it exits, so only the PS's live set says it is
    out; the launcher used to wait for the stopped stage for ever."""
    procs = {(0, 0): _Proc(stopped=True), (1, 0): _Proc(), (1, 1): _Proc()}
    ages = {"0/0": 4.1, "1/0": 0.2, "1/1": 0.3}
    asked, events = [], []
    try:
        supervisor = _stages_supervisor(
            tmp_path,
            ["ps.on_vw_failure=evict", "ps.heartbeat_s=0.5", "ps.hung_after_s=3"],
            procs,
            [_info([1], ages)],
            asked,
            events,
        )
        supervisor.tick()
        assert supervisor.evicted == {0} and asked == [0]
        assert procs[(0, 0)].exitcode == -signal.SIGKILL
        assert procs[(1, 0)].exitcode is None and supervisor.stages_running()
        exits = [fields for event, fields in events if event == "child_exit"]
        assert [e["name"] for e in exits] == ["vw0-s0"] and "no heartbeat for 4.1 s" in exits[0]["why"]
    finally:
        for proc in procs.values():
            proc.end()


def test_the_last_live_vw_evicted_by_the_ps_stops_the_run_naming_its_silent_stage(tmp_path):
    procs = {(0, 0): _Proc(stopped=True), (1, 0): _Proc(code=3), (1, 1): _Proc(code=3)}
    try:
        supervisor = _stages_supervisor(
            tmp_path, ["ps.on_vw_failure=evict"], procs, [_info([], {"0/0": 70.0})], [], []
        )
        supervisor.evicted.add(1)
        supervisor._handled.update({"vw1-s0", "vw1-s1"})
        with pytest.raises(ChildFailed, match="vw0-s0 .*no heartbeat for 70.0 s.*the last one live"):
            supervisor.tick()
    finally:
        for proc in procs.values():
            proc.end()


def test_the_stage_killed_by_a_signal_is_blamed_not_the_neighbour_it_took_down(tmp_path):
    """Issue 36: vw1-s1 was SIGKILLed, vw1-s0 then failed on "Connection reset by peer" and exited 1; the
    launcher named vw1-s0 (the first in its order) and "killed by SIGKILL" appeared nowhere."""
    procs = {(0, 0): _Proc(), (1, 0): _Proc(code=1), (1, 1): _Proc(code=-signal.SIGKILL)}
    events = []
    try:
        supervisor = _stages_supervisor(tmp_path, [], procs, [_info([0, 1])], [], events)
        with pytest.raises(ChildFailed) as failed:
            supervisor.tick()
        assert failed.value.child.name == "vw1-s1"
        assert str(failed.value).startswith("vw1-s1 (pid") and "killed by SIGKILL" in str(failed.value)
        assert "vw1-s0 (exited with code 1)" in str(failed.value)
        exits = [fields for event, fields in events if event == "child_exit"]
        assert [e["name"] for e in exits] == ["vw1-s1"] and "killed by SIGKILL" in exits[0]["why"]
    finally:
        for proc in procs.values():
            proc.end()


@pytest.mark.parametrize(
    ("ends", "first"),
    [
        ([("vw1-s0", 1, 0.0), ("vw1-s1", -9, 0.0)], "vw1-s1"),  # a signal before a plain exit
        ([("vw1-s0", 1, 0.0), ("vw1-s1", -9, 0.4)], "vw1-s1"),  # even seen a little later
        ([("vw0-s0", -15, 0.5), ("vw1-s1", -9, 0.1)], "vw1-s1"),  # of two signals, the earlier
        ([("vw0-s0", 1, 0.3), ("vw0-s1", 3, 0.1)], "vw0-s1"),  # no signal: the earliest exit
        ([("vw0-s0", 1, 0.1), ("vw0-s1", 1, 0.1)], "vw0-s0"),  # a tie: the first in order
    ],
)
def test_which_of_the_children_that_ended_together_is_blamed(ends, first):
    assert first_failure(ends) == first

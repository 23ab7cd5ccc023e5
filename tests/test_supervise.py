"""What `hetpipe train` does about a child that died (hetpipe.app.supervise.on_exit)."""

from __future__ import annotations

import pytest

from hetpipe.app.supervise import Supervisor, on_exit
from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.errors import HetpipeError

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

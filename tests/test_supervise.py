"""What `hetpipe train` does about a child that died (hetpipe.app.supervise.on_exit)."""

from __future__ import annotations

import pytest

from hetpipe.app.supervise import on_exit
from hetpipe.core.config import apply_overrides, load_config

from conftest import write_config


@pytest.mark.parametrize(("settings", "name", "code", "restarts", "evicted", "live", "action", "text"), [
    ([], "ps-shard-1", -9, 0, False, 2, "stop", "with [checkpoint] every = 0 it cannot be restarted"),
    (["checkpoint.every=1"], "ps-shard-1", -9, 0, False, 2, "restart", "killed by SIGKILL; restarting it from its "
                                                                      "newest checkpoint (restart 1 of at most 10)"),
    (["checkpoint.every=1", "ps.max_restarts=3"], "ps-shard-0", 1, 3, False, 2, "stop", "after 3 restarts"),
    ([], "vw1-s0", -9, 0, False, 2, "stop", "vw1-s0 killed by SIGKILL"),
    (["ps.on_vw_failure=evict"], "vw1-s0", -9, 0, False, 2, "evict", "evicting its VW, the others go on"),
    (["ps.on_vw_failure=evict"], "vw1-s0", 3, 0, False, 2, "evict", "the PS evicted its VW"),
    (["ps.on_vw_failure=evict"], "vw1-s1", -9, 0, True, 1, "gone", "its VW is evicted already"),
    (["ps.on_vw_failure=evict"], "vw0-s0", 1, 0, False, 1, "stop", "was the last one live"),
])
def test_what_a_dead_child_leads_to(tmp_path, settings, name, code, restarts, evicted, live, action, text):
    config = load_config(write_config(tmp_path, vws=[["n0:0"], ["n0:1"]], nm=2, staleness=0, waves=4))
    config = apply_overrides(config, ['checkpoint.dir="ps"', *settings])
    decision = on_exit(config, name, code, restarts, evicted, live)
    assert decision.action == action and text in decision.why, decision

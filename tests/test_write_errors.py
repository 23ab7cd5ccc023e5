"""A full disk is named, not a traceback: checkpoint and metrics writes raise WriteError naming ENOSPC and the
path, and a checkpoint leaves no temporary file behind (issue 36 item 5)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from hetpipe.core.errors import HetpipeError, WriteError
from hetpipe.core.runs import checkpoint
from hetpipe.core.runs.metrics import MetricsWriter


def test_a_checkpoint_on_a_full_disk_names_enospc_and_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint.os, "fsync", full)
    with pytest.raises(
        WriteError, match=r"cannot write .*ckpt-00000004\.bin\.tmp: No space left on device \(ENOSPC\)"
    ):
        checkpoint.write_checkpoint(tmp_path, 4, {}, {"w": np.zeros(1000, np.float32)}, keep=2)
    assert list(tmp_path.iterdir()) == []  # no .tmp, no manifest


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_metrics_on_a_full_device_name_enospc_and_the_file() -> None:
    writer = MetricsWriter("/dev/full")
    with pytest.raises(
        HetpipeError, match=r"cannot write /dev/full: No space left on device \(ENOSPC\); free"
    ):
        writer.write("run_start", config="c.toml")
    writer.close()  # closing after the failure raises nothing more: the buffer went with the failed flush


def test_failed_checkpoints_reach_the_summary_and_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    from hetpipe.app.train_summary import _checkpoint_failures

    assert _checkpoint_failures([{"c_global": 4}, {"checkpoint_failures": 0}]) == {}
    infos = [{"checkpoint_failures": 2, "checkpoint_error": "clock 4: cannot write x: ENOSPC"}, {}]
    assert _checkpoint_failures(infos) == {
        "checkpoint_failures": 2,
        "checkpoint_errors": ["clock 4: cannot write x: ENOSPC"],
    }
    assert "warning: 2 PS checkpoint(s) failed" in capsys.readouterr().err


def test_a_stage_that_failed_is_not_hidden_by_a_neighbour_gone_while_it_closes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hetpipe.worker.stage import close_all

    closed = []

    def gone() -> None:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:8115")

    close_all([gone, lambda: closed.append("p2p")], failed=True)  # the snapshot's WriteError goes on up
    assert closed == ["p2p"]  # every closer ran
    said = capsys.readouterr().err
    assert "while closing after the failure: RuntimeError: Connection closed by peer" in said
    with pytest.raises(RuntimeError, match="closed by peer"):  # a stage that did not fail: the error is its
        close_all([gone, lambda: closed.append("p2p")], failed=False)
    assert closed == ["p2p", "p2p"]


def test_the_error_shown_is_the_cause_not_a_neighbour_that_lost_its_peer() -> None:
    from hetpipe.app.train_loop import root_cause

    gloo = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:8115"
    disk = "WriteError: cannot write run/stages/vw0-s1/.ckpt-8.bin.tmp: No space left on device (ENOSPC)"
    failures = {
        "vw0-s0": {"error": gloo, "time": 1.0},
        "vw1-s1": {"error": disk.replace("vw0-s1", "vw1-s1"), "time": 2.5},
        "vw0-s1": {"error": disk, "time": 2.0},
        "vw1-s0": {"error": "RuntimeError: Connection reset by peer", "time": 0.5},
    }
    assert root_cause("vw0-s0", failures) == "vw0-s1"  # the first that said what went wrong
    assert root_cause("vw1-s1", failures) == "vw1-s1"  # its own error: kept
    only_peers = {name: f for name, f in failures.items() if name in ("vw0-s0", "vw1-s0")}
    assert root_cause("vw0-s0", only_peers) == "vw0-s0"  # nobody said more
    assert root_cause("ps-shard-0", failures) == "ps-shard-0"  # no stage error of its own: it is the one

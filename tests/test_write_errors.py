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

"""Inputs refused before any process starts or waits: a dataset that cannot load (check_dataset, called by
`hetpipe train`'s guards: a missing directory, an unknown name or option, a missing module), a VW the run
lacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hetpipe.compute.data import check_dataset
from hetpipe.core.errors import UsageError

from conftest import write_config


def test_what_would_fail_to_load_is_found_without_loading(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such directory"):
        check_dataset(str(tmp_path / "missing"))
    with pytest.raises(UsageError, match='unknown dataset "mnsit".*did you mean "mnist"'):
        check_dataset("mnsit")
    with pytest.raises(UsageError, match='has no option "siez"'):
        check_dataset("synthetic", siez=3)
    with pytest.raises(UsageError, match="no module 'nowhere_at_all.sub' to import"):
        check_dataset("nowhere_at_all.sub:load")
    (tmp_path / "d").mkdir()
    np.save(tmp_path / "d" / "x.npy", np.zeros((4, 2), np.float32))
    check_dataset(str(tmp_path / "d"))
    check_dataset("mnist")


def test_train_refuses_a_missing_data_directory_before_starting_anything(tmp_path: Path) -> None:
    missing = tmp_path / "no-data"
    path = write_config(tmp_path, vws=[["n0:0"]], nm=2, staleness=0, waves=2)
    path.write_text(path.read_text().replace('name = "mnist"', f'name = "{missing}"'))
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "hetpipe", "train", str(path), "--run-dir", str(run_dir), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert f'dataset "{missing}": no such directory' in done.stderr and "Traceback" not in done.stderr
    assert not (run_dir / "logs").exists()  # no PS, no stage


def test_a_worker_for_a_vw_the_run_does_not_have_is_refused_before_it_waits_on_the_ps(tmp_path: Path) -> None:
    """`hetpipe worker --vw 7 --join RUN` on a 2-VW run: exit 2 at once, not after the PS wait (30 s)."""
    path = write_config(tmp_path, vws=[["n0:0"], ["n0:1"]], nm=2, staleness=0, waves=2)
    run = tmp_path / "run"
    run.mkdir()
    (run / "ps.json").write_text('{"endpoints": ["tcp://127.0.0.1:9"], "run": "test", "audit": false}')
    done = subprocess.run(
        [sys.executable, "-m", "hetpipe", "worker", "--config", str(path), "--vw", "7", "--join", str(run)],
        capture_output=True,
        text=True,
        timeout=25,  # a hang guard: the PS wait alone is 30 s
    )
    assert done.returncode == 2, done.stderr
    assert "--vw 7 is out of range" in done.stderr and "Traceback" not in done.stderr

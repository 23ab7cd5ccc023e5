"""`hetpipe train --resume` refuses, before any process starts, to continue another run than the one started
in the run dir (hetpipe.app.resume_check): a computing setting changed by --set, or --audit unlike the first
start; watching and serving settings may change."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetpipe.app.resume_check import check_resume
from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.config.serialize import config_toml
from hetpipe.core.errors import UsageError

from conftest import write_config


def _started(tmp_path: Path, audit: bool = False) -> tuple[Path, object]:
    config = load_config(write_config(tmp_path, vws=[["n0:0"], ["n0:1"]], nm=2, staleness=0, waves=4))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(config_toml(config))
    (run_dir / "ps.json").write_text(json.dumps({"endpoints": [], "run": "test", "audit": audit}))
    return run_dir, config


@pytest.mark.parametrize(("setting", "field"), [("seed=7", "seed"), ("wsp.nm=3", "wsp.nm")])
def test_a_computing_setting_changed_on_resume_is_refused_naming_it(
    tmp_path: Path, setting: str, field: str
) -> None:
    run_dir, config = _started(tmp_path)
    with pytest.raises(UsageError, match=rf"started with other settings \({field}: "):
        check_resume(run_dir, apply_overrides(config, [setting]), audit=False)


def test_watching_settings_may_change_and_the_same_config_passes(tmp_path: Path) -> None:
    run_dir, config = _started(tmp_path)
    check_resume(run_dir, config, audit=False)
    check_resume(run_dir, apply_overrides(config, ["train.eval_every=2", "ps.timeout_s=5.0"]), audit=False)


def test_audit_must_be_as_at_the_start(tmp_path: Path) -> None:
    run_dir, config = _started(tmp_path, audit=True)
    with pytest.raises(UsageError, match="started with --audit"):
        check_resume(run_dir, config, audit=False)
    check_resume(run_dir, config, audit=True)


def test_the_cli_refuses_with_exit_2_and_no_traceback(tmp_path: Path) -> None:
    run_dir, _ = _started(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "hetpipe", "train", "--resume", str(run_dir), "--set", "seed=7"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "seed: 3 -> 7" in done.stderr and "Traceback" not in done.stderr
    assert not (run_dir / "logs").exists()  # nothing started

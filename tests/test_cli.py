"""The CLI as a user meets it: exit codes, messages without tracebacks, the schedule grid."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

GOOD_HEAD = 'name = "x"\n[gpu_types.a]\nspeed = 1.0\nmemory_gib = 2.0\n[[nodes]]\nname = "n0"\ngpus = ["a"]\n'


def hetpipe(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetpipe", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout
    )


@pytest.mark.parametrize(
    ("body", "field", "fix"),
    [
        (GOOD_HEAD + "[wsp]\nstalenes = 1\n", "wsp.stalenes", 'did you mean "staleness"'),
        (GOOD_HEAD + "[wsp]\nstaleness = -1\n", "wsp.staleness", "integer >= 0"),
        (GOOD_HEAD.replace("speed = 1.0\n", ""), "gpu_types.a.speed", "add `speed ="),
    ],
)
def test_bad_config_exits_2_naming_the_field(tmp_path: Path, body: str, field: str, fix: str):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    result = hetpipe("server", "--config", str(path))
    assert result.returncode == 2
    assert "bad.toml" in result.stderr and field in result.stderr and fix in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_config_and_bad_shard(tmp_path: Path):
    result = hetpipe("server", "--config", str(tmp_path / "nope.toml"))
    assert result.returncode == 2 and "no such config file" in result.stderr
    result = hetpipe("server", "--shard", "3")
    assert result.returncode == 2 and "--shard 3 is out of range" in result.stderr


def test_schedule_grid_and_unknown_schedule():
    result = hetpipe("schedule", "--stages", "2", "--nm", "2", "--waves", "1", "--lists")
    assert result.returncode == 0
    assert result.stdout.splitlines()[1:] == ["stage 0: F0 F1 B0 U0 B1 U1 PUSH0", "stage 1: F0 B0 U0 F1 B1 U1 PUSH0"]
    result = hetpipe("schedule", "--stages", "2", "--nm", "2", "--waves", "1", "--lists", "--name", "gpipe")
    assert result.stdout.splitlines()[1:] == ["stage 0: F0 F1 B0 B1 U1 PUSH0", "stage 1: F0 F1 B0 B1 U1 PUSH0"]
    result = hetpipe("schedule", "--name", "gpip")
    assert result.returncode == 2 and "known schedules: 1f1b-flush, gpipe, pipedream-2bw, wsp" in result.stderr
    assert 'did you mean "gpipe"' in result.stderr


def test_train_refuses_a_run_dir_holding_earlier_checkpoints(tmp_path: Path):
    # The PS would resume from them while the stages start at wave 0, and every pull would be refused.
    shard = tmp_path / "run" / "ps" / "shard-0"
    shard.mkdir(parents=True)
    (shard / "ckpt-00000200.json").write_text("{}")
    result = hetpipe("train", "--run-dir", str(tmp_path / "run"), "--quiet")
    assert result.returncode == 2
    assert "already holds PS checkpoints" in result.stderr and "give a new --run-dir" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run" / "logs").exists()


@pytest.mark.parametrize("command", ["train", "plan", "server", "worker"])
def test_set_is_validated_like_the_file_on_every_command(tmp_path: Path, command: str):
    path = tmp_path / "ok.toml"
    path.write_text(GOOD_HEAD)
    where = [str(path)] if command in ("train", "plan") else ["--config", str(path)]
    extra = ["--vw", "0"] if command == "worker" else []
    result = hetpipe(command, *where, *extra, "--set", "wsp.nm=0")
    assert result.returncode == 2, result.stderr
    assert "ok.toml with --set wsp.nm=0: wsp.nm: must be >= 1, got 0" in result.stderr
    assert "Traceback" not in result.stderr

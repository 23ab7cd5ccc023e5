"""The CLI as a user meets it: exit codes, messages without tracebacks, the schedule grid."""

from __future__ import annotations

import re
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


def test_a_local_placement_over_several_hosts_says_which_shard_to_start_where(tmp_path: Path):
    body = GOOD_HEAD.replace('name = "n0"', 'name = "n0"\nhost = "10.0.0.5"') + (
        '[[nodes]]\nname = "n1"\nhost = "10.0.0.6"\ngpus = ["a"]\n[ps]\nshards = 2\nplacement = "local"\n'
    )
    path = tmp_path / "two.toml"
    path.write_text(body)
    result = hetpipe("server", "--config", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        "`hetpipe server --shard 0` on n0 (10.0.0.5); `hetpipe server --shard 1` on n1 (10.0.0.6)"
        in result.stderr
    )


def test_schedule_grid_and_unknown_schedule():
    result = hetpipe("schedule", "--stages", "2", "--nm", "2", "--waves", "1", "--lists")
    assert result.returncode == 0
    assert result.stdout.splitlines()[1:] == [
        "stage 0: F0 F1 B0 U0 B1 U1 PUSH0",
        "stage 1: F0 B0 U0 F1 B1 U1 PUSH0",
    ]
    result = hetpipe("schedule", "--stages", "2", "--nm", "2", "--waves", "1", "--lists", "--name", "gpipe")
    assert result.stdout.splitlines()[1:] == [
        "stage 0: F0 F1 B0 B1 U1 PUSH0",
        "stage 1: F0 F1 B0 B1 U1 PUSH0",
    ]
    result = hetpipe("schedule", "--name", "gpip")
    assert (
        result.returncode == 2
        and "known schedules: 1f1b-flush, gpipe, pipedream, pipedream-2bw, wsp" in result.stderr
    )
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


@pytest.mark.parametrize("command", ["train", "plan", "server", "worker"])
@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ('train.schedule="1f1b"', 'did you mean "1f1b-flush"'),
        ("train.recompute=true", "choose a schedule that flushes"),
        ('ps.buffers="avg"', "choose one of: average, local"),
        ('ps.aggregation="avg"', "choose one of: sum, mean, server"),
    ],
)
def test_training_settings_fail_at_load_before_torch_is_imported(
    tmp_path: Path, command: str, setting: str, says: str
):
    # issue 13: these errors come at load, exit 2, naming the field; torch's import alone takes seconds
    path = tmp_path / "ok.toml"
    path.write_text(GOOD_HEAD)
    where = [str(path)] if command in ("train", "plan") else ["--config", str(path)]
    extra = ["--vw", "0"] if command == "worker" else []
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hetpipe", command, *where, *extra, "--set", setting],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert f"--set {setting}: {setting.split('=')[0]}:" in result.stderr and says in result.stderr
    imported = [
        line.rsplit("|", 1)[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    ]
    assert "click" in imported and "torch" not in imported


def test_train_refuses_a_cluster_whose_memory_cannot_hold_the_model(tmp_path: Path):
    # the case: memory_gib = 0.001 cannot hold the default config's CNN; nothing may start
    result = hetpipe(
        "train",
        "--run-dir",
        str(tmp_path / "run"),
        "--quiet",
        "--set",
        "gpu_types.fast.memory_gib=0.001",
        "--set",
        "gpu_types.slow.memory_gib=0.001",
    )
    assert result.returncode == 2, result.stderr
    err = result.stderr
    # the fullest GPU: stage 1 holds the fc layers' weights, their stashes, update sums and Adam state
    assert "stage 1 of virtual worker" in err and "on GPU n" in err and "(slow)" in err
    assert "but the GPU has 1,073,741 bytes (1.02 MiB)" in err and "needs " in err and "bytes (" in err
    # 1 MiB holds not even the weights: no one change is enough, and the message says so
    assert "no one change of batch_size, nm, recompute, weight_stashing or schedule makes it fit" in err
    assert "hetpipe plan" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_change_a_memory_refusal_names_makes_the_run_fit(tmp_path: Path):
    small = ["--set", "gpu_types.fast.memory_gib=0.012", "--set", "gpu_types.slow.memory_gib=0.012"]
    result = hetpipe("train", "--run-dir", str(tmp_path / "a"), "--quiet", "--set", "train.waves=1", *small)
    assert result.returncode == 2, result.stderr
    match = re.search(r"it fits with any one of: \[train\] batch_size = (\d+)", result.stderr)
    assert match, result.stderr
    fixed = ["--set", f"train.batch_size={match[1]}"]
    result = hetpipe(
        "train", "--run-dir", str(tmp_path / "b"), "--quiet", "--set", "train.waves=1", *small, *fixed
    )
    assert result.returncode == 0, result.stderr
    bigger = ["--set", f"train.batch_size={int(match[1]) + 1}"]  # the largest that fits: one more does not
    result = hetpipe(
        "train", "--run-dir", str(tmp_path / "c"), "--quiet", "--set", "train.waves=1", *small, *bigger
    )
    assert result.returncode == 2 and "needs " in result.stderr


@pytest.mark.parametrize("where", ["proc", "file-parent", "read-only"])
def test_train_refuses_an_unwritable_run_dir_naming_it(tmp_path: Path, where: str):
    if where == "proc":
        run_dir, why = Path("/proc/x"), "No such file or directory"
    elif where == "file-parent":
        (tmp_path / "file").write_text("")
        run_dir, why = tmp_path / "file" / "run", f"{tmp_path / 'file'} is a file, not a directory"
    else:
        import os

        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories; the /proc case covers a refusal as root")
        (tmp_path / "ro").mkdir(mode=0o555)
        run_dir, why = tmp_path / "ro" / "run", "Permission denied"
    result = hetpipe("train", "--run-dir", str(run_dir), "--quiet")
    assert result.returncode == 2, result.stderr
    assert f"--run-dir {run_dir}: cannot write there ({why}); choose a writable directory" in result.stderr
    assert "Traceback" not in result.stderr


def test_train_refuses_an_unwritable_summary_before_training(tmp_path: Path):
    (tmp_path / "file").write_text("")
    result = hetpipe(
        "train", "--run-dir", str(tmp_path / "run"), "--quiet", "--summary", str(tmp_path / "file" / "s.json")
    )
    assert result.returncode == 2 and f"--summary {tmp_path / 'file'}: cannot write there" in result.stderr
    assert not (tmp_path / "run").exists()


def test_keys_writes_a_set_and_keeps_it(tmp_path: Path):
    config = tmp_path / "lab.toml"
    config.write_text(
        GOOD_HEAD.replace('gpus = ["a"]', 'gpus = ["a", "a", "a"]') + '[allocation]\npolicy = "ed"\n'
    )
    result = hetpipe("keys", str(config))
    assert result.returncode == 0, result.stderr
    out = tmp_path / "lab-keys"
    assert sorted(p.name for p in out.glob("*.key")) == [
        "admin.key",
        "server.key",
        "vw0.key",
        "vw1.key",
        "vw2.key",
    ]
    assert f'set [ps] auth = "curve" and keys_dir = "{out}"' in result.stderr
    again = hetpipe("keys", str(config))
    assert again.returncode == 2 and "already holds keys" in again.stderr and "Traceback" not in again.stderr
    assert hetpipe("keys", str(config), "--force", "--out", str(tmp_path / "k2")).returncode == 0


def test_server_and_worker_with_curve_need_a_keys_dir(tmp_path: Path):
    config = tmp_path / "lab.toml"
    config.write_text(GOOD_HEAD + '[ps]\nauth = "curve"\n')
    for command, extra in (("server", []), ("worker", ["--vw", "0"])):
        result = hetpipe(command, "--config", str(config), *extra)
        assert result.returncode == 2, result.stderr
        assert (
            '[ps] auth = "curve" but keys_dir is empty' in result.stderr and "hetpipe keys" in result.stderr
        )
    config.write_text(GOOD_HEAD + f'[ps]\nauth = "curve"\nkeys_dir = "{tmp_path / "none"}"\n')
    result = hetpipe("server", "--config", str(config))
    assert (
        result.returncode == 2
        and f"{tmp_path / 'none' / 'server.key_secret'}: no such key file" in result.stderr
    )


def test_train_takes_the_config_as_config_option_too(tmp_path: Path):
    """`hetpipe train --config PATH` reads PATH as CONFIG_PATH does; two different configs are refused."""
    path, other = tmp_path / "ok.toml", tmp_path / "other.toml"
    path.write_text(GOOD_HEAD)
    other.write_text(GOOD_HEAD)

    def train(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "hetpipe", "train", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    read = train("--config", str(path), "--set", 'train.lr_schedule="cos"')
    assert read.returncode == 2 and f"{path} with --set" in read.stderr, read.stderr
    both = train(str(path), "--config", str(other))
    assert both.returncode == 2 and "two configs given" in both.stderr and "give one of them" in both.stderr
    same = train(str(path), "--config", str(path), "--set", 'train.lr_schedule="cos"')
    assert same.returncode == 2 and 'did you mean "cosine"' in same.stderr, same.stderr

"""The checks `hetpipe train` makes before it starts anything (hetpipe/app/train_guards.py): the run's CURVE
keys (each stage gets its own VW's pair only), the run dir, the memory of every stage's GPU. No processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from hetpipe.app.train import check_memory, check_writable_dir, run_keys
from hetpipe.compute.build import model_of, vw_layouts
from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.errors import ConfigError, UsageError
from hetpipe.core.protocol.keys import key_users, read_public, write_keys
from hetpipe.worker.jobs import stage_jobs

from conftest import write_config

needs_curve = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE support")


def config_of(tmp_path: Path, *settings: str):
    path = write_config(tmp_path, vws=[["n0:0", "n0:1"], ["n0:2"]], nm=2, staleness=0, waves=2)
    return apply_overrides(load_config(path), list(settings))


def test_no_keys_without_curve(tmp_path: Path) -> None:
    assert run_keys(config_of(tmp_path), tmp_path / "run", 2) is None
    assert not (tmp_path / "run").exists()


@needs_curve
def test_a_fresh_key_set_per_run_and_each_stage_gets_its_own_vws(tmp_path: Path) -> None:
    config = config_of(tmp_path, "ps.auth=curve")
    keys = run_keys(config, tmp_path / "run", 2)
    directory = tmp_path / "run" / "keys"
    assert [k.user for k in keys.vws] == ["vw0", "vw1"] and keys.admin.user == "admin"
    assert [k.public for k in keys.vws] == [read_public(directory, "vw0"), read_public(directory, "vw1")]
    assert set(keys.server.clients.values()) == {"vw0", "vw1", "admin"}
    assert all(k.server_public == keys.server.public for k in (*keys.vws, keys.admin))
    vws = vw_layouts(config, model_of(config))
    for v in range(2):
        jobs = stage_jobs(
            config,
            vws,
            v,
            run_dir=tmp_path,
            ps_endpoints=("tcp://127.0.0.1:1",),
            p2p_host="h",
            p2p_port=1,
            ps_keys=keys.vws[v],
        )
        assert {job.ps_keys.user for job in jobs} == {f"vw{v}"}
        assert all(job.ps_keys.secret == keys.vws[v].secret for job in jobs)
    again = run_keys(config, tmp_path / "run2", 2)
    assert again.server.public != keys.server.public  # a new run, a new set


@needs_curve
def test_a_shared_keys_dir_must_cover_every_vw(tmp_path: Path) -> None:
    write_keys(tmp_path / "keys", key_users(1))
    config = config_of(tmp_path, "ps.auth=curve", f"ps.keys_dir={tmp_path / 'keys'}")
    with pytest.raises(UsageError) as err:
        run_keys(config, tmp_path / "run", 2)
    assert f"{tmp_path / 'keys' / 'vw1.key'}: no such key file, but the run has 2 virtual workers" in str(
        err.value
    )
    write_keys(tmp_path / "keys", key_users(2), force=True)
    keys = run_keys(config, tmp_path / "run", 2)
    assert keys.vws[1].public == read_public(tmp_path / "keys", "vw1")
    assert not (tmp_path / "run" / "keys").exists()  # the shared set is used, not a fresh one


def test_check_writable_dir(tmp_path: Path) -> None:
    check_writable_dir(tmp_path / "a" / "b", "--run-dir")
    assert (tmp_path / "a" / "b").is_dir() and not any((tmp_path / "a" / "b").iterdir())  # the probe is gone
    (tmp_path / "f").write_text("")
    with pytest.raises(UsageError, match=f"--run-dir {tmp_path / 'f'}: cannot write there .* is a file"):
        check_writable_dir(tmp_path / "f", "--run-dir")


def test_memory_check_passes_what_fits_and_names_what_does_not(tmp_path: Path) -> None:
    config = config_of(tmp_path)
    spec = model_of(config)
    vws = vw_layouts(config, spec)
    check_memory(config, spec, vws)  # 4 GiB GPUs hold a small MLP
    small = apply_overrides(config, ["gpu_types.g0.memory_gib=0.0001"])
    with pytest.raises(ConfigError) as err:
        check_memory(small, spec, vws)
    message = str(err.value)
    assert message.startswith(f"{config.path}: stage ") and "(g0) needs " in message
    assert "but the GPU has 107,374 bytes" in message and err.value.exit_code == 2


def test_ctrl_c_says_how_to_go_on_or_that_the_run_cannot() -> None:
    from hetpipe.app.train_guards import interrupted
    from hetpipe.core.config.files import default_config_path

    default = load_config(default_config_path())  # checkpoint.every = 0: nothing to resume from
    said = interrupted(default, Path("runs/r1"))
    assert "cannot be resumed" in said and "every = 0" in said and "--resume" not in said
    resumable = apply_overrides(default, ["checkpoint.every=1", 'checkpoint.dir="ps"'])
    assert "`hetpipe train --resume runs/r1`" in interrupted(resumable, Path("runs/r1"))

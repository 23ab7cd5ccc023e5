"""Tests of server/jobs.py: every shard, whether `hetpipe train` or `hetpipe server` starts it, is given a
ShardJob built by shard_jobs (the packed config and its place) and derives its settings from that config in
its own process, as a stage does from its StageJob."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from hetpipe.core.config.parse import parse_config
from hetpipe.core.errors import UsageError
from hetpipe.core.wsp.aggregation import OptimizerSettings
from hetpipe.server.jobs import ShardJob, shard_jobs


def config(**ps: object):
    return parse_config(
        {
            "name": "jobs",
            "gpu_types": {"g": {"speed": 1.0, "memory_gib": 4.0}},
            "nodes": [{"name": "n0", "gpus": ["g", "g"]}],
            "ps": {"host": "10.0.0.1", "port": 7000, "shards": 2, **ps},
            "wsp": {"staleness": 1, "pull": "latest"},
            "train": {"optimizer": "adam", "lr": 0.002, "momentum": 0.5, "weight_decay": 0.1},
            "checkpoint": {"dir": "ckpt", "every": 3, "keep": 4},
        },
        Path("jobs.toml"),
    )


def test_a_shard_derives_its_settings_from_the_config_it_is_given() -> None:
    jobs = shard_jobs(config(aggregation="server"))
    assert [job.shard for job in jobs] == [0, 1] and len({job.packed_config for job in jobs}) == 1
    settings = pickle.loads(pickle.dumps(jobs[1])).settings()  # as a spawned child gets it
    assert (settings.run, settings.shard, settings.endpoint) == ("jobs", 1, "tcp://10.0.0.1:7001")
    assert (settings.staleness, settings.pull_mode, settings.aggregation) == (1, "latest", "server")
    assert settings.optimizer == OptimizerSettings("adam", 0.002, 0.5, 0.1)
    assert (settings.checkpoint_dir, settings.checkpoint_every, settings.checkpoint_keep) == (
        Path("ckpt") / "shard-1",
        3,
        4,
    )
    assert settings.make_aggregation().optimizer.name == "adam"


def test_the_place_a_launcher_gives_reaches_the_settings() -> None:
    """`hetpipe train`: any free port, checkpoints in the run dir, a clock to resume from."""
    (job,) = shard_jobs(config(), shards=[0], port=0, checkpoint_root=Path("run") / "ps", resume_clock=6)
    settings = job.settings()
    assert (
        settings.endpoint == "tcp://10.0.0.1:0" and settings.checkpoint_dir == Path("run") / "ps" / "shard-0"
    )
    assert settings.resume_clock == 6 and settings.keys is None


def test_a_shard_that_the_config_does_not_have_is_refused_with_the_count() -> None:
    job = ShardJob(shard_jobs(config())[0].packed_config, 5)
    with pytest.raises(UsageError, match="--shard 5 is out of range: jobs.toml has ps.shards = 2"):
        job.settings()

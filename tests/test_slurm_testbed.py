"""launch/slurm_testbed.py: the slurm.conf it writes (pure), and a real Slurm on the shaped-network testbed
(slow; needs root, network namespaces and Slurm or apt-get to install it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetpipe.core.config.files import load_config
from hetpipe.core.runs.testbed import node_address, plan_topology

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))
import slurm_testbed as st  # noqa: E402  (launch is not a package)

BENCH = ROOT / "launch" / "clusters" / "bench.toml"
SCRIPT = ROOT / "launch" / "slurm_testbed.py"
NODES = [st.Node(f"n{i}", node_address(i), f"hp-r1-n{i}") for i in range(3)]


def conf_lines(**overrides: object) -> list[str]:
    kwargs: dict = {
        "ctld_host": "box",
        "ctld_addr": "10.77.0.1",
        "folder": Path("/run/hetpipe-slurm/r1"),
        "cpus": 2,
        "cluster": "hpr1",
        **overrides,
    }
    nodes = kwargs.pop("nodes", NODES)
    return st.slurm_conf(nodes, **kwargs).splitlines()


# ---------------------------------------------------------------------------------------------- pure


def test_conf_has_the_lines_that_matter() -> None:
    lines = conf_lines()
    for line in (
        "ClusterName=hpr1",
        "SlurmctldHost=box(10.77.0.1)",
        "SlurmctldPort=6817",
        "SlurmdPort=6818",
        "AuthType=auth/munge",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SchedulerParameters=bf_interval=1",
        "ReturnToService=2",
        "StateSaveLocation=/run/hetpipe-slurm/r1/ctld",
        "SlurmdSpoolDir=/run/hetpipe-slurm/r1/spool/%n",
        "SlurmdPidFile=/run/hetpipe-slurm/r1/pid/slurmd-%n.pid",
        "SlurmctldPidFile=/run/hetpipe-slurm/r1/pid/slurmctld.pid",
        "SlurmdLogFile=/run/hetpipe-slurm/r1/log/slurmd-%n.log",
        "NodeName=n0 NodeAddr=10.77.0.2 CPUs=2 State=UNKNOWN",
        "NodeName=n1 NodeAddr=10.77.0.3 CPUs=2 State=UNKNOWN",
        "NodeName=n2 NodeAddr=10.77.0.4 CPUs=2 State=UNKNOWN",
        "PartitionName=testbed Nodes=n0,n1,n2 Default=YES MaxTime=INFINITE State=UP",
    ):
        assert line in lines, line


def test_conf_sets_each_key_once_and_nothing_else_is_a_node() -> None:
    lines = [line for line in conf_lines() if line and not line.startswith("#")]
    keys = [line.split("=", 1)[0] for line in lines if not line.startswith(("NodeName=", "PartitionName="))]
    assert len(keys) == len(set(keys))
    assert sum(line.startswith("NodeName=") for line in lines) == 3
    assert sum(line.startswith("PartitionName=") for line in lines) == 1


def test_conf_takes_one_node_and_other_cpus() -> None:
    lines = conf_lines(nodes=[st.Node("gpu-a", "10.77.1.7", "hp-r1-gpu-a")], cpus=1)
    assert "NodeName=gpu-a NodeAddr=10.77.1.7 CPUs=1 State=UNKNOWN" in lines
    assert "PartitionName=testbed Nodes=gpu-a Default=YES MaxTime=INFINITE State=UP" in lines


@pytest.mark.parametrize(
    ("nodes", "cpus", "message"),
    [
        ([], 1, "at least one node"),
        ([st.Node("n 0", "10.77.0.2", "x")], 1, "not usable as a Slurm node"),
        ([st.Node("n0,n1", "10.77.0.2", "x")], 1, "not usable as a Slurm node"),
        ([st.Node("n0", "10.77.0.2", "x"), st.Node("n0", "10.77.0.3", "y")], 1, "repeat"),
        (NODES, 0, "at least 1"),
    ],
)
def test_conf_refuses_what_slurm_would_not_take(nodes: list, cpus: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        conf_lines(nodes=nodes, cpus=cpus)


def test_nodes_come_from_the_testbed_state_as_hetpipe_writes_it() -> None:
    topology = plan_topology(load_config(BENCH), "r1", 1.0)
    assert st.nodes_of_testbed_state({"topology": topology.to_dict()}) == NODES
    with pytest.raises(ValueError, match="topology"):
        st.nodes_of_testbed_state({"owner": None})


def test_the_bridge_address_never_clashes_with_a_node() -> None:
    many = [node_address(i) for i in (0, 1, 2, 253, 254, 1000, 2**16 - 4)]
    assert st.addresses_clash(st.BRIDGE_CIDR, many) == []
    assert st.BRIDGE_CIDR == "10.77.0.1/16"
    assert st.addresses_clash(st.BRIDGE_CIDR, ["10.77.0.1", "10.78.0.2"]) == ["10.77.0.1", "10.78.0.2"]


def test_slurmd_runs_in_the_nodes_namespace_under_its_name() -> None:
    argv = st.slurmd_argv(NODES[1], "/usr/sbin/slurmd")
    assert argv[:2] == ["nsenter", "--net=/run/netns/hp-r1-n1"]
    assert argv[argv.index("unshare") + 1] == "--uts"
    assert argv[-2:] == ["n1", "/usr/sbin/slurmd"]
    assert "ip" not in argv  # not `ip netns exec`: it remounts /sys and slurmd loses the cgroup tree


def test_sinfo_parsing_and_idle() -> None:
    states = st.parse_sinfo("n0 idle\nn1 idle*\nn2 idle\nn2 idle\n\n")
    assert states == {"n0": "idle", "n1": "idle*", "n2": "idle"}
    assert not st.all_idle(states, ["n0", "n1", "n2"])
    assert st.all_idle(states, ["n0", "n2"])
    assert not st.all_idle(states, ["n3"])


def test_environment_names_the_conf_and_the_teardown() -> None:
    text = st.environment_text(Path("/run/hetpipe-slurm/r1/slurm.conf"), "r1", NODES)
    assert "export SLURM_CONF=/run/hetpipe-slurm/r1/slurm.conf" in text.splitlines()
    assert "down --run r1" in text


def test_a_bad_run_id_is_refused_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert st.main(["down", "--run", "Bad_Id"]) == 1
    assert "use 1 to 8 lower-case letters or digits" in capsys.readouterr().err
    assert st.main(["up", str(ROOT / "no-such.toml"), "--run", "r1"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_not_root_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert st.main(["up", str(BENCH), "--run", "r1"]) == 1
    assert "needs root" in capsys.readouterr().err
    assert st.main(["down", "--run", "r1"]) == 1
    assert "needs root" in capsys.readouterr().err
    assert skip_reason() == "needs root (network namespaces, Slurm daemons)"


# ---------------------------------------------------------------------------------------------- real Slurm


def skip_reason() -> str | None:
    """Why the real-Slurm test cannot run here, None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, Slurm daemons)"
    from hetpipe.app.testbed import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        return f"no network testbed here: {reason}"
    if st.binary("slurmctld") is None and shutil.which("apt-get") is None:
        return "Slurm is not installed and there is no apt-get to install it"
    for tool in ("nsenter", "unshare", "runuser"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (package util-linux)"
    if st.STATE_ROOT.is_dir() and any(st.STATE_ROOT.iterdir()):
        return f"another Slurm testbed is up ({', '.join(p.name for p in st.STATE_ROOT.iterdir())})"
    return None


def script(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )


def slurm(argv: list[str], conf: str, timeout: float = 60) -> str:
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, "SLURM_CONF": conf}
    )
    assert done.returncode == 0, f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


HETJOB = """#!/bin/sh
#SBATCH --output={out}
#SBATCH -N1 -w n1
#SBATCH hetjob
#SBATCH -N1 -w n2
srun --het-group=0 sh -c 'echo "comp0 $(hostname) $(hostname -I)"'
srun --het-group=1 sh -c 'echo "comp1 $(hostname) $(hostname -I)"'
"""


def check_jobs(conf: str, tmp_path: Path) -> None:
    """srun on every node, srun pinned to n1 sees n1's address, a two-component hetjob on n1 and n2."""
    assert sorted(slurm(["srun", "-N3", "hostname"], conf).split()) == ["n0", "n1", "n2"]
    assert "inet 10.77.0.3/16" in slurm(["srun", "-w", "n1", "ip", "-4", "addr", "show", "hpnet"], conf)
    assert slurm(["srun", "-w", "n1", "hostname"], conf).strip() == "n1"
    job = tmp_path / "het.sh"
    job.write_text(HETJOB.format(out=tmp_path / "het-%j.out"))
    slurm(["sbatch", "--wait", str(job)], conf, timeout=90)
    (out,) = tmp_path.glob("het-*.out")
    lines = sorted(line.split() for line in out.read_text().splitlines())
    assert lines == [["comp0", "n1", "10.77.0.3"], ["comp1", "n2", "10.77.0.4"]], out.read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_slurm_runs_jobs_on_the_testbeds_nodes(tmp_path: Path) -> None:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    run = f"s{os.getpid() % 16**7:x}"
    pids: dict[int, str] = {}
    try:
        start = time.monotonic()
        up = script("up", str(BENCH), "--run", run, timeout=700)
        assert up.returncode == 0, f"up failed:\n{up.stderr}"
        print(f"up {time.monotonic() - start:.1f} s")
        conf = f"/run/hetpipe-slurm/{run}/slurm.conf"
        assert f"export SLURM_CONF={conf}" in up.stdout.splitlines()
        pids = st.daemon_pids(run)
        assert sorted(pids.values()) == ["slurmctld", "slurmd", "slurmd", "slurmd"]
        assert script("status", "--run", run, timeout=30).returncode == 0
        check_jobs(conf, tmp_path)
    finally:
        start = time.monotonic()
        down = script("down", "--run", run, timeout=120)
        print(f"down {time.monotonic() - start:.1f} s")
    assert down.returncode == 0, f"down failed:\n{down.stderr}"
    assert not [name for name in os.listdir("/run/netns") if name.startswith(f"hp-{run}-")]
    assert not (st.STATE_ROOT / run).exists()
    assert [f"{name} {pid}" for pid, name in pids.items() if st.comm(pid) == name] == []

"""Chaos: `hetpipe train --audit` while PS shards (and, with --stages, stages) are killed with SIGKILL at
random moments; the audit ledger then says whether every acknowledged update counted exactly once.

What happens (docs/recovery.md):
  - a killed PS shard is restarted by `hetpipe train` from its newest checkpoint ([checkpoint] every = 1
    here), on the same port; the stages register again and resend every push it lost, and go on;
  - a killed stage (--stages; [ps] on_vw_failure = "evict" here): `hetpipe train` evicts its VW at its wave
    boundary and the others go on; this script then rejoins the VW with `hetpipe worker --vw I --join RUN_DIR`
    (it starts at the next wave boundary the shards accept, from the current global weights).
Kills are spread over the run: kill i waits for a random wave in the i-th of `kills` equal parts of the run,
plus a random 0..--jitter seconds, and for the previous victim to be back (a restarted shard serving, a
rejoined VW live). At the end the ledger of every layer on every shard is compared with what the shard's
clock and its VWs' gaps (waves an evicted VW did not take part in) say it must hold:
  lost        slots of acknowledged updates that are missing        must be 0
  duplicated  slots counted more than once                          must be 0
  stray       slots of waves a VW did not take part in, yet present must be 0
  completed   `hetpipe train` (and every rejoined worker) exited 0

    python launch/bench/chaos.py --kills 50 [--shards 2] [--stages | --stages-only] [--seed 0] [--out FILE]
        [--config CONFIG] [--waves N] [--set KEY=VALUE ...]

More faults, one per run (--fault; --kills does not apply):
  launcher    SIGKILL of the `hetpipe train` process at a random wave; 5 s later no process of the run may
              be left (stages, shards, fork server, resource tracker: `left`), and `hetpipe train --resume`
              started at once must finish the run with the ledger clean
  stop-stage  SIGSTOP of a random stage under on_vw_failure = "evict" (hung_after_s = 5): the PS evicts its
              VW, the launcher kills the stopped stage (`stopped_left` must be false) and the other VWs finish
              the run with the ledger clean (no rejoin)
  corrupt     as launcher, then the newest checkpoint of a random PS shard or stage is cut to half, has a
              byte changed or is deleted before the resume: it must start from an older wave every part
              holds intact, and finish with the ledger clean
  full-disk   (root) a small tmpfs (--disk-mib) holds the run dir, its PS checkpoints or its stage snapshots,
              at random; at a random wave a file takes every byte left on it: `hetpipe train` must stop with
              a message that names ENOSPC and a path on that disk, leave no `*.tmp` there, and, the disk
              freed, `--resume` must finish the run with the ledger clean
  flood       a run with [ps] auth = "curve" whose processes have 1,024 open files (the shard cannot raise
              it): from 127.0.0.2, 1,100 idle TCP connections to PS shard 0 and ~700 CURVE handshakes a second
              with unknown keys, for --flood-s; no checkpoint may fail and the ledger must be clean; the
              wave rate before and during the flood is reported

Smoke check: --kills 3. The run's own files (logs, metrics.jsonl with each child_exit and vw_evicted, the
summary) stay in --run-dir (default: a temporary directory, printed).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chaos_disk  # noqa: E402  (launch/bench is not a package)
import chaos_flood  # noqa: E402

from hetpipe.core.config.files import default_config_path, load_config  # noqa: E402
from hetpipe.core.config.overrides import apply_overrides  # noqa: E402
from hetpipe.core.runs.checkpoint import list_manifests  # noqa: E402

# A small run unless --set says otherwise: a 3-layer MLP on MNIST-5k, one PS shard per --shards.
SMALL = [
    "model.name=mlp",
    "model.options={ hidden = [64, 32] }",
    "train.batch_size=32",
    "wsp.nm=2",
    "wsp.staleness=1",
    "emulation.time_scale=50",
]


FAULTS = ["kill", "launcher", "stop-stage", "corrupt", "full-disk", "flood"]


@dataclass
class Worker:
    """A `hetpipe worker --join` this script started for a rejoining VW."""

    vw: int
    proc: subprocess.Popen
    run_dir: Path
    victim: bool = False  # one of its stages was killed: it exits 1 (and its VW is evicted), as it should
    late: bool = False  # still rejoining when the others finished the run: it cannot, and need not


@dataclass
class Chaos:
    run_dir: Path
    waves: int
    rng: random.Random
    stages: str  # "no" | "also" | "only"
    total: int = 1  # kills planned
    t0: float = field(default_factory=time.monotonic)
    train: subprocess.Popen | None = None
    workers: list[Worker] = field(default_factory=list)
    kills: list[dict] = field(default_factory=list)
    rejoins: int = 0

    # ---- what the run is doing -----------------------------------------------------------------------------
    def pids(self) -> dict[str, int]:
        pids = {}
        for path in [self.run_dir / "pids.json", *(w.run_dir / "pids.json" for w in self.workers)]:
            with contextlib.suppress(OSError, ValueError):  # not written yet, or being rewritten
                pids.update(json.loads(path.read_text()))
        return pids

    def status(self) -> list[dict] | None:
        """Every shard's status, or None while one does not answer (restarting)."""
        from hetpipe.worker.ps_client import PSClient

        try:
            endpoints = json.loads((self.run_dir / "ps.json").read_text())["endpoints"]
            run = json.loads((self.run_dir / "ps.json").read_text())["run"]
            with PSClient(
                endpoints, run, 0, 0, 1, 1, {}, timeout_s=3, retry_s=1, curve=self.admin_keys()
            ) as ps:
                return ps.status()
        except Exception:
            return None

    def admin_keys(self):
        """The launcher's CURVE keys of a run with auth = "curve" (the status is the admin's), else None."""
        from hetpipe.core.protocol.keys import ADMIN, client_keys

        keys = self.run_dir / "keys"
        return client_keys(keys, ADMIN) if (keys / f"{ADMIN}.key_secret").exists() else None

    def wave(self) -> int:
        infos = self.status()
        return min(info["c_global"] for info in infos) if infos else -1

    def running(self) -> bool:
        return self.train is not None and self.train.poll() is None

    def wait_until(self, check, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            if check():
                return True
            time.sleep(0.2)
        return False

    # ---- kills ---------------------------------------------------------------------------------------------
    def kill_one(self, number: int, jitter_s: float) -> bool:
        """Kill a random PS shard or stage once the run reaches this kill's part of it; False when the run
        ended."""
        target = int((number + self.rng.random()) * (self.waves - 4) / self.total)
        if not self.wait_until(lambda: self.wave() >= target, 600):
            return False
        time.sleep(self.rng.uniform(0, jitter_s))
        infos = self.status()
        if infos is None or not self.running():
            return False
        pids = self.pids()
        shards = sorted(n for n in pids if n.startswith("ps-shard-"))
        all_live = all(len(info["live"]) == info["num_vws"] for info in infos)
        near_end = min(info["c_global"] for info in infos) >= self.waves - 12  # no time left to rejoin
        kill_stage = self.stages == "only" or (self.stages == "also" and self.rng.random() < 0.5)
        if kill_stage and (not all_live or near_end):
            kill_stage = self.stages != "only"
            if (
                not kill_stage and self.stages == "only"
            ):  # not now: a VW is still out, or too late to come back
                why = "a VW is still out" if not all_live else "too near the end for a VW to rejoin"
                print(f"  kill {number + 1} skipped: {why}", flush=True)
                return True
        if kill_stage:
            names = sorted(n for n in pids if n.startswith("vw") and "-s" in n and _alive(pids[n]))
            if not names:
                return True
            name = self.rng.choice(names)
            for worker in self.workers:
                worker.victim = worker.victim or (
                    worker.vw == int(name[2:].split("-")[0]) and worker.proc.poll() is None
                )
        else:
            name = self.rng.choice(shards)
        try:
            os.kill(pids[name], signal.SIGKILL)
        except ProcessLookupError:
            return True
        wave = min(info["c_global"] for info in infos)
        self.kills.append(
            {"target": name, "pid": pids[name], "wave": wave, "t": round(time.monotonic() - self.t0, 2)}
        )
        print(f"  kill {len(self.kills)}: SIGKILL {name} (pid {pids[name]}) at wave {wave}", flush=True)
        if kill_stage:
            self.rejoin(int(name[2:].split("-")[0]))
        else:
            self.wait_until(
                lambda: self.pids().get(name) not in (None, pids[name]) and self.status() is not None, 120
            )
        return True

    # ---- launcher faults (--fault) -------------------------------------------------------------------------
    def kill_launcher(self, jitter_s: float) -> dict:
        """SIGKILL `hetpipe train` at a random wave of the run's middle half and list what of its processes is
        left 5 s later (and end those)."""
        target = self.rng.randint(max(2, self.waves // 4), max(2, self.waves // 2))
        if not self.wait_until(lambda: self.wave() >= target, 600):
            return {"left": None}
        time.sleep(self.rng.uniform(0, jitter_s))
        processes = descendants(self.train.pid)
        wave = self.wave()
        os.kill(self.train.pid, signal.SIGKILL)
        self.train.wait()
        self.kills.append({"target": "launcher", "pid": self.train.pid, "wave": wave, "t": self._t()})
        print(f"  SIGKILL hetpipe train (pid {self.train.pid}) at wave {wave}", flush=True)
        time.sleep(5.0)
        left = {pid: _command(pid) for pid in processes if _running(pid)}
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        print(f"  5 s later: {len(left)} of its {len(processes)} processes left {sorted(left.values())}")
        return {"left": sorted(left.values()), "processes": len(processes)}

    def resume(self, command: list[str], log_path: Path) -> None:
        """Start `hetpipe train --resume` as the run to wait for."""
        print("  hetpipe train --resume", flush=True)
        with open(log_path, "a") as log:
            self.train = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def corrupt_newest(self) -> dict:
        """Damage the newest checkpoint of a random PS shard or stage: cut its data file to half, change one
        byte of it, or delete it (a resume must then start from an older wave that every part holds)."""
        parts = sorted(self.run_dir.glob("ps/shard-*")) + sorted(self.run_dir.glob("stages/*"))
        part = self.rng.choice([p for p in parts if list_manifests(p)])
        data = list_manifests(part)[-1].with_suffix(".bin")
        how = self.rng.choice(["truncate", "flip", "delete"])
        if how == "truncate":
            os.truncate(data, data.stat().st_size // 2)
        elif how == "flip":
            with open(data, "r+b") as f:
                f.seek(self.rng.randrange(data.stat().st_size))
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
        else:
            data.unlink()
        name = str(data.relative_to(self.run_dir))
        print(f"  damaged {name} ({how})", flush=True)
        return {"damaged": name, "how": how}

    def fill_disk(self, disk: Path, jitter_s: float, timeout_s: float) -> dict:
        """At a random wave of the run's first half, fill the small disk `disk` until no byte is left; wait
        for `hetpipe train` to stop, and note its exit code, the lines that name the full disk and the
        temporary files left on it; then free the disk."""
        target = self.rng.randint(2, max(2, self.waves // 2))
        if not self.wait_until(lambda: self.wave() >= target, 600):
            return {"filled": None}
        time.sleep(self.rng.uniform(0, jitter_s))
        wave = self.wave()
        filled = chaos_disk.fill(disk)
        self.kills.append({"target": "disk", "wave": wave, "t": self._t(), "bytes": filled})
        print(f"  filled {disk} ({filled / 2**20:.1f} MiB) at wave {wave}", flush=True)
        try:
            self.train.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print("  hetpipe train did not stop on the full disk", flush=True)
            self.train.kill()
            self.train.wait()
        text = (self.run_dir.parent / "train.log").read_text(errors="replace")
        named = [
            line.strip()
            for line in text.splitlines()
            if ("ENOSPC" in line or "No space left on device" in line) and str(disk) in line
        ]
        left = chaos_disk.temporaries(disk)
        chaos_disk.free(disk)
        print(f"  hetpipe train exited {self.train.returncode}: {named[-1] if named else 'no ENOSPC named'}")
        return {
            "full_exit": self.train.returncode,
            "enospc_named": named[-1] if named else None,
            "tmp_left": left,
        }

    def flood(self, seconds: float, jitter_s: float) -> dict:
        """At a random wave of the run's first third, flood PS shard 0 from another loopback address (idle
        connections and handshakes with unknown keys) for `seconds` or until the run ends; the wave rate
        before and during it."""
        from hetpipe.core.protocol.keys import server_keys

        if not self.wait_until(lambda: self.wave() >= 2, 600):  # past the start-up: a steady rate before
            return {"flood_handshakes": None}
        first = self.wave(), time.monotonic()
        target = self.rng.randint(first[0] + 3, max(first[0] + 3, self.waves // 3))
        if not self.wait_until(lambda: self.wave() >= target, 600):
            return {"flood_handshakes": None}
        time.sleep(self.rng.uniform(0, jitter_s))
        endpoint = json.loads((self.run_dir / "ps.json").read_text())["endpoints"][0]
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        flood = chaos_flood.Flood(
            host, int(port), server_keys(self.run_dir / "keys").public, seconds=seconds, source="127.0.0.2"
        )
        start = self.wave(), time.monotonic()
        flood.start()
        self.kills.append({"target": "flood", "wave": start[0], "t": self._t()})
        print(f"  flood of ps-shard-0 ({endpoint}) from 127.0.0.2 at wave {start[0]}", flush=True)
        end = start
        while self.running() and not flood.done():  # the last wave seen during the flood, and when
            wave = self.wave()
            end = (wave, time.monotonic()) if wave >= 0 else end
            time.sleep(0.5)
        flood.stop()
        report = flood.report()
        before = (start[0] - first[0]) / max(1e-9, start[1] - first[1])
        during = (end[0] - start[0]) / (end[1] - start[1]) if end[1] > start[1] else None
        print(
            f"  flood over: {report}; waves/s before {before:.2f}, during "
            f"{'?' if during is None else f'{during:.2f}'}",
            flush=True,
        )
        rates = {"waves_per_s_before": round(before, 2), "waves_per_s_during": during and round(during, 2)}
        return {**report, **rates}

    def stop_stage(self, jitter_s: float) -> dict:
        """SIGSTOP a random stage at a random wave of the run's first half (hetpipe train is to evict its VW
        and kill it)."""
        target = self.rng.randint(2, max(2, self.waves // 2))
        if not self.wait_until(lambda: self.wave() >= target, 600):
            return {"stopped": None}
        time.sleep(self.rng.uniform(0, jitter_s))
        pids = self.pids()
        name = self.rng.choice(sorted(n for n in pids if n.startswith("vw") and _alive(pids[n])))
        wave = self.wave()
        os.kill(pids[name], signal.SIGSTOP)
        self.kills.append(
            {"target": name, "pid": pids[name], "wave": wave, "t": self._t(), "signal": "SIGSTOP"}
        )
        print(f"  SIGSTOP {name} (pid {pids[name]}) at wave {wave}", flush=True)
        return {"stopped": name, "stopped_pid": pids[name]}

    def _t(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def rejoin(self, vw: int) -> None:
        """Once the PS evicted `vw`, bring it back with `hetpipe worker --vw --join`."""
        evicted = self.wait_until(
            lambda: (s := self.status()) is not None and all(vw not in i["live"] for i in s), 120
        )
        if not evicted:
            return
        self.rejoins += 1
        run_dir = self.run_dir / f"worker-vw{vw}-{self.rejoins}"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hetpipe",
                "worker",
                "--vw",
                str(vw),
                "--join",
                str(self.run_dir),
                "--run-dir",
                str(run_dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(f"{run_dir}.log", "w"),  # noqa: SIM115
        )
        self.workers.append(Worker(vw, proc, run_dir))
        back = self.wait_until(
            lambda: (
                (s := self.status()) is not None
                and all(vw in i["live"] for i in s)
                or proc.poll() is not None
            ),
            300,
        )
        if back and proc.poll() is None:
            print(f"  vw {vw} rejoined (hetpipe worker pid {proc.pid})", flush=True)
        else:
            print(f"  vw {vw} did not rejoin (the others finished first?): see {run_dir}.log", flush=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _running(pid: int) -> bool:
    """Alive and not a zombie (dead, not yet reaped: PID 1 of a container may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _command(pid: int) -> str:
    try:
        return f"{pid} " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
    except OSError:
        return str(pid)


def descendants(root: int) -> set[int]:
    """Every process below `root` now (Linux /proc)."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
    found, todo = set(), [root]
    while todo:
        top = todo.pop()
        kids = {pid for pid, parent in parents.items() if parent == top}
        found |= kids
        todo.extend(kids)
    return found


@click.command()
@click.option(
    "--kills", type=click.IntRange(min=0), default=5, show_default=True, help="SIGKILLs to deliver."
)
@click.option(
    "--stages",
    "stages",
    flag_value="also",
    default=None,
    help="Kill stages too (each kill a shard or a stage, at random); evicted VWs rejoin.",
)
@click.option("--stages-only", "stages", flag_value="only", help="Kill stages only.")
@click.option("--shards", type=click.IntRange(min=1), default=2, show_default=True, help="PS shards.")
@click.option(
    "--waves",
    type=click.IntRange(min=4),
    default=None,
    help="Waves of the run (default: 20 + 6 per kill, 40 with stage kills: a rejoin takes time; 30 for a "
    "--fault, 60 for flood).",
)
@click.option(
    "--fault",
    type=click.Choice(FAULTS),
    default="kill",
    show_default=True,
    help="kill: --kills SIGKILLs of shards (and stages); launcher: one SIGKILL of `hetpipe train`, then "
    "--resume; stop-stage: one SIGSTOP of a stage under evict; corrupt: launcher, then the newest "
    "checkpoint of a shard or stage damaged before --resume; full-disk: the disk of the run dir, its PS "
    "checkpoints or its stage snapshots fills (root: a tmpfs), then freed and --resume; flood: idle "
    'connections and bad handshakes against a shard of an auth = "curve" run.',
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds which child dies when.")
@click.option(
    "--jitter",
    "jitter_s",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Up to this many seconds more before each kill, at random.",
)
@click.option(
    "--flood-s",
    type=click.FloatRange(min=1, max=600),
    default=20.0,
    show_default=True,
    help="--fault flood: how long the flood lasts at most.",
)
@click.option(
    "--disk-mib",
    type=click.IntRange(min=16),
    default=64,
    show_default=True,
    help="--fault full-disk: the size of the small disk.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Cluster config (default: the packaged local.toml with a small MLP).",
)
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE", help="More config overrides.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=10), default=1800, show_default=True)
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the result as JSON."
)
def main(
    kills: int,
    stages: str | None,
    shards: int,
    waves: int | None,
    fault: str,
    seed: int,
    jitter_s: float,
    flood_s: float,
    disk_mib: int,
    config_path: Path | None,
    settings: tuple[str, ...],
    run_dir: Path | None,
    timeout_s: float,
    out: Path | None,
) -> None:
    if fault == "full-disk" and (why := chaos_disk.can_mount()):
        raise click.UsageError(why)
    stages = stages or "no"
    waves = waves or {"kill": 20 + (6 if stages == "no" else 40) * kills, "flood": 60}.get(fault, 30)
    out_dir = run_dir or Path(tempfile.mkdtemp(prefix="hetpipe-chaos-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    # the run's own dir; with full-disk one below (chaos's train.log must not be on the disk that fills)
    run_dir = out_dir / "run" if fault == "full-disk" else out_dir
    overrides = [
        *(SMALL if config_path is None else []),
        f"train.waves={waves}",
        f"ps.shards={shards}",
        "checkpoint.every=1",
        'checkpoint.dir="ps"',
        f"ps.max_restarts={kills + 5}",
        "ps.heartbeat_s=1",
        "ps.hung_after_s=60",
        *(["ps.on_vw_failure=evict"] if stages != "no" or fault == "stop-stage" else []),
        *(["ps.hung_after_s=5"] if fault == "stop-stage" else []),
        *(['ps.auth="curve"'] if fault == "flood" else []),
        *settings,
    ]
    config = apply_overrides(
        load_config(config_path or default_config_path()), overrides
    )  # fail here, not later
    what = "PS shards" if stages == "no" else "PS shards and stages" if stages == "also" else "stages"
    print(
        f"chaos: {f'{kills} kills ({what})' if fault == 'kill' else f'fault {fault}'}, "
        f"{config.ps.shards} shards, {waves} waves, seed {seed}; run dir {run_dir}",
        flush=True,
    )
    disks = contextlib.ExitStack()
    disk = None
    if fault == "full-disk":  # the whole run dir, its PS checkpoints or its stage snapshots
        disk = run_dir / rng.choice(["", "ps", "stages"])
        run_dir.mkdir(exist_ok=True)
        disks.enter_context(chaos_disk.small_disk(disk, disk_mib))
        print(f"  a {disk_mib} MiB disk on {disk}", flush=True)
    chaos = Chaos(run_dir, waves, rng, stages, total=max(kills, 1))
    command = [
        sys.executable,
        "-m",
        "hetpipe",
        "train",
        str(config_path or default_config_path()),
        "--audit",
        "--quiet",
        "--run-dir",
        str(run_dir),
        "--summary",
        str(out_dir / "chaos-summary.json"),
        *[a for s in overrides for a in ("--set", s)],
    ]
    resume = [*command[:4], "--resume", str(run_dir), "--audit", "--quiet", *command[9:11]]  # with --summary
    log_path = out_dir / "train.log"
    with open(log_path, "w") as log:
        chaos.train = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            # the shard's open files as in the report of a flood (it cannot raise its soft limit past it)
            preexec_fn=(lambda: chaos_flood.limit_open_files(1024)) if fault == "flood" else None,
        )
    faulted: dict = {}
    try:
        chaos.wait_until(lambda: chaos.wave() >= 0 and (run_dir / "pids.json").exists(), 600)
        if fault in ("launcher", "corrupt"):
            faulted = chaos.kill_launcher(jitter_s)
            if chaos.kills:
                faulted.update(chaos.corrupt_newest() if fault == "corrupt" else {})
                chaos.resume(resume, log_path)
        elif fault == "full-disk":
            faulted = chaos.fill_disk(disk, jitter_s, timeout_s=300)
            if chaos.kills:
                chaos.resume(resume, log_path)
        elif fault == "stop-stage":
            faulted = chaos.stop_stage(jitter_s)
        elif fault == "flood":
            faulted = chaos.flood(flood_s, jitter_s)
        for number in range(kills if fault == "kill" else 0):
            if not chaos.kill_one(number, jitter_s):
                print(f"  the run ended before kill {number + 1}", flush=True)
                break
        try:
            chaos.train.wait(timeout=max(10.0, timeout_s - (time.monotonic() - chaos.t0)))
        except subprocess.TimeoutExpired:
            print("  the run did not finish in time", flush=True)
        for worker in chaos.workers:
            worker.late = (
                worker.proc.poll() is not None
                and worker.proc.returncode != 0
                and "cannot rejoin" in Path(f"{worker.run_dir}.log").read_text(errors="replace")
            )
            if worker.proc.poll() is None and not (worker.run_dir / "pids.json").exists():
                worker.late = True  # never got to start its stages before the run ended
            try:
                worker.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
    finally:
        for proc in [chaos.train, *(w.proc for w in chaos.workers)]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        seconds = round(time.monotonic() - chaos.t0, 1)
        summary = (
            json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
        )
        disks.close()
    result = report(chaos, summary, config, seed, seconds, fault, faulted)
    if out is not None:
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    raise SystemExit(0 if passed(result, summary) else 1)


def report(chaos: Chaos, summary: dict, config, seed: int, seconds: float, fault: str, faulted: dict) -> dict:
    """The run's result (kills, the ledger's counts, what the fault left), printed in a line."""
    ledger = summary.get("audit_ledger", {})
    workers_ok = all(w.proc.returncode == 0 for w in chaos.workers if not (w.victim or w.late))
    completed = chaos.train.returncode == 0 and bool(summary) and workers_ok
    result = {
        "kills": len(chaos.kills),
        "kills_ps": sum(k["target"].startswith("ps-") for k in chaos.kills),
        "kills_stages": sum(k["target"].startswith("vw") for k in chaos.kills),
        "lost": ledger.get("lost"),
        "duplicated": ledger.get("duplicated"),
        "stray": ledger.get("stray"),
        "ledger_slots": ledger.get("slots"),
        "completed": completed,
        "seconds": seconds,
        "waves": chaos.waves,
        "shards": config.ps.shards,
        "seed": seed,
        "ps_restarts": summary.get("ps_restarts"),
        "evicted": summary.get("evicted"),
        "rejoins": chaos.rejoins,
        "train_exit": chaos.train.returncode,
        "audit_checks": summary.get("audit_checks"),
        "checkpoint_failures": summary.get("checkpoint_failures", 0),
        "run_dir": str(chaos.run_dir),
        "victims": chaos.kills,
        "fault": fault,
        **faulted,
    }
    if fault == "stop-stage":
        result["stopped_left"] = faulted.get("stopped_pid") is not None and _running(faulted["stopped_pid"])
    print(
        f"kills {result['kills']} (PS shards {result['kills_ps']}, stages {result['kills_stages']}, rejoins "
        f"{chaos.rejoins}); PS restarts {result['ps_restarts']}; ledger slots {result['ledger_slots']}: lost "
        f"{result['lost']}, duplicated {result['duplicated']}, stray {result['stray']}; forwards audited by "
        f"hetpipe train's own stages {result['audit_checks']}; completed {completed} in {seconds} s"
    )
    if not completed:
        print(f"see {chaos.run_dir / 'logs'} and the train.log beside it")
    if fault != "kill":
        shown = {k: v for k, v in faulted.items() if k != "stopped_pid"}
        print(f"fault {fault}: {json.dumps(shown)}")
    return result


def passed(result: dict, summary: dict) -> bool:
    """The run finished with the ledger clean, and the fault was dealt and dealt with as it must be."""
    ok = result["completed"] and result["lost"] == 0 and result["duplicated"] == 0 and result["stray"] == 0
    fault = result["fault"]
    if fault == "kill":
        return ok
    ok = ok and bool(result["victims"])  # the fault happened before the run ended
    if fault in ("launcher", "corrupt"):  # nothing of the killed run left
        ok = ok and result.get("left") == []
    if fault == "stop-stage":  # the stopped VW evicted and its stage ended
        ok = ok and not result["stopped_left"]
        ok = ok and int(result["stopped"][2:].split("-")[0]) in (summary.get("evicted") or [])
    if fault == "full-disk":  # a clean stop that says why and where, nothing half-written left
        ok = ok and result["full_exit"] not in (0, None) and bool(result["enospc_named"])
        ok = ok and result["tmp_left"] == []
    if fault == "flood":  # every checkpoint still written
        ok = ok and result["checkpoint_failures"] == 0 and bool(result.get("flood_handshakes"))
    return ok


if __name__ == "__main__":
    main()

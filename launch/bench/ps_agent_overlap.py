"""What a stage's PS agent costs the thread that issues its compute: none vs an agent thread vs an agent
process.

A CUDA stage's speed is how fast its one thread issues work, and each torch call lets go of the GIL; an agent
thread of the same process that wants the GIL meanwhile takes it there, and the issuing thread waits to get
it back ([ps] agent, docs/architecture.md#the-ps-path). This measures that on any machine, CPU only: the
issuing thread runs a host-bound stand-in for a CUDA stage (StageCompute of a tiny ResNet-50 on the CPU: many
small torch calls, F, B and U of one stage at Nm 4), and in the same run, block by block, alternating:

  none     - no pushes;
  thread   - a push every --every minibatches through an agent thread of this process (ThreadLink);
  process  - the same pushes through an agent process (ProcessLink, its buffers shared with this process).

Pushes carry char-GPT 8x512's keys (101.5 MB, what that model's stage pushes each wave) to a real PS shard on
loopback, staged once beforehand (on CUDA the copy into them is the device's DMA, not this thread's work); at
most two in flight, and the time waiting for one is left out. With two or more cores the issuing thread gets
the first core it may run on (under taskset too) to itself and everything else the other cores, so only the
agent's effect on it is measured, not a share of its core. Prints the median ms a minibatch of each (min-max
over blocks) and the issuing thread's CPU ms; --out writes them as JSON.

    python launch/bench/ps_agent_overlap.py [--blocks 6] [--minibatches 48] [--every 4] [--out FILE]
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402  (launch/bench is not a package)

from hetpipe.compute.build import model_of  # noqa: E402
from hetpipe.compute.stage_compute import StageCompute, StageRules  # noqa: E402
from hetpipe.core.runs.metrics import TraceRecorder  # noqa: E402
from hetpipe.core.runs.procs import ChildGroup  # noqa: E402
from hetpipe.models import build_stage  # noqa: E402
from hetpipe.server.launch import serve_settings  # noqa: E402
from hetpipe.server.shard import ShardSettings  # noqa: E402
from hetpipe.worker.flat_layout import FlatLayout  # noqa: E402
from hetpipe.worker.ps_client import ClientSpec  # noqa: E402
from hetpipe.worker.ps_link import ProcessLink, ThreadLink  # noqa: E402

PEERS = ("none", "thread", "process")
RUN = "agent-overlap"


def push_values() -> dict[str, torch.Tensor]:
    """char-GPT 8x512's synced tensors (zeros: the PS adds them as any update)."""
    opts, data = gpu.MODELS["char-gpt"]
    with tempfile.TemporaryDirectory() as tmp:
        config = gpu.bench_config(
            "char-gpt", opts, data, "fp32", "cpu", 1, 1, 4, 0, "wsp", 8, 64, 70.0, Path(tmp)
        )
    whole = build_stage(model_of(config), 0, model_of(config).num_layers, "meta")
    return {k: torch.zeros(t.shape) for k, t in [*whole.named_parameters(), *whole.named_buffers()]}


def issuing_stage() -> tuple[StageCompute, Any, torch.Tensor, torch.Tensor]:
    """A host-bound stand-in for a CUDA stage: tiny ResNet-50 (width 1, 8x8 inputs, batch 2) on the CPU."""
    tiny = {"in_channels": 1, "num_classes": 10, "image_size": 32, "width": 1}
    with tempfile.TemporaryDirectory() as tmp:
        config = gpu.bench_config(
            "resnet50", tiny, ("mnist", {"pad": 2}), "fp32", "cpu", 1, 1, 4, 0, "wsp", 8, 2, 70.0, Path(tmp)
        )
    spec = model_of(config)
    compute = StageCompute(
        build_stage(spec, 0, spec.num_layers, "cpu"), "adam", 1e-4, 0.9, 0.0, StageRules(nm=4)
    )
    return compute, spec.loss, torch.randn(2, 1, 8, 8), torch.randint(0, 10, (2,))


def start_shard(group: ChildGroup) -> str:
    queue = group.ctx.Queue()
    group.start("ps", serve_settings, ShardSettings(RUN, 0, "tcp://127.0.0.1:0", 1 << 30, "latest"), queue)
    return f"tcp://127.0.0.1:{queue.get(timeout=60)}"


def pin_threads(issuing: int, core: int, others: set[int], pids: list[int]) -> bool:
    """The issuing thread alone on `core`, every other thread of this process and `pids` on `others`."""
    if not others:
        return False
    for pid in [os.getpid(), *pids]:
        for task in Path(f"/proc/{pid}/task").iterdir():
            tid = int(task.name)
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, {core} if tid == issuing else others)
    return True


@click.command()
@click.option(
    "--blocks", type=click.IntRange(1), default=6, show_default=True, help="Blocks of each peer, alternating."
)
@click.option(
    "--minibatches", type=click.IntRange(4), default=48, show_default=True, help="Minibatches a block."
)
@click.option(
    "--every", type=click.IntRange(1), default=4, show_default=True, help="Minibatches between pushes (Nm)."
)
@click.option("--no-pin", is_flag=True, help="Leave every thread free to run on any core.")
@click.option(
    "--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the rows as JSON."
)
def main(blocks: int, minibatches: int, every: int, no_pin: bool, out_path: Path | None) -> None:
    """Median ms a minibatch of a host-bound issuing thread with no pushes, an agent thread, an agent
    process."""
    torch.set_num_threads(1)
    values = push_values()
    layout = FlatLayout.of(values)
    kinds = dict.fromkeys(values, "param")
    compute, loss_fn, x, y = issuing_stage()
    group = ChildGroup(log_dir=Path(tempfile.mkdtemp()))
    try:
        endpoint = start_shard(group)

        def spec(vw: int) -> ClientSpec:
            return ClientSpec(
                [endpoint], RUN, vw, 0, 2, 1, dict.fromkeys(values, 0), timeout_s=120, retry_s=10
            )

        trace = TraceRecorder("bench", 0)
        links = {
            "thread": ThreadLink(spec(0), trace, 1, 0.0, lambda exc: None),
            "process": ProcessLink(
                spec(1), layout, torch.device("cpu"), trace, 1, 0.0, lambda exc: None, RUN
            ),
        }
        registered = [
            threading.Thread(target=link.register, args=(values, kinds, 1 << 20, 0, False))
            for link in links.values()
        ]  # the shard answers once both VWs have registered
        for thread in registered:
            thread.start()
        for thread in registered:
            thread.join()
        for link in links.values():
            link.start(None, None)
        arrays = {k: t.numpy() for k, t in values.items()}
        cores = sorted(os.sched_getaffinity(0))
        pinned = not no_pin and pin_threads(
            threading.get_native_id(),
            cores[0],
            set(cores[1:]),
            [c.process.pid for c in group.children] + [links["process"].proc.pid],
        )
        waves = dict.fromkeys(links, 0)
        p = 0

        def minibatch() -> None:
            nonlocal p
            compute.forward(p, x, y, loss_fn, input_grad=False)
            compute.backward(p, None, y, loss_fn)
            compute.update(p)
            p += 1

        for _ in range(2 * every):
            minibatch()
        rows: dict[str, dict[str, list[float]]] = {peer: {"ms": [], "cpu_ms": []} for peer in PEERS}
        for block in range(blocks):
            for peer in PEERS[block % len(PEERS) :] + PEERS[: block % len(PEERS)]:
                futures, waited = [], 0.0
                started, cpu = time.perf_counter(), time.thread_time()
                for i in range(minibatches):
                    if peer != "none" and i % every == 0:
                        wait_from = time.perf_counter()
                        if len(futures) >= 2:
                            futures[-2].result()
                        waited += time.perf_counter() - wait_from
                        wave = waves[peer]
                        futures.append(links[peer].push(wave, wave % 2, arrays, lambda: None, reused=True))
                        waves[peer] += 1
                    minibatch()
                elapsed, cpu = time.perf_counter() - started - waited, time.thread_time() - cpu
                for future in futures:
                    future.result()
                rows[peer]["ms"].append(1000 * elapsed / minibatches)
                rows[peer]["cpu_ms"].append(1000 * cpu / minibatches)
            click.echo(
                f"block {block + 1}/{blocks}: "
                + "  ".join(f"{k} {v['ms'][-1]:.2f}" for k, v in rows.items()),
                err=True,
            )
        for link in links.values():
            link.close(timeout_s=30)
            link.shutdown()
    finally:
        group.stop(grace_s=5)
    base = statistics.median(rows["none"]["ms"])
    out = {
        "cores": len(cores),
        "pinned": pinned,
        "blocks": blocks,
        "minibatches": minibatches,
        "every": every,
        "push_mb": round(4 * layout.numel / 1e6, 1),
        "rows": [],
    }
    click.echo(
        f"{len(cores)} cores, issuing thread {f'alone on core {cores[0]}' if pinned else 'unpinned'}; a "
        f"{out['push_mb']} MB push every {every} minibatches; median of {blocks} blocks (min-max):"
    )
    for peer, got in rows.items():
        ms = statistics.median(got["ms"])
        row = {
            "peer": peer,
            "ms_per_minibatch": round(ms, 3),
            "min": round(min(got["ms"]), 3),
            "max": round(max(got["ms"]), 3),
            "cpu_ms": round(statistics.median(got["cpu_ms"]), 3),
            "x_none": round(base / ms, 3),
        }
        out["rows"].append(row)
        click.echo(
            f"  {peer:8s} {ms:7.2f} ms a minibatch ({row['min']:.2f}-{row['max']:.2f}), issuing thread's CPU "
            f"{row['cpu_ms']:.2f} ms, {row['x_none']:.2f}x none's speed"
        )
    if out_path is not None:
        out_path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Host time of one minibatch: a plain torch step against a stage's StageCompute, in one process (issue 11).

On CUDA a step the device finishes faster than the CPU issues it is bound by the host, so every host
millisecond a stage adds is lost; gpu.py shows that a row is host-bound, this shows where the stage's host
time goes without hetpipe's processes, PS or transport: the same model, batches already on the device, the
stage driven through one stage's action list of `--schedule` at Nm 4 (one VW: no pulls; PUSH builds the wave's
push tensors).

Per minibatch, median over the timed ones: wall ms of F (forward and loss), B (backward) and U (update), and
the wall ms a minibatch over the whole timed run (the device waited for at the end); `cpu_ms`: the issuing
thread's CPU time (on CUDA the backward's kernels are issued by autograd's device thread, not counted there).
With --profile, torch.profiler over 8 more minibatches of each: ms a minibatch of each op, by host time and
(on CUDA) device time, as `hetpipe train --profile` writes them for a stage process
(hetpipe/compute/op_profile.py).

    python launch/bench/host_time.py --model char-gpt --precision bf16          # on cuda:0
    python launch/bench/host_time.py --model resnet50 --schedule 1f1b-flush --profile
    python launch/bench/host_time.py --device cpu --quick --steps 24            # a smoke run on the CPU
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402  (launch/bench is not a package)

from hetpipe.compute import data as datalib  # noqa: E402
from hetpipe.compute.build import dataset_of, model_of  # noqa: E402
from hetpipe.compute.op_profile import format_profile, op_profile, start_profiler, stop_profiler  # noqa: E402
from hetpipe.compute.stage_compute import StageCompute, StageRules  # noqa: E402
from hetpipe.core.pipeline.schedule import PUSH, SCHEDULES, WAIT, get_schedule, unstashed_forwards  # noqa: E402
from hetpipe.models import build_stage  # noqa: E402

NM = 4
PROFILED = 8  # minibatches under torch.profiler (--profile), after the timed ones


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(parts: dict[str, list[float]], cpu: list[float], kind: str, block: Callable[[], None]) -> None:
    wall, thread = time.perf_counter(), time.thread_time()
    block()
    parts.setdefault(kind, []).append(1000 * (time.perf_counter() - wall))
    cpu.append(1000 * (time.thread_time() - thread))


def _row(parts: dict[str, list[float]], cpu: list[float], minibatches: int, wall_s: float) -> dict[str, Any]:
    """Wall and CPU ms a minibatch over the timed run; the median of F, B and U; PUSH's ms a minibatch."""
    row = {
        "wall_ms": round(1000 * wall_s / minibatches, 2),
        "cpu_ms": round(sum(cpu) / minibatches, 2),
        **{f"{k}_ms": round(statistics.median(v), 2) for k, v in parts.items() if k in "FBU"},
    }
    if PUSH in parts:
        row["PUSH_ms"] = round(sum(parts[PUSH]) / minibatches, 2)
    return row


def _profiled(device: torch.device, run: Callable[[], None], minibatches: int) -> dict[str, Any]:
    """op_profile's summary of `run` (as `hetpipe train --profile` writes a stage process's)."""
    prof = start_profiler(device)
    started = time.perf_counter()
    run()
    stop_profiler(prof, device)
    return op_profile(prof, minibatches, time.perf_counter() - started, device)


def plain(config: Any, device: torch.device, batches: list, steps: int, profile: bool) -> dict[str, Any]:
    """The whole model stepped as gpu.py's plain loop steps it."""
    spec, model, optimizer, autocast = gpu.plain_model(config, device)
    parts: dict[str, list[float]] = {}
    cpu: list[float] = []
    losses: dict[int, torch.Tensor] = {}

    def forward(p: int) -> None:
        with autocast:
            losses[p] = spec.loss(model(batches[p][0]), batches[p][1])

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step(p: int, record: bool) -> None:
        blocks = (("F", lambda: forward(p)), ("B", lambda: losses.pop(p).backward()), ("U", update))
        for kind, block in blocks:
            _timed(parts, cpu, kind, block) if record else block()

    for p in range(NM):
        step(p, record=False)
    _sync(device)
    started = time.perf_counter()
    for p in range(NM, steps):
        step(p, record=True)
    _sync(device)
    row = _row(parts, cpu, steps - NM, time.perf_counter() - started)
    if profile:
        row["profile"] = _profiled(
            device, lambda: [step(p, False) for p in range(steps, steps + PROFILED)], PROFILED
        )
    return row


def stage(config: Any, device: torch.device, batches: list, profile: bool) -> dict[str, Any]:
    """One VW of one stage: StageCompute through its schedule's actions (as worker/stage.py dispatches
    them)."""
    spec, t = model_of(config), config.train
    kind = get_schedule(t.schedule)
    waves = len(batches) // NM
    actions = [a for a in kind(1, NM, waves, 0).stages[0] if a.kind != WAIT]  # one VW: no pulls
    rules = StageRules(
        nm=NM, stashing=kind.stashing != "none", precision=t.precision, unstashed=unstashed_forwards(actions)
    )
    compute = StageCompute(
        build_stage(spec, 0, spec.num_layers, device), t.optimizer, t.lr, t.momentum, t.weight_decay, rules
    )
    blocks: dict[str, Callable[[int], object]] = {
        "F": lambda p: compute.forward(p, batches[p][0], batches[p][1], spec.loss, input_grad=False),
        "B": lambda p: compute.backward(p, None, batches[p][1], spec.loss),
        "U": compute.update,
        PUSH: lambda c: (compute.wave_push(c), compute.forget(c, c)),
    }
    pushes = [i for i, a in enumerate(actions) if a.kind == PUSH]
    warm, timed_to = pushes[0] + 1, pushes[-1 - PROFILED // NM] + 1  # a wave untimed; the last ones profiled
    parts: dict[str, list[float]] = {}
    cpu: list[float] = []
    for a in actions[:warm]:
        blocks[a.kind](a.index)
    _sync(device)
    started = time.perf_counter()
    for a in actions[warm:timed_to]:
        _timed(parts, cpu, a.kind, lambda a=a: blocks[a.kind](a.index))
    _sync(device)
    minibatches = sum(1 for a in actions[warm:timed_to] if a.kind == "B")
    row = _row(parts, cpu, minibatches, time.perf_counter() - started)
    if profile:
        rest = actions[timed_to:]
        row["profile"] = _profiled(
            device, lambda: [blocks[a.kind](a.index) for a in rest], sum(1 for a in rest if a.kind == "B")
        )
    return row


@click.command()
@click.option("--model", type=click.Choice(sorted(gpu.MODELS)), default="char-gpt", show_default=True)
@click.option("--precision", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True)
@click.option("--schedule", type=click.Choice(sorted(SCHEDULES)), default="wsp", show_default=True)
@click.option("--device", "device_name", default="cuda:0", show_default=True)
@click.option(
    "--steps",
    type=click.IntRange(3 * NM),
    default=48,
    show_default=True,
    help="Minibatches of each (a wave of them untimed first).",
)
@click.option("--quick", is_flag=True, help="gpu.py's small models at batch 8, for a smoke run on the CPU.")
@click.option("--profile", is_flag=True, help="torch.profiler's table of the last 8 minibatches of each.")
@click.option(
    "--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the rows as JSON."
)
def main(
    model: str,
    precision: str,
    schedule: str,
    device_name: str,
    steps: int,
    quick: bool,
    profile: bool,
    out_path: Path | None,
) -> None:
    """Host time of a plain step and of a StageCompute minibatch, side by side in one process."""
    device_name = "cuda:0" if device_name == "cuda" else device_name  # the config names an index
    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise click.UsageError(f"--device {device_name}: no CUDA device here; use --device cpu")
    torch.set_num_threads(1)  # as a stage computes
    options, data = (gpu.QUICK if quick else gpu.MODELS)[model]
    total = (
        -(-(steps + PROFILED) // NM) * NM + NM
    )  # whole waves: the timed ones, the profiled ones, the untimed first
    with tempfile.TemporaryDirectory() as tmp:
        config = gpu.bench_config(
            model,
            options,
            data,
            precision,
            device_name,
            1,
            1,
            NM,
            0,
            schedule,
            total,
            8 if quick else 64,
            70.0,
            Path(tmp),
        )
    dataset, t = dataset_of(config), config.train
    indices = datalib.shard_indices(len(dataset.train.y), 1, 0, config.seed)
    batches = [
        tuple(
            v.to(device)
            for v in datalib.minibatch(
                dataset.train.x, dataset.train.y, indices, t.batch_size, config.seed, p
            )
        )
        for p in range(total)
    ]
    rows = {
        "plain": plain(config, device, batches, total - PROFILED, profile),
        "stage": stage(config, device, batches, profile),
    }
    for name, row in rows.items():
        click.echo(f"{name:6s} " + "  ".join(f"{k} {v}" for k, v in row.items() if k != "profile"))
        if "profile" in row:
            click.echo(format_profile(row["profile"], f"{name}, in one process"))
    if out_path is not None:
        out_path.write_text(
            json.dumps(
                {"model": model, "precision": precision, "schedule": schedule, "device": device_name, **rows},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()

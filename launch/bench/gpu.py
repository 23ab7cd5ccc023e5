"""hetpipe on one real device against a plain torch loop on it, in one run (issue 11).

Systems, per model and precision, each measured --repeats times, round by round (the plain loop, then each
system once a round, so the machine's drift reaches all alike), median and spread reported:
  plain          the whole model, one process: forward, loss, backward, Adam step; each minibatch copied to
                 the device from pinned memory, as a stage copies its own (since 2026-11-26, after the H200
                 run)
  hetpipe 1x1    1 VW x 1 stage at Nm 1 and at Nm 4 (PS + WSP on the same machine, `exact` pulls, D 0)
  hetpipe 2x1    2 VWs x 1 stage, both on the one device: at Nm 1, D 0 (every minibatch waits for its push
                 and pull) and at Nm 4, D 1 (the pull overlaps the next wave)
  hetpipe 1x2    1 VW x 2 stages, both on the one device (co-located stages: gloo with pinned staging)
  ...@1f1b-flush 1x1 and 1x2 at Nm 4 on the synchronous 1F1B schedule too, where 2 stages train as 1 does
Models: char-gpt 8 blocks x 512 wide, 8 heads, 128 characters of context (Shakespeare), and resnet50 on
32x32 images (MNIST padded, one channel, ten classes; the CIFAR-style stem), both at batch 64 with Adam.

Rates are samples/s in the steady state: the plain loop's over its timed steps after --warmup, hetpipe's from
its stage traces after two waves (throughput.py's window); ratio_to_plain divides each median by the plain
loop's median of the same model and precision, ratio_by_round each round's rate by the plain loop's in that
round. Each hetpipe row also gives the wave breakdown (where a wave's time goes: compute, d2h, push_wait,
gate_wait, h2d, push, pull, parked), how long `hetpipe train` took from its last minibatch to returning
(tail_s), the host time of a minibatch (host_ms: the plain loop's step issued onto an idle device, hetpipe's
F, B and U at VW 0's first stage; a system whose host time exceeds the plain loop's step is bound by the CPU,
not the device), and the mean loss of the last 20 minibatches (the 1x2 row is compared with the 1x1 row at the
same Nm and schedule).

    python launch/bench/gpu.py --out gpu.json                       # on the machine's first CUDA device
    python launch/bench/gpu.py --device cpu --quick                 # a smoke run on the CPU (tiny models)
    python launch/bench/gpu.py --model char-gpt --precision bf16 --repeats 3 --minibatches 300
    python launch/bench/gpu.py --model resnet50 --system 1x1:4 --keep runs/gpu
                                                                    # one system; keep its run folders
    python launch/bench/gpu.py --model resnet50 --system 1x1:4 --system 1x1:4+ps.wire_dtype=bfloat16
                                                                    # a variant
    python launch/bench/gpu.py --rows a.json --rows b.json --out gpu.json --table gpu.md   # merge split runs
    python launch/bench/gpu.py --model char-gpt --precision bf16 --system 1x1:4 --profile 40:40
                                                                    # + op profiles

--profile FIRST:COUNT: after the timed runs, the plain loop runs COUNT more steps under torch.profiler and
each hetpipe system one more run with `hetpipe train --profile FIRST:COUNT` (not timed); each row gets
`profile`, op_profile's summary (VW 0's first stage for hetpipe): where a minibatch's host and device time
goes, op by op, side by side.

--table writes the README's Markdown table (naming the device) of the rows. A system whose run fails gets a
row with its error (the other systems still run) and the script exits 1; --out is rewritten after each model
and precision, so what was measured survives a later failure or a timeout.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402  (launch/bench is not a package)

from hetpipe.cli import parse_profile_option  # noqa: E402
from hetpipe.compute import data as datalib  # noqa: E402
from hetpipe.compute.build import dataset_of, model_of  # noqa: E402
from hetpipe.compute.op_profile import op_profile, start_profiler, stop_profiler  # noqa: E402
from hetpipe.compute.optim import make_optimizer  # noqa: E402
from hetpipe.core.config.files import load_config  # noqa: E402
from hetpipe.core.config.overrides import apply_overrides  # noqa: E402
from hetpipe.core.config.schema import ClusterConfig  # noqa: E402
from hetpipe.core.pipeline.profile_window import ProfileWindow  # noqa: E402
from hetpipe.core.pipeline.schedule import SCHEDULES  # noqa: E402
from hetpipe.models import build_stage  # noqa: E402

MODELS = {  # name -> (model options, data name and options)
    "char-gpt": (
        {"n_layer": 8, "n_head": 8, "n_embd": 512, "block_size": 128, "vocab_size": 84},
        ("shakespeare", {"block_size": 128}),
    ),
    "resnet50": ({"in_channels": 1, "num_classes": 10, "image_size": 32}, ("mnist", {"pad": 2})),
}
QUICK = {  # --quick: the same kinds of model, small enough for a CPU smoke run
    "char-gpt": (
        {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 84},
        ("shakespeare", {"block_size": 32}),
    ),
    "resnet50": ({"in_channels": 1, "num_classes": 10, "image_size": 32}, ("mnist", {"pad": 2})),
}
SYSTEMS = (  # (system, VWs, stages per VW, Nm, D, schedule, config settings)
    ("hetpipe", 1, 1, 1, 0, "wsp", ()),
    ("hetpipe", 1, 1, 4, 0, "wsp", ()),
    ("hetpipe", 2, 1, 1, 0, "wsp", ()),
    ("hetpipe", 2, 1, 4, 1, "wsp", ()),
    ("hetpipe", 1, 2, 4, 0, "wsp", ()),
    ("hetpipe", 1, 1, 4, 0, "1f1b-flush", ()),
    ("hetpipe", 1, 2, 4, 0, "1f1b-flush", ()),
)
System = tuple[str, int, int, int, int, str, tuple[str, ...]]
HOST_STEPS = 10  # plain loop: steps after the timed ones, each issued onto an idle device, for its host time
LOSS_TAIL = 20  # minibatches whose mean loss a row reports


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def run_name(
    model: str, precision: str, vws: int, stages: int, nm: int, staleness: int, schedule: str
) -> str:
    """What names one setting's config file and run folders."""
    return f"{model}-{precision}-{vws}x{stages}-nm{nm}-d{staleness}-{schedule}"


def bench_config(
    model: str,
    options: dict[str, Any],
    data: tuple[str, dict[str, Any]],
    precision: str,
    device: str,
    vws: int,
    stages: int,
    nm: int,
    staleness: int,
    schedule: str,
    minibatches: int,
    batch: int,
    memory_gib: float,
    out_dir: Path,
) -> ClusterConfig:
    """One node with vws x stages GPUs of one type, every one computing on `device`; one VW per row."""
    num = vws * stages
    gpus = ", ".join('"dev"' for _ in range(num))
    devices = ", ".join(f'"{device}"' for _ in range(num))
    vw_tables = "".join(
        "[[virtual_workers]]\ngpus = [" + ", ".join(f'"n0:{v * stages + j}"' for j in range(stages)) + "]\n"
        for v in range(vws)
    )
    text = f"""name = "gpu-bench"
seed = 0
[gpu_types.dev]
speed = 1.0
memory_gib = {memory_gib}
[[nodes]]
name = "n0"
gpus = [{gpus}]
devices = [{devices}]
[ps]
port = 7900
[wsp]
staleness = {staleness}
nm = {nm}
pull = "exact"
[checkpoint]
dir = ""
[model]
name = "{model}"
options = {_toml_value(options)}
[data]
name = "{data[0]}"
options = {_toml_value(data[1])}
[train]
batch_size = {batch}
waves = {max(3, -(-minibatches // nm))}
optimizer = "adam"
schedule = "{schedule}"
lr = 0.0003
precision = "{precision}"
eval_samples = 512
out_dir = "{out_dir}"
[emulation]
enabled = false
{vw_tables}"""
    path = out_dir / f"{run_name(model, precision, vws, stages, nm, staleness, schedule)}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return load_config(path)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_plain(
    config: ClusterConfig, device_name: str, steps: int, warmup: int, profiled: int = 0
) -> dict[str, Any]:
    """The whole model in this process on `device_name`: samples/s over the steps after `warmup`; `profiled` >
    0: that many more steps under torch.profiler (op_profile's summary as `profile`)."""
    device = torch.device(device_name)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # as a hetpipe stage runs on the CPU
    try:
        return _plain_steps(config, device, steps, warmup, profiled)
    finally:
        torch.set_num_threads(
            threads
        )  # hetpipe's runs in this process evaluate with every core, as the CLI does


def plain_model(
    config: ClusterConfig, device: torch.device
) -> tuple[Any, torch.nn.Module, Any, torch.autocast]:
    """The plain loop's whole model on `device`, its optimizer (the one stages use) and its autocast: (spec,
    model, optimizer, autocast)."""
    spec, t = model_of(config), config.train
    model = build_stage(spec, 0, spec.num_layers, device)
    optimizer = make_optimizer(list(model.parameters()), t.optimizer, t.lr, t.momentum, t.weight_decay)
    return (
        spec,
        model,
        optimizer,
        torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.precision == "bf16"),
    )


def _plain_steps(
    config: ClusterConfig, device: torch.device, steps: int, warmup: int, profiled: int = 0
) -> dict[str, Any]:
    spec, model, optimizer, autocast = plain_model(config, device)
    data, t = dataset_of(config), config.train
    indices = datalib.shard_indices(len(data.train.y), 1, 0, config.seed)
    losses, started, host = [], 0.0, []
    profile_from = warmup + steps + HOST_STEPS
    prof, profile = None, {}
    for step in range(profile_from + profiled):
        if step == profile_from:
            _sync(device)
            prof, profile_started = start_profiler(device), time.perf_counter()
        if step == warmup:
            _sync(device)
            started = time.perf_counter()
        if (
            warmup + steps <= step < profile_from
        ):  # the host time of a step: issued onto an idle device, not waited for
            _sync(device)
            issued = time.perf_counter()
        x, y = datalib.on_device(
            *datalib.minibatch(data.train.x, data.train.y, indices, t.batch_size, config.seed, step), device
        )  # as a stage brings its input over
        with autocast:
            loss = spec.loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step == warmup + steps - 1:
            _sync(device)
            elapsed = time.perf_counter() - started
        elif warmup + steps <= step < profile_from:
            host.append(time.perf_counter() - issued)
    if prof is not None:
        stop_profiler(prof, device)
        profile = {"profile": op_profile(prof, profiled, time.perf_counter() - profile_started, device)}
    tail = [float(v) for v in losses[max(warmup, warmup + steps - LOSS_TAIL) : warmup + steps]]
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "samples_per_s": steps * t.batch_size / elapsed,
        "loss_tail": sum(tail) / len(tail),
        "host_ms": round(1000 * statistics.median(host), 2),
        **profile,
    }


def run_hetpipe(config: ClusterConfig, run_dir: Path, profile: ProfileWindow | None = None) -> dict[str, Any]:
    """`hetpipe train` of `config` (progress off): steady samples/s, wave breakdown, tail after the last wave;
    with `profile`, VW 0's first stage's op profile too (`hetpipe train --profile`)."""
    from hetpipe.app.train import TrainOptions, train

    summary = train(config, TrainOptions(run_dir=run_dir, progress=False, profile=profile))
    returned = time.time()
    rate = throughput.window_rate(
        throughput.trace_streams(run_dir), config.train.batch_size, throughput.WARMUP_WAVES * config.wsp.nm
    )
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    minibatches = [e for e in events if e.get("event") == "minibatch" and not e.get("skipped")]
    tail = [e["loss"] for e in sorted(minibatches, key=lambda e: (e["p"], e["vw"]))[-LOSS_TAIL:]]
    return {
        "samples_per_s": rate,
        "wave_breakdown_ms": summary.get("wave_breakdown_ms", {}),
        "tail_s": round(returned - max(e["t"] for e in minibatches), 2),
        "loss_tail": sum(tail) / len(tail),
        "host_ms": host_ms(run_dir / "trace" / "vw0-s0.json"),
        **({"profile": json.loads((run_dir / "profile" / "vw0-s0.json").read_text())} if profile else {}),
    }


def host_ms(trace_file: Path) -> float:
    """Host milliseconds of one minibatch's F, B and U at VW 0's first stage (the sum of their medians over
    the last three quarters of the run): on CUDA the time to issue them (a stage waits for a wave's last loss,
    at PUSH; a stage with neighbours also waits in F and B for its transfers), on the CPU their compute."""
    spans: dict[str, list[float]] = {"F": [], "B": [], "U": []}
    for event in json.loads(trace_file.read_text())["traceEvents"]:
        kind = event.get("name", "")[:1]
        if event.get("ph") == "X" and event.get("tid") == 0 and kind in spans and event["name"][1:].isdigit():
            spans[kind].append(event["dur"] / 1000)
    return round(sum(statistics.median(v[len(v) // 4 :]) for v in spans.values() if v), 2)


def parse_system(text: str) -> System:
    """`VWSxSTAGES:NM[:D][@SCHEDULE][+KEY=VALUE...]` (as `--system` takes it, e.g. 1x2:4, 2x1:4:1,
    1x2:4@1f1b-flush or 1x1:4+ps.wire_dtype=bfloat16; D 0 and schedule wsp unless given; each +KEY=VALUE a
    config setting as `hetpipe train --set` takes it, for a side-by-side variant of a system) as a SYSTEMS
    entry."""
    head, *settings = text.split("+")
    for item in settings:
        key, sep, value = item.partition("=")
        if not (key.strip() and sep and value.strip()):
            raise click.BadParameter(
                f"{text!r}: each +{item!r} is a config setting KEY=VALUE, e.g. "
                "1x1:4+ps.wire_dtype=bfloat16 or 1x1:4+ps.agent=thread"
            )
    shape_part, _, schedule = head.partition("@")
    schedule = schedule or "wsp"
    try:
        shape, nm, *rest = shape_part.split(":")
        vws, stages = shape.split("x")
        if len(rest) > 1:
            raise ValueError(text)
        system = (
            "hetpipe",
            int(vws),
            int(stages),
            int(nm),
            int(rest[0]) if rest else 0,
            schedule,
            tuple(settings),
        )
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: write VWSxSTAGES:NM[:D][@SCHEDULE], e.g. 1x1:4 (1 VW of 1 stage at "
            "Nm 4), 2x1:4:1 (2 VWs at Nm 4, D 1) or 1x2:4@1f1b-flush"
        ) from None
    if min(system[1:4]) < 1 or system[4] < 0:
        raise click.BadParameter(f"{text!r}: VWs, stages and Nm are each at least 1, D at least 0")
    if schedule not in SCHEDULES:
        raise click.BadParameter(f"{text!r}: schedule {schedule!r} is none of {', '.join(sorted(SCHEDULES))}")
    return system


def median_row(base: dict[str, Any], runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The median run's figures (by samples/s), with the spread of samples/s over all runs."""
    rates = [r["samples_per_s"] for r in runs]
    middle = sorted(runs, key=lambda r: r["samples_per_s"])[len(runs) // 2]
    return {
        **base,
        **middle,
        "samples_per_s": round(statistics.median(rates), 1),
        "samples_per_s_runs": [round(r, 1) for r in rates],
        "repeats": len(runs),
    }


def round_ratios(system_rates: Sequence[float], plain_rates: Sequence[float]) -> list[float]:
    """Each round's samples/s (a row's samples_per_s_runs, in run order) over the plain loop's in the same
    round (run_order pairs them): how the ratio itself moves from round to round, which the two medians'
    spreads do not show where the host drifts."""
    return [round(rate / plain, 3) for rate, plain in zip(system_rates, plain_rates, strict=True)]


BREAKDOWN = ("compute", "d2h", "push", "gate_wait", "pull", "h2d")  # the table's parts of a wave (VW 0), ms


def system_label(row: dict[str, Any]) -> str:
    if row["system"] == "plain":
        return "plain torch loop"
    vws = "VW" if row["vws"] == 1 else "VWs"
    stages = "stage" if row["stages"] == 1 else "stages"
    staleness = f", D {row['staleness']}" if row.get("staleness") else ""
    schedule = f", {row['schedule']}" if row.get("schedule", "wsp") != "wsp" else ""
    settings = "".join(f", {item}" for item in row.get("settings", ()))
    return (
        f"hetpipe {row['vws']} {vws} x {row['stages']} {stages}, "
        f"Nm {row['nm']}{staleness}{schedule}{settings}"
    )


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The README table of `rows` (one run of this script, or several merged): per model and precision, each
    system's median samples/s with its spread, the ratio to the plain loop, the host time of a minibatch (the
    plain loop's step issued onto an idle device; hetpipe's F, B and U at VW 0's first stage), where VW 0's
    waves went, how long `hetpipe train` took to return after its last minibatch, and the 2-stage VW's loss
    against 1 stage's."""
    devices = sorted({r["device"] for r in rows})
    repeats = sorted({r["repeats"] for r in rows if "repeats" in r})
    lines = [
        f"On {', '.join(devices)}; batch {', '.join(sorted({str(r['batch']) for r in rows}))}, Adam; "
        f"median of {'/'.join(map(str, repeats))} runs (min-max; x plain: the medians' ratio, and "
        "each round's against the plain loop's in that round); wave parts of VW 0 in ms per wave:",
        "",
        "| model | precision | system | samples/s | x plain | host ms per minibatch | "
        f"{' / '.join(BREAKDOWN)} | returned after last minibatch | loss vs 1 stage |",
        "|---|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['precision']} | {system_label(r)} | failed: {r['error'][:120]} "
                "| - | - | - | - | - |"
            )
            continue
        runs = r.get("samples_per_s_runs", [r["samples_per_s"]])
        parts = r.get("wave_breakdown_ms", {}).get("0", {})
        wave = " / ".join(f"{parts[k]:.1f}" if k in parts else "-" for k in BREAKDOWN) if parts else "-"
        returned = f"{r['tail_s']:.1f} s" if "tail_s" in r else "-"
        loss = f"{100 * r['loss_vs_one_stage']:+.1f}%" if "loss_vs_one_stage" in r else "-"
        host = f"{r['host_ms']:.1f}" if "host_ms" in r else "-"
        by_round = r.get("ratio_by_round", [])
        spread = f" ({min(by_round):.2f}-{max(by_round):.2f})" if len(by_round) > 1 else ""
        ratio = f"{r['ratio_to_plain']:.2f}{spread}"
        lines.append(
            f"| {r['model']} | {r['precision']} | {system_label(r)} | {r['samples_per_s']:.1f} "
            f"({min(runs):.1f}-{max(runs):.1f}) | {ratio} | {host} | {wave} | {returned} "
            f"| {loss} |"
        )
    profiled = [r for r in rows if isinstance(r.get("profile"), dict) and "wall_ms" in r["profile"]]
    if profiled:
        lines += [
            "",
            "Profiled (torch.profiler, untimed runs; hetpipe: VW 0's first stage), a minibatch:",
            "",
            "| model | precision | system | wall ms | host ms in torch ops | device ms | aten calls "
            "| costliest ops by host ms |",
            "|---|---|---|---:|---:|---:|---:|---|",
        ]
        for r in profiled:
            p = r["profile"]
            ops = ", ".join(f"{o['name']} {o['self_host_ms']:.2f}" for o in p["by_host"][:3])
            device = f"{p['ops_device_ms']:.2f}" if p.get("ops_device_ms") is not None else "-"
            lines.append(
                f"| {r['model']} | {r['precision']} | {system_label(r)} | {p['wall_ms']:.2f} "
                f"| {p['ops_host_ms']:.2f} | {device} | {p['aten_calls']:.0f} | {ops} |"
            )
    return "\n".join(lines)


@dataclass(frozen=True)
class Setting:
    """One model at one precision on one device: what every system of the run shares."""

    model: str
    options: dict[str, Any]
    data: tuple[str, dict[str, Any]]
    precision: str
    device: str
    device_name: str
    batch: int
    minibatches: int
    memory_gib: float
    work: Path

    def config(
        self,
        vws: int,
        stages: int,
        nm: int,
        staleness: int = 0,
        schedule: str = "wsp",
        settings: Sequence[str] = (),
    ) -> ClusterConfig:
        return apply_overrides(
            bench_config(
                self.model,
                self.options,
                self.data,
                self.precision,
                self.device,
                vws,
                stages,
                nm,
                staleness,
                schedule,
                self.minibatches,
                self.batch,
                self.memory_gib,
                self.work,
            ),
            settings,
        )


def system_run(setting: Setting, system: System, suffix: str) -> tuple[ClusterConfig, Path]:
    """The config of one hetpipe system and the folder of its run `suffix` (a repeat's number, or
    "profile")."""
    _, vws, stages, nm, staleness, schedule, settings = system
    name = run_name(setting.model, setting.precision, vws, stages, nm, staleness, schedule)
    name += "".join("+" + re.sub(r"[^A-Za-z0-9._=-]", "_", item) for item in settings)
    return setting.config(vws, stages, nm, staleness, schedule, settings), setting.work / f"{name}-{suffix}"


def run_order(systems: int, repeats: int) -> list[tuple[int, int]]:
    """(system, repeat) in the order they run, system -1 the plain loop: round by round, the plain loop and
    then each hetpipe system once a round, so a drift of the machine's speed during the run (seen on the
    device host: a quarter between calls) reaches the plain loop and every system alike instead of whichever
    ran last."""
    return [(system, repeat) for repeat in range(repeats) for system in range(-1, systems)]


def run_setting(
    setting: Setting,
    systems: Sequence[System],
    repeats: int,
    warmup: int,
    measured: Callable[[dict[str, Any]], None],
    profile: ProfileWindow | None = None,
) -> None:
    """The plain loop and every hetpipe system of `systems`, `repeats` times each, interleaved (run_order);
    `measured` gets each row once its runs are done. A system whose run fails gets a row with its error
    instead of figures and runs no more; the others go on. With `profile`, the plain loop's last run profiles
    profile.count steps after its timed ones and each system runs once more, profiled, untimed (rows'
    `profile`)."""
    base = {
        "device": setting.device_name,
        "model": setting.model,
        "precision": setting.precision,
        "batch": setting.batch,
        "minibatches": setting.minibatches,
    }
    labels = [
        {
            **base,
            "system": system,
            "nm": nm,
            "vws": vws,
            "stages": stages,
            "staleness": staleness,
            "schedule": schedule,
            **({"settings": list(settings)} if settings else {}),
        }
        for system, vws, stages, nm, staleness, schedule, settings in systems
    ]
    runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(-1, len(systems))}
    failed: dict[int, str] = {}
    for i, repeat in run_order(len(systems), repeats):
        if i in failed:
            continue
        if i < 0:
            profiled = profile.count if profile is not None and repeat == repeats - 1 else 0
            runs[i].append(
                run_plain(setting.config(1, 1, 1), setting.device, setting.minibatches, warmup, profiled)
            )
        else:
            try:
                runs[i].append(run_hetpipe(*system_run(setting, systems[i], str(repeat))))
            except Exception as e:  # noqa: BLE001  (recorded in the row and the exit status, not hidden)
                failed[i] = f"{type(e).__name__}: {e}"
                continue
        label = "plain torch loop" if i < 0 else system_label(labels[i])
        click.echo(
            f"  run {repeat + 1}/{repeats} of {setting.model} {setting.precision} {label}: "
            f"{runs[i][-1]['samples_per_s']:.1f} samples/s",
            err=True,
        )
    profiles = {-1: runs[-1][-1].pop("profile", None)}
    for i in range(len(systems)):
        if profile is not None and i not in failed:
            click.echo(
                f"  profiled run of {setting.model} {setting.precision} {system_label(labels[i])}", err=True
            )
            try:
                profiles[i] = run_hetpipe(*system_run(setting, systems[i], "profile"), profile=profile)[
                    "profile"
                ]
            except Exception as e:  # noqa: BLE001  (the timed runs stand; the row says why it has no profile)
                profiles[i] = {"error": f"{type(e).__name__}: {e}"}
    plain_row = median_row({**base, "system": "plain", "nm": 1, "vws": 1, "stages": 1}, runs[-1])
    plain_row["ratio_to_plain"] = 1.0
    if profiles[-1] is not None:
        plain_row["profile"] = profiles[-1]
    click.echo(f"{setting.model} {setting.precision} plain: {plain_row['samples_per_s']} samples/s", err=True)
    measured(plain_row)
    for i, row_labels in enumerate(labels):
        if i in failed:
            measured({**row_labels, "error": failed[i]})
            click.echo(
                f"{setting.model} {setting.precision} {system_label(row_labels)}: FAILED: {failed[i]}",
                err=True,
            )
            continue
        row = median_row(row_labels, runs[i])
        row["ratio_to_plain"] = round(row["samples_per_s"] / plain_row["samples_per_s"], 3)
        row["ratio_by_round"] = round_ratios(row["samples_per_s_runs"], plain_row["samples_per_s_runs"])
        if i in profiles:
            row["profile"] = profiles[i]
        click.echo(
            f"{setting.model} {setting.precision} {system_label(row)}: {row['samples_per_s']} samples/s = "
            f"{row['ratio_to_plain']}x plain, returned {row['tail_s']} s after its last minibatch",
            err=True,
        )
        measured(row)


@click.command()
@click.option(
    "--device", default=None, help="Where everything computes (default: cuda:0 when there is one, else cpu)."
)
@click.option(
    "--model", "models", type=click.Choice(sorted(MODELS)), multiple=True, help="Repeatable; default both."
)
@click.option(
    "--precision",
    "precisions",
    type=click.Choice(["fp32", "bf16"]),
    multiple=True,
    help="Repeatable; default both.",
)
@click.option(
    "--system",
    "systems",
    multiple=True,
    callback=lambda _c, _p, v: tuple(map(parse_system, v)),
    help="VWSxSTAGES:NM[:D][@SCHEDULE][+KEY=VALUE...], repeatable (default: 1x1:1 1x1:4 2x1:1 2x1:4:1 "
    "1x2:4 1x1:4@1f1b-flush 1x2:4@1f1b-flush); +KEY=VALUE sets the config as `hetpipe train --set` "
    "does (1x1:4+ps.agent=thread beside 1x1:4 compares the two); the plain loop always runs.",
)
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--minibatches", type=int, default=300, show_default=True, help="Per VW and run.")
@click.option("--warmup", type=int, default=20, show_default=True, help="Plain loop: untimed steps first.")
@click.option("--batch", type=int, default=64, show_default=True)
@click.option(
    "--memory-gib",
    type=float,
    default=None,
    help="The device's memory for hetpipe's fit check (default: the CUDA device's, or 16 on the CPU).",
)
@click.option(
    "--keep",
    "keep_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep every hetpipe run's folder (logs, traces, metrics) here instead of a temporary one.",
)
@click.option("--quick", is_flag=True, help="Small models at batch 8, for a smoke run on the CPU.")
@click.option(
    "--profile",
    metavar="FIRST:COUNT",
    default=None,
    callback=parse_profile_option,
    help="Also profile (torch.profiler, untimed): the plain loop's COUNT steps after its last timed run, "
    "and one more run of each system with `hetpipe train --profile FIRST:COUNT`; rows get `profile`.",
)
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the rows as JSON here.",
)
@click.option(
    "--table",
    "table_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the rows as the README's Markdown table here.",
)
@click.option(
    "--rows",
    "row_files",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    multiple=True,
    help="Run nothing: merge the rows of these --out files (one per model or precision, for runs split "
    "over several calls) into --out and --table.",
)
def main(
    device: str | None,
    models: tuple[str, ...],
    precisions: tuple[str, ...],
    systems: tuple[System, ...],
    repeats: int,
    minibatches: int,
    warmup: int,
    batch: int,
    memory_gib: float | None,
    keep_dir: Path | None,
    quick: bool,
    profile: ProfileWindow | None,
    out_path: Path | None,
    table_path: Path | None,
    row_files: tuple[Path, ...],
) -> None:
    if profile is not None and not profile.fits(minibatches):
        raise click.BadParameter(
            f"{profile.first}:{profile.count} ends at minibatch {profile.last}, past the runs' "
            f"{minibatches}: lower FIRST or COUNT, or raise --minibatches",
            param_hint="--profile",
        )
    if row_files:
        rows = [row for path in row_files for row in with_round_ratios(json.loads(path.read_text()))]
        _write(rows, out_path, table_path)
        return
    device = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if memory_gib is None:
        memory_gib = (
            torch.cuda.get_device_properties(torch.device(device)).total_memory / 2**30
            if device.startswith("cuda")
            else 16.0
        )
    name = (
        torch.cuda.get_device_name(torch.device(device))
        if device.startswith("cuda")
        else "CPU (one thread per process)"
    )
    table = QUICK if quick else MODELS
    batch = 8 if quick else batch
    rows: list[dict[str, Any]] = []

    def save(
        rows: list[dict[str, Any]], row: dict[str, Any]
    ) -> None:  # what is measured survives a later failure
        rows.append(row)
        compare_stages(rows)
        _write(rows, out_path, None, echo=False)

    with tempfile.TemporaryDirectory(prefix="hetpipe-gpu-") as temporary:
        work = keep_dir or Path(temporary)
        for model in models or sorted(MODELS):
            for precision in precisions or ("fp32", "bf16"):
                setting = Setting(
                    model, *table[model], precision, device, name, batch, minibatches, memory_gib, work
                )
                run_setting(
                    setting, systems or SYSTEMS, repeats, warmup, lambda row: save(rows, row), profile
                )
    _write(rows, out_path, table_path)
    if any("error" in row for row in rows):
        raise SystemExit(1)


def with_round_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One --out file's rows, each hetpipe row given ratio_by_round where it lacks one (files written before
    gpu.py recorded it, 2026-11-26; their runs already alternated round by round) from its own file's plain
    row."""
    plains = {
        (r["model"], r["precision"]): r for r in rows if r["system"] == "plain" and "samples_per_s_runs" in r
    }
    for row in rows:
        plain = plains.get((row["model"], row["precision"]))
        runs = row.get("samples_per_s_runs")
        if (
            row["system"] != "plain"
            and "ratio_by_round" not in row
            and plain is not None
            and runs is not None
            and len(runs) == len(plain["samples_per_s_runs"])
        ):
            row["ratio_by_round"] = round_ratios(runs, plain["samples_per_s_runs"])
    return rows


def compare_stages(rows: list[dict[str, Any]]) -> None:
    """Each 2-stage VW's loss against 1 stage's at the same Nm and schedule, where both ran: under a flush
    schedule the same training, split (under wsp each stage's weights lag by its own count of updates)."""
    ones = {
        (r["model"], r["precision"], r["nm"], r.get("schedule", "wsp"), *r.get("settings", ())): r
        for r in rows
        if (r["system"], r["vws"], r["stages"]) == ("hetpipe", 1, 1) and "loss_tail" in r
    }
    for row in rows:
        one = ones.get(
            (row["model"], row["precision"], row["nm"], row.get("schedule", "wsp"), *row.get("settings", ()))
        )
        if row["stages"] == 2 and "loss_tail" in row and one is not None:
            row["loss_vs_one_stage"] = round(row["loss_tail"] / one["loss_tail"] - 1, 4)


def _write(
    rows: list[dict[str, Any]], out_path: Path | None, table_path: Path | None, echo: bool = True
) -> None:
    text = json.dumps(rows, indent=1)
    if out_path:
        out_path.write_text(text + "\n")
    if table_path:
        table_path.write_text(markdown(rows) + "\n")
    if echo:
        click.echo(text)
        click.echo(markdown(rows), err=True)


if __name__ == "__main__":
    main()

"""The memory model against measured peak memory: one stage runs its schedule's action list through the
runtime's own StageCompute (forwards, backwards, updates, pushes, pulls and rebases, no transport), and its
peak is read from the C heap (glibc mallinfo2, after every tensor operation), beside what
hetpipe.core.planning.memory predicts from the model's sizes (hetpipe.compute.sizes).

    python launch/bench/memory.py                       # the default cases, a table
    python launch/bench/memory.py --out memory.json

Each case runs in a fresh process on the CPU with freed memory kept in the heap (hetpipe.compute.heap), so
"in use" is the bytes of live allocations; the baseline is taken after the data and before the stage's
layers are built. Measured on the CPU: what a GPU's allocator would report (torch.cuda.max_memory_allocated)
is the same live tensors plus its rounding.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

__all__ = ["Case", "measure", "CASES"]


@dataclass(frozen=True)
class Case:
    model: str
    options: tuple[tuple[str, Any], ...]
    batch: int
    schedule: str
    nm: int
    stage: int
    num_stages: int
    layers: tuple[int, int]  # [start, stop) of the stage
    staleness: int = 0
    pulls: bool = True
    optimizer: str = "adam"
    waves: int = 6


CASES = (
    Case("mlp", (("hidden", (1024, 1024, 1024)),), 128, "wsp", 4, 0, 2, (0, 3)),
    Case("mlp", (("hidden", (1024, 1024, 1024)),), 128, "1f1b-flush", 4, 0, 2, (0, 3), staleness=1),
    Case("mnist-cnn", (("channels", (32, 64)), ("hidden", 256)), 64, "wsp", 3, 1, 2, (2, 6)),
    Case("mnist-cnn", (("batch_norm", True),), 64, "gpipe", 2, 0, 2, (0, 3)),
    Case(
        "char-gpt",
        (("n_layer", 2), ("n_embd", 128), ("n_head", 4), ("block_size", 64)),
        16,
        "pipedream-2bw",
        2,
        0,
        1,
        (0, 4),
        optimizer="adam",
    ),
)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _in_use() -> int:
    """Bytes of live C-heap allocations (glibc): the ordinary heap's in-use blocks plus mmapped ones."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _run(case: Case, out: Any) -> None:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from hetpipe.compute.heap import keep_freed_memory
    from hetpipe.compute.sizes import model_sizes
    from hetpipe.compute.stage_compute import StageCompute, StageRules
    from hetpipe.core.pipeline.schedule import get_schedule
    from hetpipe.core.planning.memory import MemoryRule, stage_memory_terms
    from hetpipe.core.wsp.clock import gate_version
    from hetpipe.models import build_stage, get_model

    torch.set_num_threads(1)
    keep_freed_memory()
    spec = get_model(case.model, **dict(case.options))
    sizes = model_sizes(spec, case.batch, case.optimizer)
    start, stop = case.layers
    rule = MemoryRule(nm=case.nm, schedule=case.schedule, staleness=case.staleness, pulls=case.pulls)
    input_bytes = sizes.input_bytes if start == 0 else sizes.layers[start - 1].output_bytes
    predicted = stage_memory_terms(
        sizes.layers[start:stop], case.stage, case.num_stages, rule, input_bytes=input_bytes
    )
    kind = get_schedule(case.schedule)
    actions = kind(case.num_stages, case.nm, case.waves, case.staleness).stages[case.stage]
    last = case.stage == case.num_stages - 1
    gen = torch.Generator().manual_seed(0)
    x0 = spec.example_input(case.batch)
    with torch.no_grad():  # the shapes at the stage's boundaries, once
        whole = build_stage(spec, 0, spec.num_layers)
        h = x0
        for i, layer in enumerate(whole):
            if i == start:
                entering = h
            h = layer(h)
            if i == stop - 1:
                leaving = h
        target = torch.randint(0, spec.num_classes, h.shape[:-1], generator=gen)
        del whole, h
    peak = [0]

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            peak[0] = max(peak[0], _in_use())
            return result

    # made once and kept: the math libraries' buffers (packing, workspaces) and the modules the watch imports
    warm = build_stage(spec, start, stop)
    with Watch():
        out_warm = warm(entering.clone() if start > 0 else x0.clone())
        (spec.loss(out_warm, target) if last else out_warm.sum()).backward()
    del warm, out_warm
    base = peak[0] = _in_use()

    module = build_stage(spec, start, stop)
    stashing = kind.stashing != "none"
    compute = StageCompute(module, case.optimizer, 1e-3, 0.9, 0.0, StageRules(nm=case.nm, stashing=stashing))
    waits = [a.index for a in actions if a.kind == "WAIT"] if case.pulls else []
    pushed: list[Any] = []
    sent: list[Any] = []
    with Watch():
        for a in actions:
            if a.kind == "F":
                inputs = entering.clone() if start > 0 else x0.clone()
                compute.forward(a.index, inputs, target if last else None, spec.loss, input_grad=start > 0)
            elif a.kind == "B":
                grad = None if last else torch.randn(leaving.shape, generator=gen)
                grad_in, _ = compute.backward(a.index, grad, target if last else None, spec.loss)
                if start > 0:  # the P2P window keeps sent gradients until their sends are waited for
                    sent = [*sent, grad_in][-(case.nm + 1) :]
                del grad, grad_in
            elif a.kind == "U":
                compute.update(a.index)
            elif a.kind == "PUSH":
                pushed = [compute.wave_push(a.index)][-1:]  # what the agent holds until the next push is out
                ahead = next((c for c in waits if c > a.index), None)
                through = a.index if ahead is None else min(a.index, gate_version(ahead, case.staleness) - 1)
                compute.forget(through, a.index)  # as worker/stage.py: pushed sums to the host (CUDA, D >= 1)
            elif a.kind == "WAIT" and case.pulls:
                pulled = {k: t.detach().clone() for k, t in compute.values().items()}
                compute.rebase(pulled, gate_version(a.index, case.staleness) - 1)
                del pulled
    del pushed, sent
    out.put(
        {
            "case": asdict(case),
            "predicted": predicted.total,
            "terms": asdict(predicted),
            "measured": peak[0] - base,
        }
    )


def measure(case: Case) -> dict[str, Any]:
    """Run `case` in a fresh process; predicted and measured peak bytes of the stage."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_run, args=(case, queue))
    proc.start()
    result = queue.get(timeout=600)
    proc.join(60)
    result["error"] = round(result["predicted"] / result["measured"] - 1, 4)
    return result


@click.command()
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the rows as JSON here.",
)
def main(out_path: Path | None) -> None:
    """Predicted vs measured peak memory of one stage, for the default cases."""
    rows = []
    print(
        f"{'model':<10} {'schedule':<14} {'nm':>3} {'stage':>6} "
        f"{'predicted':>12} {'measured':>12} {'error':>7}"
    )
    for case in CASES:
        row = measure(case)
        rows.append(row)
        print(
            f"{case.model:<10} {case.schedule:<14} {case.nm:>3} {f'{case.stage}/{case.num_stages}':>6} "
            f"{row['predicted'] / 2**20:>10.2f}Mi {row['measured'] / 2**20:>10.2f}Mi {row['error']:>+7.1%}",
            flush=True,
        )
    if out_path is not None:
        out_path.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())

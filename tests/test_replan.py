"""Planned spans (docs/wsp.md#planned-spans): a re-plan set before the run, VWs that train waves [start, end)
only. The config's rules, the shard's clock and sums, the data shards, and `exact` runs that change the
number of VWs at two freeze points against the reference."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from hetpipe.app.span_starts import LaterVw, SpanStarts, starts_after
from hetpipe.app.train import TrainOptions, train
from hetpipe.compute import data as datalib
from hetpipe.compute.build import VwLayout, model_of, vw_layouts
from hetpipe.compute.optim import make_optimizer
from hetpipe.compute.optimizer_state import load_state_by_name, state_by_name
from hetpipe.compute.reference import run_reference
from hetpipe.core.config.files import load_config, run_dir_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.config.serialize import config_toml
from hetpipe.core.errors import ConfigError
from hetpipe.core.wsp.aggregation import MeanAggregation, SumAggregation
from hetpipe.core.wsp.audit import planned_gaps
from hetpipe.core.wsp.handover import optimizer_sources
from hetpipe.core.wsp.results import WspError
from hetpipe.core.wsp.state import ShardState
from hetpipe.worker.snapshot import list_snapshots

from conftest import write_config
from equivalence import assert_bitwise, listed_work, run

F32 = np.float32


def spanned_config(tmp_path: Path, vws: list[list[str]], spans: list[tuple[int, int]], **kwargs) -> Path:
    """write_config's cluster with each VW's `waves = [start, end]`."""
    path = write_config(tmp_path, vws=vws, **kwargs)
    head, *tables = path.read_text().split("[[virtual_workers]]\n")
    listed = [f"[[virtual_workers]]\nwaves = {list(s)}\n{t}" for s, t in zip(spans, tables, strict=True)]
    path.write_text(head + "".join(listed))
    return path


# ---------------------------------------------------------------------------------------------- the config


def test_a_gpu_may_serve_two_vws_whose_waves_do_not_overlap(tmp_path: Path) -> None:
    path = spanned_config(
        tmp_path, [["n0:0", "n0:1"], ["n0:0"], ["n0:1"]], [(0, 3), (3, 6), (3, 6)], nm=2, staleness=0, waves=6
    )
    config = load_config(path)
    assert [vw.waves for vw in config.virtual_workers] == [(0, 3), (3, 6), (3, 6)]
    again = tmp_path / "again.toml"
    again.write_text(config_toml(config))
    assert [vw.waves for vw in load_config(again).virtual_workers] == [(0, 3), (3, 6), (3, 6)]


@pytest.mark.parametrize(
    ("spans", "extra", "field", "says"),
    [
        ([(0, 4), (3, 6)], "", "virtual_workers[1].gpus[0]", "during the same waves"),
        ([(0, 3), (3, 7)], "", "virtual_workers[1].waves", "past the run's train.waves = 6"),
        ([(0, 3), (4, 6)], "", "virtual_workers", "no virtual worker trains wave 3"),
        ([(0, 3), (3, 3)], "", "virtual_workers[1].waves", "start < end"),
        ([(0, 3), (3, 6)], "[ps]\nnode_aggregation = true\n", "ps.node_aggregation", "whole run"),
        ([(0, 3), (3, 6)], '[ps]\non_vw_failure = "evict"\n', "ps.on_vw_failure", "mid-run"),
    ],
)
def test_a_plan_of_spans_that_cannot_run_is_refused_naming_the_field(
    tmp_path: Path, spans: list[tuple[int, int]], extra: str, field: str, says: str
) -> None:
    path = spanned_config(tmp_path, [["n0:0"], ["n0:0"]], spans, nm=2, staleness=0, waves=6, extra=extra)
    with pytest.raises(ConfigError, match=say_both(field, says)):
        load_config(path)


def say_both(field: str, says: str) -> str:
    """A pattern for an error that names `field` and then says `says`."""
    return "(?s)" + re.escape(field) + ".*" + re.escape(says)


def test_warmup_counts_the_vws_once_and_is_refused_with_spans(tmp_path: Path) -> None:
    path = spanned_config(tmp_path, [["n0:0"], ["n0:1"]], [(0, 3), (3, 6)], nm=2, staleness=0, waves=6)
    with pytest.raises(ConfigError, match="train.mitigation.*counts the VWs once"):
        apply_overrides(load_config(path), ['train.mitigation="warmup"'])


# ---------------------------------------------------------------------------------------------- the shard


def _keys(vw: int) -> dict[str, np.ndarray]:
    return {"k": np.zeros(2, F32)}


def _register(state: ShardState, vw: int, spans: tuple[tuple[int, int], ...], start: int = 0) -> None:
    state.register(vw, 0, 3, 1, _keys(vw), None, 6, start, spans=spans)


SPANS = ((0, 2), (0, 2), (2, 0))  # VWs 0 and 1 train waves 0-1, VW 2 waves 2 to the end (6)


@pytest.mark.parametrize("rule", [SumAggregation(), MeanAggregation()], ids=["sum", "mean"])
def test_a_vw_planned_later_holds_no_clock_back_and_those_planned_to_end_retire(rule) -> None:
    """VW 2 counts as having done 2 waves before it registers; VWs 0 and 1 retire the moment their wave 1 is
    in, so c_global moves to VW 2's start; wave 2 sums VW 2 alone (a mean divides by 1, not 3)."""
    state = ShardState(staleness=0, aggregation=rule)
    _register(state, 0, SPANS)
    _register(state, 1, SPANS)
    assert state.c_local(2) == 2 and state.live_vws() == [0, 1, 2]
    for wave in range(2):
        for vw in range(2):
            state.push(vw, 0, wave, {"k": np.full(2, F32(vw + 1))})
        assert state.c_global == wave + 1
    assert state.live_vws() == [2] and state.membership.retired(0) and not state.membership.ever_changed()
    assert state.gaps() == [[0, 2, -1], [1, 2, -1], [2, 0, 2]]
    per_wave = 3.0 if isinstance(rule, SumAggregation) else 1.5
    np.testing.assert_array_equal(state.versions[2]["k"], np.full(2, F32(2 * per_wave)))
    _register(state, 2, SPANS, start=2)
    state.push(2, 0, 2, {"k": np.full(2, F32(4))})
    assert state.c_global == 3
    np.testing.assert_array_equal(state.versions[3]["k"], np.full(2, F32(2 * per_wave + 4)))
    assert state.push(0, 0, 1, {"k": np.ones(2, F32)}).applied is False  # a retired VW's retry, acknowledged


def test_a_new_vw_may_push_before_the_old_ones_retire() -> None:
    """VW 2 pushes its first wave while VWs 0 and 1 are still on wave 1 (the gate lets it run D + 1 waves
    ahead): wave 2's sum is VW 2's alone from the start, so it is folded the moment the old VWs retire."""
    state = ShardState(staleness=1, aggregation=MeanAggregation())
    for vw in range(3):
        _register(state, vw, SPANS, start=2 if vw == 2 else 0)
    for vw in range(2):
        state.push(vw, 0, 0, {"k": np.full(2, F32(vw + 1))})
    state.push(2, 0, 2, {"k": np.full(2, F32(4))})
    assert state.c_global == 1
    for vw in range(2):
        state.push(vw, 0, 1, {"k": np.full(2, F32(vw + 1))})
    assert state.c_global == 3 and state.live_vws() == [2]
    np.testing.assert_array_equal(state.versions[3]["k"], np.full(2, F32(1.5 + 1.5 + 4)))


def test_registrations_must_agree_on_the_spans_and_a_checkpoint_keeps_them() -> None:
    state = ShardState(staleness=0)
    _register(state, 0, SPANS)
    with pytest.raises(WspError, match="train waves"):
        _register(state, 1, ((0, 3), (0, 3), (3, 0)))
    with pytest.raises(WspError, match="starts at wave 0, but vw 2 is live from wave 2"):
        _register(state, 2, SPANS)
    _register(state, 1, SPANS)
    state.push(0, 0, 0, {"k": np.ones(2, F32)})
    meta, arrays = state.to_state()
    back = ShardState.from_state(meta, arrays, SumAggregation())
    assert back.membership.planned == state.membership.planned == {0: (0, 2), 1: (0, 2), 2: (2, -1)}
    for s in (state, back):
        s.push(1, 0, 0, {"k": np.ones(2, F32)})
        for vw in range(2):
            s.push(vw, 0, 1, {"k": np.ones(2, F32)})
        assert s.live_vws() == [2] and s.c_global == 2


def test_planned_gaps_are_the_waves_before_a_start_and_after_an_end() -> None:
    assert planned_gaps([(0, 6), (0, 2), (2, 6), (2, 4)], 6) == [[1, 2, -1], [2, 0, 2], [3, 0, 2], [3, 4, -1]]


# ---------------------------------------------------------------------------------------------- the hand-over


def test_the_vws_that_start_at_a_re_plan_take_the_retiring_vws_optimizer_state_in_turn() -> None:
    spans = [(0, 3), (0, 3), (0, 8), (3, 6), (3, 6), (3, 6), (6, 8), (7, 8)]
    assert optimizer_sources(spans) == {3: 0, 4: 1, 5: 0, 6: 3}  # VW 7 starts where none ends: fresh


@pytest.mark.parametrize("name", ["momentum", "adam"])
@pytest.mark.parametrize("device_optimizer", [False, True], ids=["hetpipe-optim", "torch-optim"])
def test_optimizer_state_moves_by_name_between_stages_split_otherwise(name: str, device_optimizer: bool):
    """Two stages of layers 0-1 and 2 hand their state to one stage of layers 1-2: each parameter's state
    lands on that parameter, a parameter no source has starts fresh."""
    torch.manual_seed(0)
    names = ["0.weight", "1.weight", "2.weight"]
    params = {k: torch.nn.Parameter(torch.randn(3)) for k in names}

    def optimizer(keys):
        group = [params[k] for k in keys]
        if device_optimizer:  # what a CUDA stage runs (torch.optim), here on the CPU
            if name == "momentum":
                return torch.optim.SGD(group, lr=0.1, momentum=0.9)
            return torch.optim.Adam(group)
        return make_optimizer(group, name, 0.1, 0.9, 0.0)

    first, second = optimizer(names[:2]), optimizer(names[2:])
    for opt in (first, second):
        for _ in range(2):
            for p in params.values():
                p.grad = torch.randn(3)
            opt.step()
    handed = {**state_by_name(first, names[:2]), **state_by_name(second, names[2:])}
    taker = optimizer(names[1:])
    load_state_by_name(taker, names[1:], {k: v for k, v in handed.items() if k != "2.weight"})
    got = state_by_name(taker, names[1:])
    assert set(got) == {"1.weight"}
    for field, value in handed["1.weight"].items():
        assert torch.equal(got["1.weight"][field], value), field


# ---------------------------------------------------------------------------------------------- the launcher


def test_a_vw_waits_for_the_vws_that_hold_its_gpus_before_it() -> None:
    """A VW planned for later waves waits for each earlier VW it shares a GPU with; one on GPUs of its own, or
    training every wave, starts at once; SpanStarts starts a waiting one once those pushed their last wave."""
    vws = [
        VwLayout(("n0:0", "n0:1"), (2, 2), waves=(0, 3)),
        VwLayout(("n0:2",), (4,)),
        VwLayout(("n0:0",), (4,), waves=(3, 6)),
        VwLayout(("n0:1", "n0:3"), (2, 2), waves=(3, 6)),
        VwLayout(("n0:4",), (4,), waves=(3, 6)),
    ]
    assert starts_after(vws, 6) == {2: (0,), 3: (0,)}
    started: list[int] = []
    starts = SpanStarts(lambda later: started.append(later.vw) or {(later.vw, 0): later.vw})
    starts.pending = [LaterVw(2, [], (0,)), LaterVw(3, [], (0, 1))]
    done = {0: False, 1: False}
    assert starts.tick(done.__getitem__) == {} and not started
    done[0] = True
    assert starts.tick(done.__getitem__) == {(2, 0): 2} and started == [2]
    done[1] = True
    assert starts.tick(done.__getitem__) == {(3, 0): 3} and not starts.pending


# ---------------------------------------------------------------------------------------------- the data


def test_the_vws_training_a_wave_split_the_data_among_themselves() -> None:
    """From each wave at which the set of VWs changes, the VWs then training split the data as VWs always do:
    disjoint slices, sized by their weights; without a change, the shard is the plain one."""
    n, seed = 1000, 7
    spans = [(0, 6), (0, 3), (3, 6), (3, 6)]
    weights = [1, 1, 2, 1]
    shards = {v: datalib.span_shards(n, spans, v, seed, weights) for v in range(4)}
    assert [first for first, _ in shards[0]] == [0, 3]
    assert [first for first, _ in shards[2]] == [3]
    np.testing.assert_array_equal(shards[1][0][1], datalib.shard_indices(n, 2, 1, seed, [1, 1]))
    wave3 = [shards[0][1][1], shards[2][0][1], shards[3][0][1]]
    assert [len(s) for s in wave3] == [250, 500, 250]
    assert len(np.unique(np.concatenate(wave3))) == 1000
    plain = datalib.span_shards(n, [(0, 6)] * 3, 2, seed)
    assert len(plain) == 1 and np.array_equal(plain[0][1], datalib.shard_indices(n, 3, 2, seed))


# ---------------------------------------------------------------------------------------------- runs


@pytest.mark.parametrize(
    ("model", "settings", "vws", "spans", "splits"),
    [
        (  # 2 VWs of 2 GPUs, then 3 VWs, then 4 VWs of one GPU each; D = 0; the PS agent a process, so
            # vw4's first stage, all frozen from its start, shares empty buffers with it
            "mlp",
            ["train.freeze=[[3, 2], [5, 3]]", 'ps.agent="process"'],
            [["n0:0", "n0:1"], ["n0:2", "n0:3"], ["n0:0"], ["n0:1"], ["n0:2", "n0:3"]]
            + [["n0:0"], ["n0:1"], ["n0:2"], ["n0:3"]],
            [(0, 3)] * 2 + [(3, 5)] * 3 + [(5, 7)] * 4,
            [(2, 2), (3, 1), (4,), (4,), (1, 3), (4,), (4,), (4,), (4,)],
        ),
        (  # BatchNorm, a mean, D = 1: beside a VW that trains throughout, 1 VW, then 2, then 1
            "mnist-cnn",
            [
                "model.options={ batch_norm = true, channels = [4, 8], hidden = 16 }",
                'ps.aggregation="mean"',
                "wsp.staleness=1",
                "train.freeze=[[2, 1], [4, 3]]",
            ],
            [["n0:0", "n0:1", "n0:2"], ["n0:3"], ["n0:3", "n0:4"], ["n0:5"], ["n0:3"]],
            [(0, 7), (0, 2), (2, 4), (2, 4), (4, 7)],
            [(2, 3, 1), (6,), (4, 2), (6,), (6,)],
        ),
    ],
    ids=["mlp-2-3-4-vws-agent-process", "bn-cnn-mean"],
)
def test_a_re_plan_at_two_freeze_points_equals_the_reference(
    tmp_path: Path, model: str, settings: list[str], vws: list[list[str]], spans: list, splits: list
) -> None:
    """`exact` runs whose number of VWs changes at both freeze points equal the reference bit for bit: every
    stage of every VW (each as its span leaves it) and the PS; each VW trained its span's samples only."""
    path = spanned_config(tmp_path, vws, spans, nm=2, staleness=0, waves=7, model=model)
    config = apply_overrides(load_config(path), settings)
    summary, stage_weights, ps_weights = run(tmp_path, config, splits)
    ref = run_reference(config, splits, order_seed=1, work=listed_work(config))
    for sid, weights in stage_weights.items():
        assert_bitwise(weights, ref.stage_weights[sid], f"stage {sid}")
    assert_bitwise(ps_weights, ref.ps_weights, "PS weights")
    trained: dict[int, set[int]] = {}
    first_step: dict[int, float] = {}
    last_push: dict[int, float] = {}
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "minibatch":
            trained.setdefault(event["vw"], set()).add(event["p"])
            first_step[event["vw"]] = min(first_step.get(event["vw"], event["t"]), event["t"])
        if event["event"] == "push":
            last_push[event["vw"]] = max(last_push.get(event["vw"], event["t"]), event["t"])
    assert trained == {v: set(range(start * 2, end * 2)) for v, (start, end) in enumerate(spans)}
    layouts = [VwLayout(tuple(g), s, waves=w) for g, s, w in zip(vws, splits, spans, strict=True)]
    held = starts_after(layouts, 7)
    assert held  # a GPU serves one VW at a time: a later VW computes once the earlier ones pushed their last
    for v, earlier in held.items():
        assert all(first_step[v] > last_push[u] for u in earlier), (v, earlier)
    assert summary["samples"] == sum(end - start for start, end in spans) * 2 * config.train.batch_size


@pytest.mark.slow
def test_a_re_plan_survives_a_killed_shard_and_a_killed_stage_at_the_handover(tmp_path: Path) -> None:
    """VW 0 (2 GPUs) ends at wave 4, its GPUs then serve VWs 2 and 3 beside VW 1, layers frozen from wave 4.
    The PS shard is SIGKILLed as VW 0 hands over (its last push in, the new VWs not yet pushing) and comes
    back from its checkpoint; a stage of a new VW is SIGKILLed after wave 6 and the run stops; `--resume`
    finishes it (from a cut at or after the re-plan; a VW starting at the cut takes VW 0's optimizer state
    from the file VW 0 left). The ledger audit holds throughout, and the result equals the uninterrupted
    reference bit for bit (VW 0's stages, done before the cut, are not restarted)."""
    settings = ["checkpoint.every=2", "checkpoint.keep=2", 'checkpoint.dir="ps"', "train.freeze=[[4, 2]]"]
    vws = [["n0:0", "n0:1"], ["n0:2", "n0:3"], ["n0:0"], ["n0:1"]]
    path = spanned_config(
        tmp_path,
        vws,
        [(0, 4), (0, 10), (4, 10), (4, 10)],
        nm=2,
        staleness=1,
        waves=10,
        emulation=True,
        time_scale=15.0,
        speeds=[1.0] * 4,
    )
    config = apply_overrides(load_config(path), settings)
    cut = tmp_path / "cut"
    command = [sys.executable, "-m", "hetpipe", "train", str(path), "--run-dir", str(cut), "--quiet"]
    proc = subprocess.Popen(
        [*command, "--audit", *[a for s in settings for a in ("--set", s)]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def wait_for(done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 180
        while not done():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)

    def pid(name: str) -> int:
        return json.loads((cut / "pids.json").read_text())[name]

    try:
        wait_for(lambda: all(4 in list_snapshots(cut, 0, j) for j in range(2)))
        os.kill(pid("ps-shard-0"), signal.SIGKILL)
        wait_for(lambda: all(max(list_snapshots(cut, v, 0), default=0) >= 6 for v in (1, 2, 3)))
        os.kill(pid("vw2-s0"), signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "vw2-s0" in err, err
    exits = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert any(e["event"] == "child_exit" and e.get("action") == "restart" for e in exits), "no shard restart"
    resumed = train(
        run_dir_config(cut),
        TrainOptions(run_dir=cut, progress=False, dump_weights=True, audit=True, resume=True),
    )
    # the cut: wave 6, or 4 (the re-plan itself) when the PS had not written its checkpoint of 6 yet
    assert resumed["resumed_from"] in (4, 6, 8) and resumed["audit_final_ledgers_exact"] is True
    splits = [lay.split for lay in vw_layouts(config, model_of(config))]
    ref = run_reference(config, splits)
    for (v, j), want in ref.stage_weights.items():
        if v > 0:
            got = torch.load(cut / f"final-vw{v}-s{j}.pt", weights_only=True)
            assert_bitwise(got, want, f"stage {(v, j)}")
    ps = torch.load(cut / "model.pt", weights_only=True)
    assert_bitwise(ps, {k: torch.from_numpy(w) for k, w in ref.ps_weights.items()}, "PS weights")

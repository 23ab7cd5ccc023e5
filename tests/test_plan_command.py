"""hetpipe.app.plan_command: the progress line (nothing for a short search, then about one line a second),
the notes on a setting that moves fewer bytes over a busy PS link (link_note), and the note on the optimizer
on the PS for a plan below capacity (optimizer_note)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hetpipe.app.plan_command import (
    NODE_SETTING,
    WIRE_SETTING,
    LinkSetting,
    PlanRequest,
    PlanSearch,
    link_note,
    optimizer_note,
    run_plan,
)
from hetpipe.app.progress_line import ProgressLine
from hetpipe.app.train import apply_plan
from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.planning.candidates import Candidate
from hetpipe.core.planning.plan import Plan, StagePlan, VwPlan


def test_progress_is_quiet_for_two_seconds_then_at_most_once_a_second() -> None:
    now = [0.0]
    printed: list[str] = []
    progress = ProgressLine(printed.append, clock=lambda: now[0])
    for t in (0.5, 1.0, 1.9, 2.0, 2.5, 2.99, 3.0, 3.2, 4.1):
        now[0] = t
        progress(f"at {t}")
    assert printed == ["at 2.0", "at 3.0", "at 4.1"]


# ---------------------------------------------------------------------------------------------- link notes

TWO_BY_TWO = Path(__file__).parent / "clusters" / "two-by-two.toml"


def request(profile_dir: Path) -> PlanRequest:
    """`hetpipe plan tests/clusters/two-by-two.toml --profile-dir <empty>`: the shipped profile, derived."""
    return PlanRequest(TWO_BY_TWO, profile_dir, 10, (), None, 0.0, (), (), False, None, None, True, ())


def chosen(samples_per_s: float, ps_utilisation: float) -> Candidate:
    stage = StagePlan("n0:0", "t", 0, 1, 0.1, 0.2, 0.0, 0.0, 1, 2)
    plan = Plan("dp", "toy", 4, 0, (VwPlan((stage,), 1, 1),))
    return Candidate("dp", 0, plan, samples_per_s, ps_utilisation=ps_utilisation, schedule="wsp")


def searched_at(samples_per_s: float, seen: list[ClusterConfig]):
    """A search that records the config it was given and finds one plan at `samples_per_s`."""

    def search(config: ClusterConfig, _: PlanRequest) -> PlanSearch:
        seen.append(config)
        return PlanSearch([chosen(samples_per_s, 0.5)], config, [], 1.0, 0.0)

    return search


def test_a_busy_link_plans_again_with_the_setting_on_and_notes_a_gain_over_2_percent(tmp_path: Path) -> None:
    config = load_config(TWO_BY_TWO)
    seen: list[ClusterConfig] = []
    note = link_note(config, request(tmp_path), chosen(100.0, 0.9), NODE_SETTING, searched_at(150.0, seen))
    assert [c.ps.node_aggregation for c in seen] == [True]  # the same search, the setting on
    assert note == (
        "the PS link is 90% busy: with node-local aggregation (set [ps] node_aggregation = true; the VWs "
        "wholly on one node push and pull through one relay there, one copy of the weights per node and wave "
        "over the PS's links) the best plan would be dp wsp D=0: 150 samples/s predicted, 1.50x"
    )
    wire = link_note(config, request(tmp_path), chosen(100.0, 0.9), WIRE_SETTING, searched_at(150.0, seen))
    assert seen[-1].ps.wire_dtype == "bfloat16" and not seen[-1].ps.node_aggregation
    assert wire is not None and 'set [ps] wire_dtype = "bfloat16"' in wire
    # a gain of 2% or less: no note; a link under 85% busy, or the setting already on: not even a search
    assert (
        link_note(config, request(tmp_path), chosen(100.0, 0.9), NODE_SETTING, searched_at(102.0, seen))
        is None
    )
    before = len(seen)
    assert (
        link_note(config, request(tmp_path), chosen(100.0, 0.84), NODE_SETTING, searched_at(200.0, seen))
        is None
    )
    on = apply_overrides(config, ["ps.node_aggregation=true"])
    assert (
        link_note(on, request(tmp_path), chosen(100.0, 0.99), NODE_SETTING, searched_at(200.0, seen)) is None
    )
    # a setting the config refuses beside its others (as node aggregation with latest pulls): no note either
    refused = LinkSetting(lambda config: True, "ps.shards=0", "with no shards")
    assert (
        link_note(config, request(tmp_path), chosen(100.0, 0.99), refused, searched_at(200.0, seen)) is None
    )
    assert len(seen) == before


def below_capacity(samples_per_s: float, capacity: float) -> Candidate:
    return dataclasses.replace(chosen(samples_per_s, 0.5), capacity=capacity)


def searched_by_rule(samples_per_s: float, seen: list[tuple[ClusterConfig, PlanRequest]]):
    """A search that records the config and request it was given and finds one plan at `samples_per_s`,
    against a capacity of 200."""

    def search(config: ClusterConfig, asked: PlanRequest) -> PlanSearch:
        seen.append((config, asked))
        return PlanSearch([below_capacity(samples_per_s, 200.0)], config, [], 1.0, 0.0)

    return search


def test_a_plan_below_capacity_with_optimizer_state_plans_again_with_it_on_the_ps(
    tmp_path: Path,
) -> None:
    """two-by-two.toml trains with momentum under `sum` (the stages keep the buffers): a plan at 50% of
    capacity is planned again with aggregation "server" under the config's rule only, and the note gives
    that plan, its share and its gain; at 90% or over, with plain SGD or with "server" already: no search."""
    config = load_config(TWO_BY_TWO)
    seen: list[tuple[ClusterConfig, PlanRequest]] = []
    note = optimizer_note(
        config, request(tmp_path), below_capacity(100.0, 200.0), searched_by_rule(150.0, seen)
    )
    ((planned, asked),) = seen
    assert planned.ps.aggregation == "server" and planned.train.optimizer == "momentum"
    assert not asked.search_rules  # the note's rule, not one a calibration would pick instead
    assert note == (
        "the best plan makes 50% of capacity and every stage holds the optimizer's state (momentum: one "
        'buffer per weight): with the optimizer on the PS (set [ps] aggregation = "server"; the VWs push '
        'gradients and hold no optimizer state; another training rule than "sum", so compare time to target) '
        "the best plan would be dp wsp D=0: 150 samples/s predicted (75% of capacity), 1.50x"
    )
    adam = apply_overrides(config, ['train.optimizer="adam"'])
    note = optimizer_note(
        adam, request(tmp_path), below_capacity(100.0, 200.0), searched_by_rule(150.0, seen)
    )
    assert note is not None and "(adam: two moments per weight)" in note
    # a gain of 2% or less: no note
    assert (
        optimizer_note(config, request(tmp_path), below_capacity(100.0, 200.0), searched_by_rule(102.0, seen))
        is None
    )
    before = len(seen)
    for quiet, at in (
        (config, below_capacity(180.0, 200.0)),  # at 90% of capacity
        (apply_overrides(config, ['train.optimizer="sgd"']), below_capacity(100.0, 200.0)),
        (apply_overrides(config, ['ps.aggregation="server"']), below_capacity(100.0, 200.0)),
        (config, below_capacity(100.0, 0.0)),  # no capacity known
    ):
        assert optimizer_note(quiet, request(tmp_path), at, searched_by_rule(300.0, seen)) is None
    assert len(seen) == before


def plan_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str], *settings: str) -> list[str]:
    config = apply_overrides(load_config(TWO_BY_TWO), list(settings))
    run_plan(config, request(tmp_path), out_path=None, show_why=False, as_json=False)
    return capsys.readouterr().out.splitlines()


def node_notes(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("note: the PS link is") and "node_aggregation" in line]


def best_rate(lines: list[str]) -> float:
    line = next(line for line in lines if line.startswith("best: "))
    return float(line.split(" samples/s predicted")[0].split(": ")[-1])


def test_hetpipe_plan_names_node_aggregation_when_the_ps_link_binds_and_it_gains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """two-by-two.toml at 0.05 Gbit/s: its best plan keeps the PS link 88% busy; with node aggregation each
    node's two VWs send one copy of the weights, and that config's best plan is the one the note promised."""
    plain = plan_lines(tmp_path, capsys)
    (note,) = node_notes(plain)
    assert "(set [ps] node_aggregation = true;" in note
    relayed = plan_lines(tmp_path, capsys, "ps.node_aggregation=true")
    promised = float(note.split(" samples/s predicted")[0].split(": ")[-1])
    assert best_rate(relayed) == promised > 1.02 * best_rate(plain)
    assert any(line.startswith("  node aggregation: vw0+vw1 through n0's relay") for line in relayed)
    assert not node_notes(relayed)


@pytest.mark.parametrize(
    "gbps",
    [
        0.2,  # the PS link under 85% busy: no second search
        0.01,  # busy, but the best plan then is one VW at 4 x the batch, and the relayed ones gain nothing
    ],
)
def test_hetpipe_plan_says_nothing_of_node_aggregation_without_a_busy_link_and_a_gain(
    gbps: float, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = plan_lines(tmp_path, capsys, f"network.inter_node_gbps={gbps}")
    assert not node_notes(lines)
    busy = float(next(line for line in lines if line.startswith("best: ")).split("PS link ")[1].split("%")[0])
    assert (busy < 85) == (gbps == 0.2)


def optimizer_notes(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("note: the best plan makes") and "aggregation" in line]


def test_hetpipe_plan_names_the_optimizer_on_the_ps_when_its_state_keeps_a_gpu_from_a_replica(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """two-by-two.toml with 10 MiB on each slow GPU and fast links: under momentum a slow GPU cannot hold a
    replica with its buffer, so the best plan pipelines fast+slow (87% of capacity); with the optimizer on the
    PS every GPU holds one, and that config's best plan is the one the note promised. At 5 MiB not even that
    fits: no gain, no note."""
    cramped = ("gpu_types.slow.memory_gib=0.01", "network.inter_node_gbps=10.0")
    plain = plan_lines(tmp_path, capsys, *cramped)
    (note,) = optimizer_notes(plain)
    assert "(momentum: one buffer per weight)" in note and '(set [ps] aggregation = "server";' in note
    served = plan_lines(tmp_path, capsys, *cramped, 'ps.aggregation="server"')
    promised = float(note.split(" samples/s predicted")[0].split(": ")[-1])
    assert best_rate(served) == promised > 1.02 * best_rate(plain)
    assert not optimizer_notes(served)
    assert not optimizer_notes(plan_lines(tmp_path, capsys, "gpu_types.slow.memory_gib=0.005", cramped[1]))


def test_hetpipe_plan_predicts_the_best_plan_after_each_freeze_point(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """[train] freeze: a line per freeze point under the best plan, its figure the same plan's with those
    layers frozen; on a busy PS link (0.05 Gbit/s) each point predicts more than the one before (fewer
    weights to move, less backward), and the first more than the plan itself."""
    lines = plan_lines(tmp_path, capsys, "network.inter_node_gbps=0.05", "train.freeze=[[5, 3], [10, 5]]")
    after = [line for line in lines if line.startswith("  after freezing layers")]
    assert [line.split(" samples/s")[0].split(": ")[0] for line in after] == [
        "  after freezing layers 0-2 at wave 5",
        "  after freezing layers 0-4 at wave 10",
    ]
    rates = [float(line.split(": ")[1].split(" samples/s")[0].replace(",", "")) for line in after]
    assert best_rate(lines) < rates[0] < rates[1]
    assert not [line for line in plan_lines(tmp_path, capsys) if "after freezing" in line]


def test_hetpipe_plan_re_plans_at_each_freeze_point_and_train_runs_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """two-by-two.toml at 0.05 Gbit/s: the best plan keeps one VW on node n0 (a second would load the PS link
    more than it adds). With 5 of 6 layers frozen from wave 10 the re-plan puts a VW on each node: more than
    keeping the VWs. `--out` holds each paying re-plan, and `hetpipe train --plan` reads it as spans: the
    first plan's VWs train waves 0-4, the re-plans' 5-9 and 10-19; `--json` gives the same figures."""
    settings = ["network.inter_node_gbps=0.05", "train.freeze=[[5, 3], [10, 5]]"]
    config = apply_overrides(load_config(TWO_BY_TWO), settings)
    out = tmp_path / "plan.json"
    run_plan(config, request(tmp_path), out_path=out, show_why=False, as_json=False)
    lines = capsys.readouterr().out.splitlines()
    replanned = [line for line in lines if line.startswith("re-plan at wave")]
    assert [line.split(": ")[0] for line in replanned] == [
        "re-plan at wave 5 (layers 0-2 frozen)",
        "re-plan at wave 10 (layers 0-4 frozen)",
    ]
    gains = [float(line.split("predicted, ")[1].split("x keeping")[0]) for line in replanned]
    assert all(gain > 1.0 for gain in gains)
    assert "2 VWs (n0:1,n0:0; n1:1,n1:0)" in replanned[1]
    _, layouts = apply_plan(config, out)
    spans = [lay.waves for lay in layouts]
    assert spans == [(0, 5), (5, 10), (10, 20), (10, 20)]
    last = {g for lay in layouts if lay.waves == (10, 20) for g in lay.gpus}
    assert last == {"n0:0", "n0:1", "n1:0", "n1:1"}
    run_plan(config, request(tmp_path), out_path=None, show_why=False, as_json=True)
    doc = json.loads(capsys.readouterr().out)
    assert [(r["wave"], r["layers"], round(r["gain"], 2)) for r in doc["replans"]] == [
        (5, 3, gains[0]),
        (10, 5, gains[1]),
    ]
    run_plan(load_config(TWO_BY_TWO), request(tmp_path), out_path=out, show_why=False, as_json=False)
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("re-plan")]
    assert [lay.waves for lay in apply_plan(load_config(TWO_BY_TWO), out)[1]] == [None]


def test_hetpipe_plan_says_an_adaptive_run_is_planned_without_freezing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """[train] autofreeze_every: no point is known before the run, so no line per point, and a note says the
    plans are predicted as without freezing (the same best plan as without the rule)."""
    lines = plan_lines(tmp_path, capsys, "train.autofreeze_every=5")
    assert any(line.startswith("note: [train] autofreeze_every: the run decides") for line in lines)
    assert not [line for line in lines if "after freezing" in line]
    assert best_rate(lines) == best_rate(plan_lines(tmp_path, capsys))

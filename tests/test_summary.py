"""hetpipe.core.planning.summary (and the pieces of report.py it prints with): the planner's order, rows
folded by D, the reason each runner-up lost and wrapping, against literal candidates; `hetpipe plan` on every
shipped config: at most 40 lines by default, every candidate with --all."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hetpipe.core.planning.candidates import Candidate, GpuUse, best, ranked
from hetpipe.core.planning.plan import Plan, StagePlan, VwPlan
from hetpipe.core.planning.report import format_plan, gpu_set
from hetpipe.core.planning.summary import (
    d_text,
    default_view,
    fold,
    folded_table,
    loser_reason,
    percent,
    wrap,
)

GIB = 2**30
ROOT = Path(__file__).parent.parent
SHIPPED = [
    *sorted((ROOT / "launch" / "clusters").glob("*.toml")),
    ROOT / "hetpipe" / "clusters" / "local.toml",
]


def vw(gpus: list[str], stage_s: float = 0.1, memory: int = GIB, nm: int = 4) -> VwPlan:
    """A VW of one stage per GPU, 4 layers each, every stage `stage_s` (forward 1/3, backward 2/3)."""
    stages = tuple(
        StagePlan(g, "titan-v", 4 * j, 4 * j + 4, stage_s / 3, 2 * stage_s / 3, 0.0, 0.0, memory, 12 * GIB)
        for j, g in enumerate(gpus)
    )
    return VwPlan(stages, nm, 1000)


def cand(
    rate: float,
    d: int = 0,
    *,
    policy: str = "ed",
    schedule: str = "wsp",
    vws: tuple[VwPlan, ...] | None = None,
    memory: int = GIB,
    ps: float = 0.1,
    gate: float = 0.0,
    bottleneck: str = "vw0 stage 1",
) -> Candidate:
    """A runnable candidate: by default two 2-stage VWs on n0:0-1 and n1:0-1."""
    vws = vws or (vw(["n0:0", "n0:1"], memory=memory), vw(["n1:0", "n1:1"], memory=memory))
    plan = Plan(policy, "mlp", 32, d, vws, schedule=schedule)
    uses = tuple(GpuUse(s.gpu, s.gpu_type, s.memory_bytes, 12 * GIB) for v in vws for s in v.stages)
    return Candidate(
        policy,
        d,
        plan,
        rate,
        memory=uses,
        bottleneck=bottleneck,
        nm=vws[0].nm,
        gate_wait_share=gate,
        ps_utilisation=ps,
        schedule=schedule,
    )


BASELINE = Candidate("allreduce", None, None, 250.0, memory=(GpuUse("n0:0", "titan-v", GIB, 12 * GIB),))
NO_FIT = Candidate(
    "np", 0, None, 0.0, reason="wsp with D=0: vw0 stage 0 on n0:0 (titan-v) needs 13 GiB of 12 GiB"
)


# ------------------------------------------------------------------------------------------ order, folding


def test_ranked_puts_the_best_first_then_by_rate_then_baselines_then_what_cannot_run() -> None:
    slow, stale, fresh = cand(90.0, policy="np"), cand(101.0, 1), cand(100.0, 0)
    found = [NO_FIT, slow, BASELINE, stale, fresh]
    # fresh: within 2% of the highest (stale) at a smaller D, so the planner chooses it
    assert best(found) is fresh
    assert ranked(found) == [fresh, stale, slow, BASELINE, NO_FIT]


def test_rows_alike_but_for_d_fold_into_one_row_with_the_fullest_memory() -> None:
    found = [cand(100.0, d, memory=GIB + d * 2**20) for d in (0, 1, 2, 4)] + [cand(90.0, 0, policy="np")]
    folds = fold(found)
    assert [[c.staleness for c in f.members] for f in folds] == [[0, 1, 2, 4], [0]]
    table = folded_table(folds, best(found), [0, 1, 2, 4]).splitlines()
    assert len(table) == 3
    assert table[1].startswith("*  ed      wsp       0-4  4   2    4     4/4 x2            100")
    assert "1.00 GiB/12.00 GiB n1:1 titan-v" in table[1]  # D=4's 1 GiB + 4 MiB, the fullest, shows as 1.00
    assert table[2].startswith("   np      wsp       0 ")


def test_rows_that_print_other_numbers_do_not_fold() -> None:
    found = [cand(100.0, 0), cand(99.0, 1), cand(100.0, 0, schedule="pipedream")]
    assert [len(f.members) for f in fold(found)] == [1, 1, 1]


@pytest.mark.parametrize(
    ("ds", "searched", "text"),
    [
        ([0, 1, 2, 4], [0, 1, 2, 4], "0-4"),
        ([1, 2], [0, 1, 2, 4], "1-2"),
        ([0, 4], [0, 1, 2, 4], "0,4"),
        ([0, 2], [0, 2, 4], "0-2"),
        ([2], [0, 1, 2, 4], "2"),
        ([], [0, 1], "-"),
    ],
)
def test_d_text(ds: list[int], searched: list[int], text: str) -> None:
    assert d_text(ds, searched) == text


# ------------------------------------------------------------------------------------------ why each lost


def test_loser_reasons_name_the_one_thing_that_lost() -> None:
    top = cand(100.0)
    one_vw = (vw(["n0:0", "n0:1"]),)
    uneven = (vw(["n0:0", "n0:1"]), vw(["n1:0", "n1:1"], stage_s=0.2))
    assert loser_reason(cand(50.0, vws=one_vw), top) == "50% slower: uses 2 of the 4 GPUs the best uses"
    assert loser_reason(cand(90.0, ps=0.95), top) == "10% slower: PS link 95% busy"
    assert (
        loser_reason(cand(97.0, gate=0.12), top) == "3.0% slower: stages wait at the WSP gate 12% of the time"
    )
    assert loser_reason(cand(80.0, vws=uneven), top) == (
        "20% slower: vw1's wave takes 0.8 s, vw0's 0.4 s, and WSP holds the fast VWs to the slowest"
    )
    assert loser_reason(cand(96.5, bottleneck="vw1 stage 0 n1:0 (titan-v)"), top) == (
        "3.5% slower: slowest stage vw1 stage 0 n1:0 (titan-v) (the best's slowest: 0.1 s)"
    )
    assert loser_reason(cand(100.0, 2), top) == "the same 100 samples/s; the best has the smaller D (0 vs 2)"
    assert loser_reason(cand(100.0, schedule="pipedream"), top) == (
        "the same 100 samples/s; a tie, and the best is searched first (ed wsp)"
    )
    assert loser_reason(cand(101.0, 1), top) == (
        "1.0% faster, under the 2% a plan must gain to be chosen over one of D=0"
    )
    assert loser_reason(NO_FIT, top) == f"cannot run: {NO_FIT.reason}"
    assert loser_reason(BASELINE, top).endswith("a baseline hetpipe does not run (shown for comparison)")


def test_percent_keeps_small_differences_visible() -> None:
    assert [percent(x) for x in (0.5, 0.1, 0.035, 0.004)] == ["50%", "10%", "3.5%", "0.4%"]


# ------------------------------------------------------------------------------------------ layout, wrapping


def test_gpu_set_names_runs_of_a_nodes_gpus() -> None:
    assert gpu_set(["n1:0", "n1:1", "n1:2", "n1:3"]) == "n1:0-3"
    assert gpu_set(["n0:1", "n2:0", "n2:1"]) == "n0:1,n2:0-1"
    assert gpu_set(["n0:0", "n0:2"]) == "n0:0,n0:2"
    assert gpu_set(["n0:0"]) == "n0:0"


def test_the_best_plans_alike_vws_fold_into_one_block() -> None:
    c = cand(100.0, vws=(vw(["n0:0", "n1:0"]), vw(["n0:1", "n1:1"]), vw(["n0:2", "n1:2"], stage_s=0.2)))
    folded = format_plan(c, fold_alike=True).splitlines()
    assert folded[0] == format_plan(c).splitlines()[0]
    assert [line.split(":")[0].strip() for line in folded[1:] if "vw" in line] == ["vw0-1", "vw2"]
    assert folded[2].split()[:3] == ["stage", "0", "n0:0-1"] and folded[3].split()[2] == "n1:0-1"
    assert len(format_plan(c).splitlines()) == 1 + 3 * 3 and len(folded) == 1 + 2 * 3


def test_wrap_keeps_every_line_within_the_width_and_indents_what_it_breaks() -> None:
    assert wrap("  aaaa bbbb cccc dddd eeee\nshort", 20).splitlines() == [
        "  aaaa bbbb cccc",
        "      dddd eeee",
        "short",
    ]
    long = "x" * 50 + " " + "word " * 30
    assert all(len(line) <= 20 for line in wrap(long, 20).splitlines())
    assert wrap(long, 20).replace(" ", "").replace("\n", "") == long.replace(" ", "")


def test_default_view_shows_the_best_few_its_layout_and_why_the_others_lost() -> None:
    found = [cand(100.0 - 5 * i, d, policy=p) for i, p in enumerate(("ed", "hd", "np")) for d in (0, 1)]
    found += [cand(50.0, 0, policy=f"p{i}", vws=(vw(["n0:0"]),)) for i in range(4)] + [BASELINE, NO_FIT]
    text = default_view(found, [0, 1], considered=100, width=60, rows=3)
    lines = text.splitlines()
    assert lines[0].startswith("the 3 best of 7 distinct plans, best first")
    assert [line[:14] for line in lines[2:5]] == ["*  ed      wsp", "   hd      wsp", "   np      wsp"]
    assert lines[5] == (
        "baselines (shown for comparison, hetpipe does not run them): allreduce 250 samples/s"
    )
    assert "best: " + format_plan(best(found), fold_alike=True) in text
    assert "\nwhy the others lost:\n  hd wsp D 0-1: 5.0% slower: slowest stage vw0 stage 1" in text
    assert all(len(line) <= 60 for line in text[text.index("why the others lost") :].splitlines()[:-1])
    # 6 rows shown (3 folds of 2) and the baseline; 12 candidates kept; 100 considered
    assert lines[-1] == (
        "93 more candidates considered; `--all` lists the 5 kept, the other 88 were left out by the search "
        "(counted above)"
    )


# ------------------------------------------------------------------------------------------ the CLI


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetpipe", "plan", *args], capture_output=True, text=True, timeout=300
    )


TABLE_ROW = re.compile(r"^[* ]  \S")  # a table row, not the best plan's "  vw0" or "    stage" lines


@pytest.mark.slow
@pytest.mark.parametrize("config", SHIPPED, ids=[f"{p.parent.name}/{p.stem}" for p in SHIPPED])
def test_every_shipped_config_plans_in_40_lines_starting_with_the_best(config: Path) -> None:
    """The default view fits a screen, its table starts with the best, and its best plan is --json's; stdout
    of --json stays JSON."""
    short, as_json = plan(str(config)), plan(str(config), "--json")
    for result in (short, as_json):
        assert result.returncode == 0, result.stderr
    lines = short.stdout.splitlines()
    assert len(lines) <= 40, short.stdout
    rows = [line for line in lines if TABLE_ROW.match(line)]
    assert rows[0].split()[:2] == ["policy", "schedule"] and rows[1].startswith("*  ") and 2 <= len(rows) <= 6
    data = json.loads(as_json.stdout)
    top = data["candidates"][data["best"]]
    assert rows[1].split()[1:3] == [top["policy"], top["schedule"] or "-"]
    assert sum(line.startswith("best: ") for line in lines) == 1


@pytest.mark.slow
def test_all_lists_every_candidate_in_the_planners_order() -> None:
    """--all lists every candidate --json does, the best first, with the default view's best plan."""
    config = ROOT / "launch" / "clusters" / "paper-16gpu.toml"
    short, every, as_json = plan(str(config)), plan(str(config), "--all"), plan(str(config), "--json")
    for result in (short, every, as_json):
        assert result.returncode == 0, result.stderr
    best_lines = [line for line in short.stdout.splitlines() if line.startswith("best: ")]
    assert len(best_lines) == 1 and best_lines == [
        line for line in every.stdout.splitlines() if line.startswith("best: ")
    ]
    data = json.loads(as_json.stdout)
    rows = [line for line in every.stdout.splitlines() if TABLE_ROW.match(line)][1:]
    assert len(rows) == len(data["candidates"]) > 6 and rows[0].startswith("*  ")
    top = data["candidates"][data["best"]]
    assert rows[0].split()[1:3] == [top["policy"], top["schedule"] or "-"]

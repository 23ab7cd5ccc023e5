"""launch/bench/gpu.py on the CPU: every system of the issue's table runs and gives a complete row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from hetpipe.core.errors import HetpipeError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
import gpu  # noqa: E402  (launch/bench is not a package)

pytestmark = pytest.mark.slow

FIELDS = {"system", "model", "precision", "nm", "vws", "stages", "samples_per_s", "ratio_to_plain"}


def test_smoke_run_on_the_cpu_gives_every_row(tmp_path: Path):
    out = tmp_path / "gpu.json"
    result = CliRunner().invoke(
        gpu.main,
        [
            "--device",
            "cpu",
            "--quick",
            "--model",
            "char-gpt",
            "--precision",
            "fp32",
            "--repeats",
            "1",
            "--minibatches",
            "24",
            "--warmup",
            "2",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert [(r["system"], r["vws"], r["stages"], r["nm"]) for r in rows] == [
        ("plain", 1, 1, 1),
        ("hetpipe", 1, 1, 1),
        ("hetpipe", 1, 1, 4),
        ("hetpipe", 2, 1, 1),
        ("hetpipe", 2, 1, 4),
        ("hetpipe", 1, 2, 4),
        ("hetpipe", 1, 1, 4),
        ("hetpipe", 1, 2, 4),
    ]
    assert [r.get("staleness") for r in rows] == [None, 0, 0, 0, 1, 0, 0, 0]
    assert [r.get("schedule") for r in rows][-3:] == ["wsp", "1f1b-flush", "1f1b-flush"]
    for row in rows:
        assert set(row) >= FIELDS and row["samples_per_s"] > 0 and row["host_ms"] > 0
    for row in rows[1:]:
        assert set(row["wave_breakdown_ms"]["0"]) >= {"compute", "d2h", "push", "gate_wait", "pull", "h2d"}
        assert row["tail_s"] < 10  # `hetpipe train` returns within 10 s of its last minibatch (issue 11)
    assert abs(rows[-1]["loss_vs_one_stage"]) < 0.02  # on the flush schedule 2 stages train as 1 does


ROWS = [
    {
        "device": "NVIDIA H100 80GB HBM3",
        "model": "char-gpt",
        "precision": "fp32",
        "batch": 64,
        "system": "plain",
        "nm": 1,
        "vws": 1,
        "stages": 1,
        "samples_per_s": 1950.0,
        "samples_per_s_runs": [1940.0, 1950.0, 1961.0],
        "repeats": 3,
        "ratio_to_plain": 1.0,
        "host_ms": 20.25,
    },
    {
        "device": "NVIDIA H100 80GB HBM3",
        "model": "char-gpt",
        "precision": "fp32",
        "batch": 64,
        "system": "hetpipe",
        "nm": 4,
        "staleness": 1,
        "vws": 2,
        "stages": 1,
        "samples_per_s": 1800.0,
        "samples_per_s_runs": [1790.0, 1800.0, 1812.5],
        "repeats": 3,
        "ratio_to_plain": 0.923,
        "ratio_by_round": [0.923, 0.951, 0.918],
        "tail_s": 1.234,
        "loss_vs_one_stage": -0.0042,
        "wave_breakdown_ms": {
            "0": {"compute": 130.0, "d2h": 2.25, "push": 5.0, "gate_wait": 0.0, "pull": 4.0}
        },
    },
]


def test_the_table_names_the_device_and_gives_each_row_its_spread_ratio_and_wave_parts():
    lines = gpu.markdown(ROWS).splitlines()
    assert lines[0].startswith("On NVIDIA H100 80GB HBM3; batch 64, Adam; median of 3 runs")
    assert (
        lines[-2]
        == "| char-gpt | fp32 | plain torch loop | 1950.0 (1940.0-1961.0) | 1.00 | 20.2 | - | - | - |"
    )
    assert lines[-1] == (
        "| char-gpt | fp32 | hetpipe 2 VWs x 1 stage, Nm 4, D 1 | 1800.0 (1790.0-1812.5) "
        "| 0.92 (0.92-0.95) | - | 130.0 / 2.2 / 5.0 / 0.0 / 4.0 / - | 1.2 s | -0.4% |"
    )


def test_rows_of_split_runs_merge_into_one_file_and_table(tmp_path: Path):
    parts = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, row in zip(parts, ROWS, strict=True):
        path.write_text(json.dumps([row]))
    out, table = tmp_path / "gpu.json", tmp_path / "gpu.md"
    result = CliRunner().invoke(
        gpu.main, ["--rows", str(parts[0]), "--rows", str(parts[1]), "--out", str(out), "--table", str(table)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text()) == ROWS and table.read_text() == gpu.markdown(ROWS) + "\n"


def test_merged_rows_written_before_ratio_by_round_get_it_from_their_own_files_plain_row(tmp_path: Path):
    base = {
        "device": "cpu",
        "model": "resnet50",
        "precision": "bf16",
        "batch": 64,
        "nm": 4,
        "vws": 1,
        "stages": 1,
    }
    plain = {
        **base,
        "system": "plain",
        "samples_per_s": 100.0,
        "samples_per_s_runs": [100.0, 120.0, 80.0],
        "ratio_to_plain": 1.0,
    }
    old = {
        **base,
        "system": "hetpipe",
        "samples_per_s": 95.0,
        "samples_per_s_runs": [90.0, 99.0, 95.0],
        "ratio_to_plain": 0.95,
    }
    short = {**old, "precision": "fp32", "samples_per_s_runs": [95.0]}  # no plain row of its own: left alone
    kept = {**old, "nm": 1, "ratio_by_round": [0.5, 0.5, 0.5]}
    path, out = tmp_path / "e.json", tmp_path / "gpu.json"
    path.write_text(json.dumps([plain, old, short, kept]))
    result = CliRunner().invoke(gpu.main, ["--rows", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert rows[1]["ratio_by_round"] == [0.9, 0.825, 1.188] and "ratio_by_round" not in rows[0]
    assert "ratio_by_round" not in rows[2] and rows[3] == kept  # one it already had is kept as it was


def test_system_option_reads_vws_stages_and_nm_and_refuses_the_rest():
    assert gpu.parse_system("1x2:4") == ("hetpipe", 1, 2, 4, 0, "wsp", ())
    assert gpu.parse_system("2x1:4:1") == ("hetpipe", 2, 1, 4, 1, "wsp", ())
    assert gpu.parse_system("1x2:4@1f1b-flush") == ("hetpipe", 1, 2, 4, 0, "1f1b-flush", ())
    assert gpu.parse_system("1x1:4@1f1b-flush+ps.wire_dtype=bfloat16+ps.agent=thread") == (
        "hetpipe",
        1,
        1,
        4,
        0,
        "1f1b-flush",
        ("ps.wire_dtype=bfloat16", "ps.agent=thread"),
    )
    for bad in ("1x2", "12:4", "axb:c", "0x1:4", "2x1:4:-1", "2x1:4:1:1", "1x2:4@flush"):
        with pytest.raises(click.BadParameter, match="VWs|VWSxSTAGES|schedule"):
            gpu.parse_system(bad)
    for bad in ("1x1:4+", "1x1:4+ps.agent", "1x1:4+=thread", "1x1:4+ps.agent="):
        with pytest.raises(click.BadParameter, match="is a config setting KEY=VALUE"):
            gpu.parse_system(bad)


def test_a_failed_system_is_a_row_with_its_error_and_two_stages_compare_only_where_one_stage_ran():
    base = {"model": "char-gpt", "precision": "fp32", "system": "hetpipe", "vws": 1}
    rows = [
        {**base, "stages": 1, "nm": 4, "loss_tail": 2.0},
        {**base, "stages": 2, "nm": 4, "loss_tail": 2.1},
        {**base, "stages": 2, "nm": 1, "loss_tail": 2.5},
        {**base, "stages": 2, "nm": 8, "error": "E: boom"},
    ]
    gpu.compare_stages(rows)
    assert rows[1]["loss_vs_one_stage"] == 0.05 and "loss_vs_one_stage" not in rows[2]
    line = gpu.markdown([{**ROWS[0]}, {**rows[3], "batch": 64, "device": "cpu"}]).splitlines()[-1]
    assert line == "| char-gpt | fp32 | hetpipe 1 VW x 2 stages, Nm 8 | failed: E: boom | - | - | - | - | - |"


def test_window_rate_counts_minibatches_while_every_vw_runs_and_refuses_vws_that_never_overlapped():
    # VW 0 ends minibatches at 1..6 s, VW 1 at 2..7 s; warm-up 2: from 3 s (VW 1's 2nd) to 6 s (VW 0's last)
    streams = {0: [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 1: [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]}
    assert gpu.throughput.window_rate(streams, batch=10, warmup=2) == (3 + 3) * 10 / 3
    # per-VW work: VW 0 at batch 10 with a warm-up of 1, VW 1 at batch 30 with 3: from 4 s to 6 s
    assert (
        gpu.throughput.window_rate(streams, batch={0: 10, 1: 30}, warmup={0: 1, 1: 3})
        == (2 * 10 + 2 * 30) / 2
    )
    with pytest.raises(HetpipeError, match="never ran together"):
        gpu.throughput.window_rate({0: [1.0, 2.0, 3.0, 4.0], 1: [5.0, 6.0, 7.0, 8.0]}, batch=10, warmup=2)


def test_hetpipe_warm_up_leaves_out_the_stall_at_the_first_gate_so_the_window_holds_the_steady_rate():
    # D = 0, Nm 1, batch 10. VW 1 starts late (a slow link's registration): its waves end every 2 s from 12 s
    # and each push arrives 3 s later. VW 0 runs its two ungated waves at once (1 s each), then wave c >= 2
    # waits for VW 1's push of wave c - 2: it ends at 16, 18, ... Both then run a wave per 2 s: 10 samples/s.
    slow = [12.0, 14.0, 16.0, 18.0, 20.0, 22.0]
    fast = [1.0, 2.0]
    for c in range(2, 7):
        fast.append(max(fast[-1], slow[c - 2] + 3.0) + 1.0)
    assert fast == [1.0, 2.0, 16.0, 18.0, 20.0, 22.0, 24.0]
    streams = {0: fast, 1: slow}
    warmup = gpu.throughput.warmup_waves(0, 2)
    assert warmup == 2
    assert gpu.throughput.window_rate(streams, batch=10, warmup=warmup) == 10.0
    assert gpu.throughput.window_rate(streams, batch=10, warmup=1) == 9.0  # the stall counted as rate
    # the gate lets D + 2 waves run free at any D; one VW has no gate: its first wave fills the pipeline
    assert gpu.throughput.warmup_waves(1, 4) == 3
    assert gpu.throughput.warmup_waves(3, 1) == 1


def test_a_planned_setup_prints_its_prediction_and_each_bound_the_planner_names():
    setup = gpu.throughput.HetpipeSetup(
        ((("n0:0",), (10,)), (("n1:0", "n1:1"), (5, 5))),
        4,
        1,
        "planner: dp",
        1470.4,
        bounds=("idle GPUs (24% of capacity): 2 of 6 left out", "a link between GPUs: 24% transfers"),
    )
    assert setup.describe("hetpipe").splitlines() == [
        "hetpipe: 2 VWs n0:0 10 | n1:0-n1:1 5/5, Nm=4, D=1 (planner: dp, predicted 1470 samples/s)",
        "  bound: idle GPUs (24% of capacity): 2 of 6 left out",
        "  bound: a link between GPUs: 24% transfers",
    ]
    assert gpu.throughput.HetpipeSetup(setup.vws, 4, 0, "config", None).describe("hetpipe") == (
        "hetpipe: 2 VWs n0:0 10 | n1:0-n1:1 5/5, Nm=4, D=0 (config)"
    )


def test_host_time_gives_a_plain_and_a_stage_row(tmp_path: Path):
    import host_time

    out = tmp_path / "host.json"
    result = CliRunner().invoke(
        host_time.main, ["--device", "cpu", "--quick", "--steps", "12", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    for name in ("plain", "stage"):
        assert rows[name]["wall_ms"] > 0 and all(rows[name][f"{k}_ms"] > 0 for k in "FBU")
    assert rows["stage"]["PUSH_ms"] > 0 and "PUSH_ms" not in rows["plain"]
    assert (rows["model"], rows["schedule"], rows["device"]) == ("char-gpt", "wsp", "cpu")


def test_runs_go_round_by_round_so_drift_reaches_the_plain_loop_and_every_system_alike():
    assert gpu.run_order(2, 3) == [(-1, 0), (0, 0), (1, 0), (-1, 1), (0, 1), (1, 1), (-1, 2), (0, 2), (1, 2)]
    assert gpu.run_order(0, 2) == [(-1, 0), (-1, 1)]


def test_run_setting_interleaves_its_runs_takes_medians_and_stops_a_failed_system(
    monkeypatch, tmp_path: Path
):
    calls: list[str] = []
    rates = iter(
        [100.0, 90.0, 120.0, 99.0, 80.0, 95.0]
    )  # plain, 1x1, plain, 1x1, plain, 1x1 (2x1 fails at once)

    def plain(config, device, steps, warmup, profiled=0):
        calls.append("plain")
        return {"samples_per_s": next(rates), "loss_tail": 1.0, "host_ms": 1.0}

    def hetpipe(config, run_dir):
        calls.append(run_dir.name)
        if config == (2, 1, 4, 1, "wsp"):
            raise HetpipeError("out of memory")
        return {
            "samples_per_s": next(rates),
            "loss_tail": 1.0,
            "host_ms": 1.0,
            "tail_s": 1.0,
            "wave_breakdown_ms": {},
        }

    monkeypatch.setattr(gpu, "run_plain", plain)
    monkeypatch.setattr(gpu, "run_hetpipe", hetpipe)
    monkeypatch.setattr(
        gpu.Setting, "config", lambda self, *shape: shape[:5]
    )  # (vws, stages, nm, D, schedule)
    setting = gpu.Setting("char-gpt", {}, ("shakespeare", {}), "fp32", "cpu", "cpu", 64, 24, 16.0, tmp_path)
    rows: list[dict] = []
    gpu.run_setting(
        setting, [("hetpipe", 1, 1, 4, 0, "wsp", ()), ("hetpipe", 2, 1, 4, 1, "wsp", ())], 3, 2, rows.append
    )
    one, two = "char-gpt-fp32-1x1-nm4-d0-wsp", "char-gpt-fp32-2x1-nm4-d1-wsp"
    assert calls == ["plain", f"{one}-0", f"{two}-0", "plain", f"{one}-1", "plain", f"{one}-2"]
    assert [(r["system"], r.get("samples_per_s"), r.get("samples_per_s_runs")) for r in rows] == [
        ("plain", 100.0, [100.0, 120.0, 80.0]),
        ("hetpipe", 95.0, [90.0, 99.0, 95.0]),
        ("hetpipe", None, None),
    ]
    assert rows[1]["ratio_to_plain"] == 0.95 and rows[2]["error"] == "HetpipeError: out of memory"
    assert rows[1]["ratio_by_round"] == [
        0.9,
        0.825,
        1.188,
    ]  # 90/100, 99/120, 95/80: each round's own plain run
    assert rows[2]["error"] == "HetpipeError: out of memory"


def test_a_system_with_settings_runs_beside_the_same_system_without_them(tmp_path: Path):
    out = tmp_path / "gpu.json"
    result = CliRunner().invoke(
        gpu.main,
        [
            "--device",
            "cpu",
            "--quick",
            "--model",
            "char-gpt",
            "--precision",
            "fp32",
            "--repeats",
            "1",
            "--minibatches",
            "16",
            "--warmup",
            "2",
            "--system",
            "1x1:4",
            "--system",
            "1x1:4+ps.wire_dtype=bfloat16",
            "--system",
            "1x1:4+ps.no_such_key=1",
            "--keep",
            str(tmp_path / "runs"),
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 1, result.output  # the bad setting's row is an error; the others ran
    rows = json.loads(out.read_text())
    assert [r.get("settings") for r in rows] == [None, None, ["ps.wire_dtype=bfloat16"], ["ps.no_such_key=1"]]
    assert rows[1]["samples_per_s"] > 0 and rows[2]["samples_per_s"] > 0 and "no_such_key" in rows[3]["error"]
    assert gpu.system_label(rows[2]) == "hetpipe 1 VW x 1 stage, Nm 4, ps.wire_dtype=bfloat16"
    config = (
        tmp_path / "runs" / "char-gpt-fp32-1x1-nm4-d0-wsp+ps.wire_dtype=bfloat16-0" / "config.toml"
    ).read_text()
    assert 'wire_dtype = "bfloat16"' in config


def test_profile_adds_untimed_profiled_runs_and_a_table_of_them(monkeypatch, tmp_path: Path):
    profiled: list[tuple[str, object]] = []
    summary = {
        "wall_ms": 20.0,
        "ops_host_ms": 12.5,
        "ops_device_ms": None,
        "aten_calls": 900.0,
        "by_host": [{"name": "aten::mm", "self_host_ms": 3.25}, {"name": "aten::add_", "self_host_ms": 1.0}],
    }

    def plain(config, device, steps, warmup, profiled_steps=0):
        profiled.append(("plain", profiled_steps))
        row = {"samples_per_s": 100.0, "loss_tail": 1.0, "host_ms": 1.0}
        return {**row, "profile": summary} if profiled_steps else row

    def hetpipe(config, run_dir, profile=None):
        profiled.append((run_dir.name, profile))
        row = {
            "samples_per_s": 90.0,
            "loss_tail": 1.0,
            "host_ms": 1.0,
            "tail_s": 1.0,
            "wave_breakdown_ms": {},
        }
        return {**row, "profile": summary} if profile else row

    monkeypatch.setattr(gpu, "run_plain", plain)
    monkeypatch.setattr(gpu, "run_hetpipe", hetpipe)
    monkeypatch.setattr(gpu.Setting, "config", lambda self, *shape: shape[:5])
    setting = gpu.Setting("char-gpt", {}, ("shakespeare", {}), "fp32", "cpu", "cpu", 64, 24, 16.0, tmp_path)
    rows: list[dict] = []
    window = gpu.ProfileWindow(8, 4)
    gpu.run_setting(setting, [("hetpipe", 1, 1, 4, 0, "wsp", ())], 2, 2, rows.append, window)
    one = "char-gpt-fp32-1x1-nm4-d0-wsp"
    # the plain loop profiles after the timed steps of its last run; the system runs once more, profiled
    assert profiled == [
        ("plain", 0),
        (f"{one}-0", None),
        ("plain", 4),
        (f"{one}-1", None),
        (f"{one}-profile", window),
    ]
    assert [r["profile"] for r in rows] == [summary, summary] and rows[1]["samples_per_s"] == 90.0
    table = gpu.markdown(rows).splitlines()
    assert table[-1] == (
        "| char-gpt | fp32 | hetpipe 1 VW x 1 stage, Nm 4 | 20.00 | 12.50 | - | 900 "
        "| aten::mm 3.25, aten::add_ 1.00 |"
    )


def test_profile_on_the_cpu_writes_each_rows_op_profile(tmp_path: Path):
    out = tmp_path / "gpu.json"
    args = [
        "--device",
        "cpu",
        "--quick",
        "--model",
        "char-gpt",
        "--precision",
        "fp32",
        "--repeats",
        "1",
        "--minibatches",
        "8",
        "--warmup",
        "2",
        "--system",
        "1x1:2",
        "--out",
        str(out),
    ]
    refused = CliRunner().invoke(gpu.main, [*args, "--profile", "6:4"])
    assert refused.exit_code == 2 and "ends at minibatch 9, past the runs' 8" in refused.output
    result = CliRunner().invoke(gpu.main, [*args, "--profile", "2:4"])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    for row in rows:
        assert row["profile"]["aten_calls"] > 0 and row["profile"]["by_host"], row["system"]
    assert rows[0]["profile"]["minibatches"] == 4 and rows[1]["profile"]["window"][0] == 2


def test_a_setup_of_unequal_work_runs_each_vw_at_its_own_nm_and_batch():
    setup = gpu.throughput.HetpipeSetup(
        ((("n0:0",), (6,)), (("n1:0", "n1:1"), (3, 3))), 2, 0, "planner", None, work=((2, 16), (5, 32))
    )
    assert [(lay.nm, lay.batch) for lay in setup.layouts] == [(2, 16), (5, 32)]
    assert setup.samples_per_wave(16) == 2 * 16 + 5 * 32
    assert "Nm 5 x 32" in setup.label and "Nm=" not in setup.label
    same = gpu.throughput.HetpipeSetup(((("n0:0",), (6,)), (("n1:0",), (6,))), 4, 0, "config", None)
    assert same.samples_per_wave(16) == 2 * 4 * 16 and [lay.nm for lay in same.layouts] == [0, 0]

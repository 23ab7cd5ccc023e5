"""hetpipe/core/planning/convergence.py: settings, their canonical forms, the calibration file, the fitted
model, and the planner's hook (candidates ranked by predicted time to target, both factors explained)."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from pathlib import Path

import pytest
from test_planner import SMALL_TOML, hetpipe, small

from hetpipe.app.plan_convergence import CALIBRATION_DIR
from hetpipe.core.errors import UsageError
from hetpipe.core.planning.convergence import (
    DEFAULT_CONTROLS,
    Calibration,
    Measurement,
    Setting,
    _least_squares,
    attach_samples,
    calibration_name,
    canonical,
    controls_of,
    features,
    find_calibration,
    fit_model,
    lr_of,
    median_samples,
    parse_setting,
    rules_of,
    samples_to_target,
    setting_of,
)
from hetpipe.core.planning.planner import (
    ALLREDUCE,
    SYNC_PIPELINE,
    best,
    explain,
    format_table,
    plan_candidates,
)


def test_settings_parse_in_any_order_and_print_back() -> None:
    s = parse_setting("2x4/3:mean:D1:spectrain+warmup:1f1b-flush")
    assert s == Setting(2, 4, 3, "1f1b-flush", "mean", ("spectrain", "warmup"), 1)
    assert s.label == "2x4/3:1f1b-flush:mean:spectrain+warmup:D1" and parse_setting(s.label) == s
    assert parse_setting("1x2/1", Setting(9, 9, 9, "gpipe", "server", (), 2)) == Setting(
        1, 2, 1, "gpipe", "server", (), 2
    )


@pytest.mark.parametrize("text", ["2x4", "0x1/1", "2x4/3:fast", "2x4/3:D-1"])
def test_bad_settings_say_the_form(text: str) -> None:
    with pytest.raises(UsageError, match="VWSxNM/STAGES|no schedule"):
        parse_setting(text)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("1x1/4:pipedream-2bw:mean:spectrain:D3", "1x1/1"),  # sequential whatever else is said
        (
            "1x1/4:wsp:server:D1",
            "1x1/1:1f1b-flush:server:D1",
        ),  # but not with the PS's optimizer: D + 1 waves late
        ("2x4/3:gpipe:mean", "2x4/1:1f1b-flush:mean"),  # gpipe is 1f1b-flush; flushes ignore the stage count
        ("2x4/3:1f1b-flush:sum:spectrain+warmup", "2x4/1:1f1b-flush:sum:warmup"),  # no local lag to predict
        ("2x4/3:wsp:server:D1", "2x4/1:1f1b-flush:server:D1"),  # server: weights move only at pulls
        ("1x4/3:wsp:mean:average+warmup:D2", "1x4/3:wsp:sum"),  # one local VW never pulls
        ("1x8/3:pipedream:spectrain", "1x3/3:wsp:spectrain"),  # one VW: pipedream is wsp at the pipe's depth
        ("1x8/1:pipedream:mean:D2", "1x1/1"),  # so one stage of it is sequential training
        ("2x1/1:pipedream:sum", "2x1/1:wsp:sum"),  # pipedream no deeper than its pipe is wsp, any VWs
        ("3x2/3:pipedream:mean:pipemare:D1", "3x2/3:wsp:mean:pipemare:D1"),
        ("2x1/3:gpipe:mean:warmup", "2x1/1:wsp:mean:warmup"),  # at Nm 1 nothing is in flight across an update
        ("2x1/2:1f1b-flush:sum:none:D1", "2x1/1:pipedream:sum:none:D1"),
    ],
)
def test_canonical_forms_train_the_same_weights(a: str, b: str) -> None:
    assert canonical(parse_setting(a)) == canonical(parse_setting(b))


def test_wsp_keeps_its_stage_count_and_mitigations() -> None:
    s = parse_setting("2x4/3:wsp:sum:spectrain")
    assert canonical(s) == s
    for kept in (
        "2x8/3:pipedream:sum",
        "1x8/3:pipedream:sum:pipemare",
    ):  # pulls, or a warm-up counted in waves
        assert canonical(parse_setting(kept)) == parse_setting(kept)
    # at Nm 1, not claimed with spectrain (its prediction) nor with server (the PS steps; flush is its form)
    assert canonical(parse_setting("2x1/3:wsp:sum:spectrain")) == parse_setting("2x1/3:wsp:sum:spectrain")
    assert canonical(parse_setting("2x1/3:wsp:server")) == parse_setting("2x1/1:1f1b-flush:server")


def test_pipedream_lags_by_the_pipes_depth_not_the_wave() -> None:
    assert features(parse_setting("2x8/3:wsp"))["local_lag"] == 7
    assert features(parse_setting("2x8/3:pipedream"))["local_lag"] == 2
    assert features(parse_setting("2x2/3:pipedream"))["local_lag"] == 1
    assert (
        features(parse_setting("2x8/3:pipedream"))["global_lag"]
        == features(parse_setting("2x8/3:wsp"))["global_lag"]
    )
    assert canonical(parse_setting("1x1/1:wsp:server")) != canonical(parse_setting("1x1/1"))


def test_median_counts_a_seed_that_never_got_there_as_infinite() -> None:
    assert median_samples([10, None, 30]) == 30 and median_samples([10, 20, 30]) == 20
    assert median_samples([10, None, None]) is None and median_samples([]) is None


def calibration(points: dict[str, float | None], seq: float = 1000.0, **kw) -> Calibration:
    rows = [Measurement(Setting(1, 1, 1), (seq,) * 3, budget=100_000, lr=0.01)]
    rows += [
        Measurement(parse_setting(k), (v,) * 3, budget=100_000, lr=0.02, sweep=((0.01, None), (0.02, v)))
        for k, v in points.items()
    ]
    return Calibration(
        "toy", "x", 4, "momentum", (0.01, 0.02), "test_accuracy", 0.9, (0, 1, 2), tuple(rows), **kw
    )


def test_calibration_round_trips_and_is_found_by_name(tmp_path: Path) -> None:
    cal = calibration({"2x4/3:wsp:sum": 2500.0, "2x4/3:1f1b-flush:mean": None}, notes=("n",))
    assert Calibration.from_json(cal.to_json()) == cal
    (tmp_path / "toy-x-b4-momentum.json").write_text(cal.to_json())
    found, note = find_calibration(tmp_path, "toy", "x", 4, "momentum")
    assert found == cal and "each at its best lr of 0.01, 0.02" in note
    assert (
        lr_of(cal, parse_setting("2x4/3:wsp:sum")) == 0.02
        and lr_of(cal, parse_setting("1x1/3:gpipe")) == 0.01
    )
    assert lr_of(cal, parse_setting("3x4/3:wsp:sum")) is None
    assert rules_of(cal) == [
        ("wsp", "sum", ()),
        ("1f1b-flush", "mean", ()),
    ]  # every rule measured, in file order
    one_vw = calibration({"1x2/1:gpipe": 1200.0, "2x4/3:wsp:sum": 2500.0})
    assert rules_of(one_vw) == [("wsp", "sum", ()), ("gpipe", "sum", ())]  # a rule measured on one VW counts
    found, note = find_calibration(tmp_path, "toy", "x", 8, "momentum")
    assert found is None and "how to measure one" in note


def test_a_calibration_to_another_target_is_found_by_its_target(tmp_path: Path) -> None:
    default = calibration({"2x4/3:wsp:sum": 2500.0})
    other = dataclasses.replace(calibration({"2x4/3:wsp:sum": 4000.0}), target=0.95)
    (tmp_path / calibration_name("toy", "x", 4, "momentum")).write_text(default.to_json())
    (tmp_path / calibration_name("toy", "x", 4, "momentum", 0.95)).write_text(other.to_json())
    assert calibration_name("toy", "x", 4, "momentum", 0.95) == "toy-x-b4-momentum-to0.95.json"
    assert find_calibration(tmp_path, "toy", "x", 4, "momentum")[0] == default  # no target: the default file
    assert find_calibration(tmp_path, "toy", "x", 4, "momentum", 0.95)[0] == other
    assert (
        find_calibration(tmp_path, "toy", "x", 4, "momentum", 0.9)[0] == default
    )  # the default file is at 0.9
    found, note = find_calibration(tmp_path, "toy", "x", 4, "momentum", 0.99)
    assert found is None and "to target 0.99" in note and "there is one to test_accuracy 0.9" in note


def test_fit_recovers_a_model_the_points_follow_exactly() -> None:
    truth = {"log_batch": 0.3, "local_lag": 0.1, "global_lag": 0.02, "sum_overshoot": 0.5}
    labels = [
        "1x2/1:1f1b-flush",
        "1x8/1:1f1b-flush",
        "1x4/3:wsp",
        "1x8/3:wsp",
        "2x4/3:wsp:sum",
        "2x2/3:wsp:mean",
        "2x4/3:1f1b-flush:mean",
        "3x4/3:1f1b-flush:sum",
        "2x8/3:wsp:mean",
    ]
    points = {
        k: 1000.0 * math.exp(sum(truth[f] * x for f, x in features(canonical(parse_setting(k))).items()))
        for k in labels
    }
    model = fit_model(calibration(points))
    assert model is not None and model.points == len(labels)
    assert model.fit_error < 1e-3 and model.rms_log < 1e-4
    for key, value in truth.items():
        assert model.coefficients[key] == pytest.approx(value, abs=1e-3)


def test_staleness_never_saves_samples_in_the_fit() -> None:
    # noisy medians where more global lag needed fewer samples (two VWs' averaged updates at Nm 2 under the
    # sequential run): plain least squares gives global_lag a negative sign, and the planner would follow it
    # to the stalest plan it is let to price
    points = {
        "1x2/1:1f1b-flush": 1200.0,
        "1x4/1:1f1b-flush": 1600.0,
        "2x1/1:wsp:mean": 1100.0,
        "2x2/1:pipedream:mean": 900.0,
    }
    pairs = [(canonical(parse_setting(k)), math.log(v / 1000.0)) for k, v in points.items()]
    assert _least_squares(pairs, ["log_batch", "global_lag"])["global_lag"] < 0.0  # what the data alone says
    model = fit_model(calibration(points))
    assert model is not None and model.coefficients["global_lag"] == 0.0
    assert model.coefficients["log_batch"] > 0.0
    # a setting with more global lag is priced by its batch alone, never below one with less
    three = parse_setting("3x1/1:wsp:mean")  # global lag 3, batch per update 3
    assert model.factor(three) == pytest.approx(math.exp(model.coefficients["log_batch"] * math.log2(3)))
    assert model.factor(three) >= model.factor(parse_setting("1x3/1:1f1b-flush"))


def test_samples_come_measured_where_the_setting_was_measured_and_fitted_elsewhere() -> None:
    cal = calibration(
        {
            "1x2/1:1f1b-flush": 1200.0,
            "1x4/1:1f1b-flush": 1600.0,
            "1x8/1:1f1b-flush": 2400.0,
            "2x4/3:wsp:sum": 5000.0,
            "2x2/3:wsp:sum": 3000.0,
            "2x4/3:wsp:sum:spectrain": 2500.0,
            "2x2/3:1f1b-flush:mean": None,
        }
    )
    assert samples_to_target(cal, parse_setting("2x4/3:wsp:sum")) == (5000.0, "measured at lr 0.02")
    assert samples_to_target(cal, parse_setting("2x2/1:gpipe:mean")) == (None, "measured: not reached")
    value, source = samples_to_target(cal, parse_setting("1x6/1:1f1b-flush"))
    assert source == "fitted" and 1600.0 < value < 2400.0  # larger batches cost more samples
    value, source = samples_to_target(cal, parse_setting("2x4/3:wsp:sum:spectrain"))
    assert (value, source) == (2500.0, "measured at lr 0.02")
    value, source = samples_to_target(cal, parse_setting("2x3/3:wsp:sum:spectrain"))
    assert source.startswith("fitted x spectrain ratio of 1 pair")
    plain, _ = samples_to_target(cal, parse_setting("2x3/3:wsp:sum"))
    assert value == pytest.approx(plain * 0.5)
    assert samples_to_target(cal, parse_setting("2x8/3:wsp:sum:pipemare"))[0] is None  # never measured


def test_a_fit_prices_only_the_features_it_has_seen() -> None:
    # only larger batches were calibrated: the fit knows log_batch and nothing of staleness
    cal = calibration({"1x2/1:1f1b-flush": 1200.0, "1x4/1:1f1b-flush": 1600.0, "1x8/1:1f1b-flush": 2400.0})
    model = fit_model(cal)
    assert model is not None and set(model.coefficients) == {"log_batch"}
    value, source = samples_to_target(cal, parse_setting("1x6/1:1f1b-flush"))
    assert source == "fitted" and 1600.0 < value < 2400.0
    # beyond the batches calibrated, an exponential fit runs away: unknown, saying how far
    value, source = samples_to_target(cal, parse_setting("1x16/1:1f1b-flush"))
    assert value is None and "log_batch 4 (calibrated up to 3)" in source
    # wsp at Nm 3 updates every minibatch (log_batch 0): a factor would say "sequential", so it is unknown
    # instead
    assert model.unseen(parse_setting("2x3/3:wsp:sum")) == ["local_lag", "global_lag", "sum_overshoot"]
    value, source = samples_to_target(cal, parse_setting("2x3/3:wsp:sum"))
    assert value is None and source.startswith("unknown: the fit has not seen local_lag, global_lag")
    assert samples_to_target(cal, parse_setting("1x3/3:wsp"))[0] is None


def test_planner_ranks_by_time_to_target_and_explains_both_factors() -> None:
    config, profiles = small()
    found = plan_candidates(config, profiles, ps_gbps=10.0, d_values=(0, 2))
    fastest = best(found)
    assert fastest.samples_to_target is None and "samples to target" not in format_table(found)
    # a calibration in which D = 2 costs ten times the samples of D = 0, and the sequential pipeline is cheap
    points = {
        setting_of(c, "sum", ()).label: (1000.0 if c.staleness == 2 else 100.0)
        for c in found
        if c.plan is not None
    }
    points["1x4/1:1f1b-flush"] = 150.0
    ranked = attach_samples(found, calibration(points, seq=100.0), "sum", ())
    top = best(ranked)
    assert top.staleness == 0 and top.time_to_target_s == pytest.approx(100.0 / top.samples_per_s)
    assert min(c.time_to_target_s for c in ranked if c.runnable) == top.time_to_target_s
    baseline = {c.policy: c for c in ranked}
    assert setting_of(baseline[ALLREDUCE], "sum", ()) == Setting(
        1, baseline[ALLREDUCE].gpus_used, 1, "1f1b-flush"
    )
    assert baseline[SYNC_PIPELINE].samples_to_target == 100.0  # sequential training
    text = explain(ranked)
    assert "samples to target ->" in text and "s predicted" in text
    assert "samples to target" in format_table(ranked) and "s to target" in format_table(ranked)
    assert attach_samples(found, None, "sum", ()) == found


def test_a_time_to_target_search_offers_fewer_vws_and_smaller_nm_and_can_pick_them() -> None:
    config, profiles = small()
    pipelines = [
        "np",
        "ed",
        "hd",
    ]  # (dp's one-GPU VWs under pipedream train sequentially: priced in both searches)
    plain = [
        c
        for c in plan_candidates(config, profiles, ps_gbps=10.0, d_values=(0,), policies=pipelines)
        if c.runnable
    ]
    wide = [
        c
        for c in plan_candidates(
            config, profiles, ps_gbps=10.0, d_values=(0,), slower_but_fewer=True, policies=pipelines
        )
        if c.runnable
    ]
    shape = lambda c: (  # noqa: E731
        c.policy,
        c.schedule,
        c.nm,
        tuple((tuple(vw.gpus), vw.nm, vw.batch_size) for vw in c.plan.vws),
    )
    assert {shape(c) for c in plain} < {shape(c) for c in wide}  # everything the plain search has, and more
    assert len({shape(c) for c in wide}) == len(wide)  # each distinct set of VWs once
    assert min(len(c.plan.vws) for c in wide) == 1 == min(len(c.plan.vws) for c in plain)  # fewer VWs: both
    assert min(c.nm for c in wide) == 1 < min(c.nm for c in plain)  # a smaller Nm: the time-to-target search
    # a calibration that knows only sequential training prices only one VW at Nm 1, and the best is one
    cal = calibration({})
    assert best(attach_samples(plain, cal, "sum", ())).time_to_target_s is None  # nothing plain is priced
    top = best(attach_samples(wide, cal, "sum", ()))
    assert len(top.plan.vws) == 1 and top.nm == 1 and top.time_to_target_s is not None


def test_a_search_over_rules_takes_the_rule_whose_best_plan_reaches_the_target_soonest() -> None:
    from hetpipe.app.plan_convergence import plan_over_rules, rule_of, rule_variants

    config, profiles = small()
    found = [c for c in plan_candidates(config, profiles, ps_gbps=10.0, d_values=(0,)) if c.plan is not None]
    # every plan needs 10x fewer samples under mean than under sum; pipemare with server is a rule no config
    # can run
    points = {setting_of(c, "sum", ()).label: 1000.0 for c in found}
    points |= {setting_of(c, "mean", ()).label: 100.0 for c in found}
    points["2x4/3:wsp:server:pipemare"] = 50.0
    cal = calibration(points, seq=500.0)
    assert [rule_of(v) for v in rule_variants(config, cal)] == [
        "aggregation sum, mitigation none",
        "aggregation mean, mitigation none",
    ]

    def plan(variant):
        return plan_candidates(variant, profiles, ps_gbps=10.0, d_values=(0,))

    candidates, chosen, tried = plan_over_rules(config, cal, plan, best)
    top = best(candidates)
    assert tried == 2 and chosen.ps.aggregation == "mean" and top.plan.aggregation == "mean"
    assert top.samples_to_target == 100.0 and top.plan.mitigation == "none"
    # without the search: the config's rule, still ranked by time to target (sum's plans 1000, sequential 500)
    candidates, chosen, tried = plan_over_rules(config, cal, plan, best, search=False)
    top = best(candidates)
    assert tried == 1 and chosen is config and top.plan.aggregation == "sum"
    assert top.samples_to_target in (500.0, 1000.0) and top.time_to_target_s is not None
    # without a calibration nothing is priced, and the config's rule is kept
    candidates, chosen, tried = plan_over_rules(config, None, plan, best)
    assert chosen is config and best(candidates).time_to_target_s is None


def test_a_candidate_that_never_reached_the_target_ranks_after_every_timed_one() -> None:
    config, profiles = small()
    found = [c for c in plan_candidates(config, profiles, ps_gbps=10.0, d_values=(0,)) if c.plan is not None]
    fastest = best(found)
    points = {setting_of(c, "sum", ()).label: (None if c is fastest else 500.0) for c in found}
    ranked = attach_samples(found, calibration(points), "sum", ())
    top = best(ranked)
    assert top.time_to_target_s is not None and dataclasses.replace(top, samples_to_target=None) != fastest


def test_a_search_over_batches_takes_the_batch_whose_best_plan_reaches_the_target_soonest() -> None:
    from types import SimpleNamespace

    from hetpipe.app.plan_convergence import batch_note, plan_over_batches, soonest_batch

    config, _ = small()
    times = {4: 30.0, 16: 20.0, 32: None}  # batch 32: no calibration prices its plans
    seen = []

    def at_batch(variant):
        seen.append(variant.train.batch_size)
        return [SimpleNamespace(time_to_target_s=times[variant.train.batch_size])], variant, 1

    candidates, chosen, tried, predicted = plan_over_batches(config, (4, 32, 16, 4), at_batch, lambda c: c[0])
    assert seen == [4, 32, 16] and predicted == {4: 30.0, 32: None, 16: 20.0}  # each batch once, in order
    assert chosen.train.batch_size == 16 and candidates[0].time_to_target_s == 20.0 and tried == 1
    assert config.train.batch_size == 4  # the config itself is left alone
    assert (
        soonest_batch({8: 20.0, 16: 20.0}) == 8 and soonest_batch({8: None}) is None
    )  # ties: the first listed
    note = batch_note(predicted, 16)
    assert note.startswith("batch per GPU: 16,") and "32 (not priced" in note and "16 (20.0 s)" in note
    # no batch priced: the first one's plans; no batches given: the config's
    times[16] = times[4] = None
    assert plan_over_batches(config, (16, 4), at_batch, lambda c: c[0])[1].train.batch_size == 16
    assert plan_over_batches(config, (), at_batch, lambda c: c[0])[1] is config


def test_cli_plan_over_batches_carries_the_batch_into_the_plan_file(tmp_path: Path) -> None:
    from hetpipe.app.train import apply_plan
    from hetpipe.core.config.files import load_config
    from hetpipe.core.planning.plan import Plan

    config = tmp_path / "small.toml"
    config.write_text(SMALL_TOML)  # batch 8, no calibration for its model
    out, profiles = tmp_path / "plan.json", str(tmp_path / "profiles")
    result = hetpipe(
        "plan", str(config), "--profile-dir", profiles, "--batch", "16", "--batch", "4", "--out", str(out)
    )
    assert result.returncode == 0, result.stderr
    assert "at batch 16," in result.stdout  # nothing priced: the first batch given
    assert "batch per GPU: 16, the soonest predicted time to target of 16 (not priced" in result.stdout
    assert Plan.from_json(out.read_text()).batch_size == 16 and "batch 16)" in result.stderr
    assert (
        apply_plan(load_config(config), out)[0].train.batch_size == 16
    )  # `hetpipe train --plan` trains at it
    result = hetpipe(
        "plan",
        str(config),
        "--profile-dir",
        profiles,
        "--batch",
        "16",
        "--batch",
        "4",
        "--calibration",
        str(tmp_path / "cal.json"),
    )
    assert result.returncode == 2 and "holds one batch's samples" in result.stderr


def test_cli_plan_ranks_by_a_calibration_file_and_refuses_a_bad_one(tmp_path: Path) -> None:
    config = tmp_path / "small.toml"
    config.write_text(SMALL_TOML)
    cal = tmp_path / "cal.json"
    cal.write_text(
        calibration(
            {
                "1x2/1:1f1b-flush": 1200.0,
                "1x4/1:1f1b-flush": 1600.0,
                "1x8/1:1f1b-flush": 2400.0,
                "2x2/2:wsp:sum": 3000.0,
                "1x2/2:wsp": 1500.0,
            }
        ).to_json()
    )
    result = hetpipe(
        "plan",
        str(config),
        "--profile-dir",
        str(tmp_path / "profiles"),
        "--explain",
        "--calibration",
        str(cal),
    )
    assert result.returncode == 0, result.stderr
    assert "note: convergence calibration" in result.stdout and "samples to target" in result.stdout
    assert "s predicted" in result.stdout and "(fitted)" in result.stdout
    result = hetpipe(
        "plan",
        str(config),
        "--profile-dir",
        str(tmp_path / "profiles"),
        "--calibration",
        str(cal),
        "--target",
        "0.95",
    )
    assert result.returncode == 2 and "give --calibration or --target, not both" in result.stderr
    cal.write_text("{}")
    result = hetpipe(
        "plan", str(config), "--profile-dir", str(tmp_path / "profiles"), "--calibration", str(cal)
    )
    assert (
        result.returncode == 2
        and "not a calibration file" in result.stderr
        and "Traceback" not in result.stderr
    )


@pytest.mark.parametrize("path", sorted(CALIBRATION_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_calibration_loads_is_named_for_its_model_and_says_how_it_was_measured(
    path: Path,
) -> None:
    cal = Calibration.load(path)
    named = (cal.model, cal.options_digest, cal.batch_size, cal.optimizer)
    assert path.name in (
        calibration_name(*named, None, cal.controls),
        calibration_name(*named, cal.target, cal.controls),
    )  # default, or to its target; measured with other trainer controls: named for them
    assert cal.sequential is not None and cal.sequential.median is not None  # the unit of every factor
    commands = cal.command.split("; ")
    assert all(c.startswith("python launch/bench/staleness.py ") and "--calibrate" in c for c in commands)
    assert all(f"--target {cal.target:g}" in c for c in commands)  # one target per file
    assert not any("/tmp" in c or "--out" in c for c in commands)  # reproducible from the repository alone
    for c in commands:  # each pastes back into a shell: every --set value one word, brackets whole
        words = shlex.split(c)
        values = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
        assert all(
            "=" in v and v.count("{") == v.count("}") and v.count("[") == v.count("]") for v in values
        ), c
    measured = {canonical(m.setting) for m in cal.measurements}
    assert len(measured) == len(cal.measurements)  # merges replace a setting, never list it twice
    assert all(set(m.samples) <= {None} or m.lr in cal.lrs for m in cal.measurements)


def _bench_mnist():
    """bench.toml with the mnist task's model, batch and optimizer: a shipped calibration's."""
    from hetpipe.core.config.files import load_config
    from hetpipe.core.config.overrides import apply_overrides

    mnist = [
        'model.name="mnist-cnn"',
        "model.options={ channels = [16, 32], hidden = 64 }",
        "train.batch_size=128",
        'train.optimizer="adam"',
    ]
    root = Path(__file__).resolve().parents[1]
    return apply_overrides(load_config(root / "launch" / "clusters" / "bench.toml"), mnist)


def test_fine_tuning_is_not_ranked_by_a_calibration_of_training_from_scratch() -> None:
    """The shipped calibrations measure training from scratch: a config that starts from `[model] init` finds
    none of them (and is told how to measure its own), the same config without it finds its model's."""
    from hetpipe.app.plan_convergence import plan_calibration
    from hetpipe.core.config.overrides import apply_overrides

    config = _bench_mnist()
    found, note = plan_calibration(config, target=0.97)
    assert found is not None and found.target == 0.97, note
    fine = apply_overrides(config, ['model.init="pretrained.pt"'])
    found, note = plan_calibration(fine, target=0.97)
    assert found is None and "fine-tuning" in note and "--calibration PATH" in note


def test_a_calibration_records_its_trainer_controls_and_the_planner_says_when_a_config_has_others() -> None:
    """Calibrations measured before the field existed (the shipped ones) read as constant lr, no clipping,
    cross-entropy. A config with a cosine schedule or clipping is told its samples were not measured so;
    merging calibrations of other controls is refused."""
    from hetpipe.app.plan_convergence import plan_calibration
    from hetpipe.core.config.overrides import apply_overrides

    old = json.loads(calibration({}).to_json())
    del old["controls"]
    assert Calibration.from_json(json.dumps(old)).controls == DEFAULT_CONTROLS
    clipped = calibration({}, controls=controls_of("cosine", 1.0, "cross_entropy"))
    assert Calibration.from_json(clipped.to_json()) == clipped
    assert calibration({}).controls_note(controls_of("constant", 0, "cross_entropy")) is None
    note = calibration({}).controls_note(controls_of("cosine", 1.0, "cross_entropy"))
    assert note.startswith(
        "the calibration measured lr_schedule constant, no clipping, loss cross_entropy; this config trains "
        "with lr_schedule cosine, clip_grad_norm 1, loss cross_entropy"
    )
    with pytest.raises(ValueError, match="lr_schedule cosine, clip_grad_norm 1"):
        calibration({}).merged(clipped)
    assert (
        calibration_name("toy", "x", 4, "adam", None, clipped.controls) == "toy-x-b4-adam-cosine-clip1.json"
    )
    odd = controls_of("constant", 0.0, "my.pkg:loss")
    assert calibration_name("toy", "x", 4, "adam", 0.9, odd) == "toy-x-b4-adam-to0.9-loss-my_pkg_loss.json"
    config = _bench_mnist()
    found, note = plan_calibration(config, target=0.97)
    assert found is not None and "this config trains with" not in note
    found, note = plan_calibration(apply_overrides(config, ["train.clip_grad_norm=0.5"]), target=0.97)
    assert found is not None and "this config trains with lr_schedule constant, clip_grad_norm 0.5" in note
    # clipping at 1.0, what launch/bench/trainer_controls.py found best with two VWs, is shipped measured
    found, note = plan_calibration(apply_overrides(config, ["train.clip_grad_norm=1.0"]), target=0.97)
    assert found is not None and found.controls == controls_of("constant", 1.0, "cross_entropy")
    assert "-to0.97-clip1.json" in note and "this config trains with" not in note


def test_a_calibration_measured_with_a_config_s_controls_is_found_before_the_one_without(
    tmp_path: Path,
) -> None:
    constant = calibration({"2x4/3:wsp:sum": 2500.0})
    cosine = calibration({"2x4/3:wsp:sum": 1800.0}, controls=controls_of("cosine", 0.0, "cross_entropy"))
    (tmp_path / calibration_name("toy", "x", 4, "momentum")).write_text(constant.to_json())
    wants = controls_of("cosine", 0.0, "cross_entropy")
    found, _ = find_calibration(tmp_path, "toy", "x", 4, "momentum", None, wants)
    assert found == constant and found.controls_note(wants)  # none of its own yet: the other, with a note
    (tmp_path / calibration_name("toy", "x", 4, "momentum", None, wants)).write_text(cosine.to_json())
    found, note = find_calibration(tmp_path, "toy", "x", 4, "momentum", None, wants)
    assert found == cosine and "toy-x-b4-momentum-cosine.json" in note and found.controls_note(wants) is None
    assert find_calibration(tmp_path, "toy", "x", 4, "momentum")[0] == constant  # a constant-lr config

"""hetpipe/core/pipeline/mitigation.py: names and their conflicts, lags read off the schedules, learning-rate
factors."""

from __future__ import annotations

import pytest

from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.errors import ConfigError, UsageError
from hetpipe.core.pipeline.mitigation import (
    format_mitigation,
    mitigation_conflicts,
    parse_mitigation,
    pipemare_lr_factor,
    stage_lags,
    warmup_lr_factor,
)
from hetpipe.core.pipeline.schedule import get_schedule

from conftest import write_config


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("none", ()),
        ("", ()),
        ("spectrain", ("spectrain",)),
        ("warmup+pipemare", ("pipemare", "warmup")),
        (" average + warmup ", ("average", "warmup")),
    ],
)
def test_names_parse_to_canonical_order_and_back(text: str, names: tuple[str, ...]) -> None:
    assert parse_mitigation(text) == names
    assert parse_mitigation(format_mitigation(names)) == names


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("spectran", 'did you mean "spectrain"'),
        ("none+warmup", '"none" stands alone'),
        ("warmup+warmup", "named twice"),
    ],
)
def test_bad_names_say_what_to_write(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_mitigation(text)


@pytest.mark.parametrize(
    ("names", "aggregation", "stashing", "weight_stashing", "fix"),
    [
        (("average",), "sum", "optional", True, 'aggregation = "mean"'),
        (("warmup",), "server", "optional", True, 'use aggregation "sum" or "mean"'),
        (("pipemare",), "server", "none", True, 'use aggregation "sum" or "mean"'),
        (("spectrain",), "sum", "optional", False, "weight_stashing = true"),
    ],
)
def test_conflicts_name_their_fix(names, aggregation, stashing, weight_stashing, fix) -> None:
    found = mitigation_conflicts(
        names, aggregation=aggregation, schedule_stashing=stashing, weight_stashing=weight_stashing
    )
    assert len(found) == 1 and fix in found[0][1]


def test_compatible_settings_have_no_conflicts() -> None:
    for names, aggregation, stashing, ws in [
        (("spectrain",), "server", "optional", False),
        (("average", "warmup"), "mean", "none", True),
        (("pipemare",), "sum", "optional", False),
    ]:
        assert (
            mitigation_conflicts(
                names, aggregation=aggregation, schedule_stashing=stashing, weight_stashing=ws
            )
            == []
        )


def test_config_reads_and_checks_the_mitigation(tmp_path) -> None:
    config = load_config(write_config(tmp_path, vws=[["n0:0"]], nm=2, staleness=0, waves=2))
    assert config.train.mitigation == "none" and config.train.mitigations == ()
    assert (
        apply_overrides(config, ['train.mitigation="warmup+spectrain"']).train.mitigation
        == "spectrain+warmup"
    )
    with pytest.raises(ConfigError, match=r'(?s)train.mitigation: "average" .* aggregation = "mean"'):
        apply_overrides(config, ['train.mitigation="average"'])
    with pytest.raises(ConfigError, match='did you mean "pipemare"'):
        apply_overrides(config, ['train.mitigation="pipemere"'])


# stage j of a wsp pipe at Nm 4 lags min(p, 3 - j) own updates (its warm-up forwards less one), of a pipedream
# pipe of 3 stages min(p, 2 - j) whatever the Nm; pipedream-2bw
# lags one update for the forwards that straddle a wave's update; the flushes lag none.
@pytest.mark.parametrize(
    ("schedule", "stage", "lags"),
    [
        ("wsp", 0, [0, 1, 2, 3, 3, 3, 3, 3]),
        ("wsp", 1, [0, 1, 2, 2, 2, 2, 2, 2]),
        ("wsp", 2, [0, 1, 1, 1, 1, 1, 1, 1]),
        ("pipedream", 0, [0, 1, 2, 2, 2, 2, 2, 2]),
        ("pipedream", 2, [0] * 8),
        ("pipedream-2bw", 0, [0, 0, 0, 0, 1, 1, 1, 0]),
        ("pipedream-2bw", 2, [0, 0, 0, 0, 1, 0, 0, 0]),
        ("1f1b-flush", 0, [0] * 8),
        ("gpipe", 1, [0] * 8),
    ],
)
def test_lags_count_the_updates_between_a_forward_and_its_own(
    schedule: str, stage: int, lags: list[int]
) -> None:
    found = stage_lags(get_schedule(schedule)(3, 4, 2, 0).stages[stage])
    assert [found[p].update for p in range(8)] == lags
    assert [
        found[p].backward for p in range(8)
    ] == lags  # every U between F p and B p comes before p's own U here


def test_pipemare_divides_by_the_delay_and_anneals_to_one() -> None:
    assert pipemare_lr_factor(3, 0, 10) == pytest.approx(1 / 4)
    assert pipemare_lr_factor(3, 5, 10) == pytest.approx(4**-0.5)
    assert pipemare_lr_factor(3, 10, 10) == 1.0 and pipemare_lr_factor(0, 0, 10) == 1.0
    assert pipemare_lr_factor(3, 0, 0) == 1.0  # no annealing window: no rescaling


def test_warmup_starts_at_one_share_per_vw_and_reaches_one() -> None:
    assert [warmup_lr_factor(w, 2, 4) for w in range(6)] == pytest.approx([0.5, 0.625, 0.75, 0.875, 1.0, 1.0])
    assert warmup_lr_factor(0, 1, 4) == 1.0 and warmup_lr_factor(0, 3, 0) == 1.0

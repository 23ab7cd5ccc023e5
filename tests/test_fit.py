"""Tests for hetpipe/core/planning/fit.py: every stage's memory against its GPU, and the message when one does
not fit."""

from __future__ import annotations

from hetpipe.core.planning.fit import changes_that_fit, common_changes, memory_error, stage_needs
from hetpipe.core.planning.memory import MemoryRule
from hetpipe.core.planning.profile import LayerProfile, ModelProfile

MIB = 2**20


def layer(name: str, param: int, output: int, saved: int, working: int) -> LayerProfile:
    return LayerProfile(
        name,
        0.0,
        0.0,
        param_bytes=param,
        optimizer_bytes=2 * param,
        output_bytes=output,
        saved_bytes=saved,
        working_bytes=working,
    )


SIZES = ModelProfile(
    "toy",
    8,
    "sizes",
    "float32",
    "x",
    input_bytes=100,
    layers=(
        layer("a", param=1000, output=10, saved=20, working=30),
        layer("b", param=2000, output=40, saved=50, working=60),
        layer("c", param=4000, output=70, saved=80, working=90),
    ),
)
MEMORY = {"n0:0": ("big", 10 * MIB), "n0:1": ("small", 10 * MIB), "n1:0": ("tiny", 1000)}


def test_stage_needs_follow_the_memory_model() -> None:
    rule = MemoryRule(nm=3, pulls=False)  # one VW of wsp with weight stashing, aggregation sum
    needs = stage_needs(SIZES, [(("n0:0", "n0:1"), (2, 1))], MEMORY, rule)
    first, second = needs
    # stage 0: layers a, b; 3 minibatches in flight on 3 stashed versions; a baseline and 2 update sums
    assert (first.vw, first.stage, first.gpu, first.gpu_type, first.first_layer, first.last_layer) == (
        0,
        0,
        "n0:0",
        "big",
        0,
        1,
    )
    # ... and its 3 outputs (backward roots) plus the output gradient it receives
    assert first.need.total == (
        3000 + 3000 + 6000 + 3 * 3000 + 3000 + 2 * 3000 + 3 * (20 + 50) + 3 * 100 + 3 * 40 + 40 + 60
    )
    # stage 1: layer c; 2 in flight; its input is layer b's output
    # (the last stage keeps no output; it holds nm + 1 = 4 input gradients sent back in the P2P window)
    assert (
        second.need.total == 4000 + 4000 + 8000 + 2 * 4000 + 4000 + 2 * 4000 + 2 * 80 + 2 * 40 + 4 * 40 + 90
    )
    assert second.available == 10 * MIB and all(n.fits for n in needs)
    assert memory_error(needs, model="toy", batch_size=8, rule=rule) is None


def test_without_stashing_no_stashed_copies() -> None:
    (need,) = stage_needs(
        SIZES, [(("n0:0",), (3,))], MEMORY, MemoryRule(nm=2, weight_stashing=False, pulls=False)
    )
    assert need.need.stashed == 0
    # the backward recomputes the forward: one minibatch's saved activations, every input kept
    assert need.need.total == 7000 + 7000 + 14000 + 7000 + 2 * 7000 + (20 + 50 + 80) + 2 * 100 + 90


def test_error_names_the_fullest_gpu_the_bytes_and_the_fix() -> None:
    layouts = [(("n0:0",), (3,)), (("n1:0", "n0:1"), (1, 2))]
    rule = MemoryRule(nm=2)
    needs = stage_needs(SIZES, layouts, MEMORY, rule)
    assert [n.fits for n in needs] == [True, False, True]
    message = memory_error(needs, model="toy", batch_size=8, rule=rule)
    need = needs[1].need.total
    assert message.startswith(
        f"stage 0 of virtual worker 1 on GPU n1:0 (tiny) needs {need:,} bytes ({need / 1024:.2f} KiB) "
        "for layer 0 of toy at batch 8 with nm=2, but the GPU has 1,000 bytes (1000 B): weights"
    )
    fix = message.splitlines()[1]
    assert fix.startswith(
        "  lower train.batch_size or wsp.nm (or set train.weight_stashing = false, or "
        'train.schedule = "1f1b-flush")'
    )
    assert "hetpipe plan CONFIG --out PLAN" in fix and "--plan PLAN" in fix


def test_error_counts_the_other_stages_that_do_not_fit() -> None:
    memory = {"n0:0": ("g", 10), "n0:1": ("g", 20), "n1:0": ("g", 5)}
    rule = MemoryRule(nm=1, weight_stashing=False)
    needs = stage_needs(SIZES, [(("n0:0", "n0:1", "n1:0"), (1, 1, 1))], memory, rule)
    message = memory_error(needs, model="toy", batch_size=8, rule=rule)
    assert "stage 2 of virtual worker 0 on GPU n1:0" in message  # the largest overcommit first
    assert "(2 more stages do not fit either)" in message
    assert "wsp.nm" not in message and "weight_stashing" not in message  # nm = 1: nothing to lower there


def _fits(sizes: ModelProfile, layout, memory, rule: MemoryRule) -> bool:
    return all(n.fits for n in stage_needs(sizes, [layout], memory, rule))


def test_changes_that_fit_are_the_largest_batch_and_nm_that_fit_and_each_switch_that_does() -> None:
    layout = (("n0:0",), (3,))
    rule = MemoryRule(nm=4)
    full = stage_needs(SIZES, [layout], MEMORY, rule)[0].need.total
    memory = {"n0:0": ("g", full - 200)}  # 200 bytes short at batch 8, nm 4
    found = changes_that_fit(SIZES, layout, memory, rule)
    batch, nm = found["batch_size"], found["nm"]
    assert 1 <= batch < 8 and 1 <= nm < 4
    # each answer fits, one more does not: the largest
    assert _fits(SIZES.at_batch(batch), layout, memory, rule)
    assert not _fits(SIZES.at_batch(batch + 1), layout, memory, rule)
    assert _fits(SIZES, layout, memory, MemoryRule(nm=nm))
    assert nm == 3 or not _fits(SIZES, layout, memory, MemoryRule(nm=nm + 1))
    # without stashing the 4 stashed versions go; so do they under the flushing schedule, which keeps no
    # versions: each alone frees more than the 200 B short. wsp does not allow recomputation: not offered
    assert found.get("weight_stashing") is False and found.get("schedule") == "1f1b-flush"
    assert "recompute" not in found
    # a flushing schedule may recompute: 3 stages at Nm 4, stage 0 keeps 3 minibatches' 20 B of saved
    # activations, 1 when it recomputes: 40 B less than the 10 B it is short
    flush, three = MemoryRule(nm=4, schedule="1f1b-flush"), (("n0:0", "n0:1", "n1:0"), (1, 1, 1))
    roomy = {gpu: ("g", 10 * MIB) for gpu in three[0]}
    need = stage_needs(SIZES, [three], roomy, flush)[0].need.total
    found = changes_that_fit(SIZES, three, {**roomy, "n0:0": ("g", need - 10)}, flush)
    assert found.get("recompute") is True and "schedule" not in found and "weight_stashing" not in found
    assert changes_that_fit(SIZES, layout, {"n0:0": ("g", full)}, rule) == {}  # fits already
    assert changes_that_fit(SIZES, layout, {"n0:0": ("g", 10)}, rule) == {}  # nothing alone fits


def test_the_error_names_the_changes_that_fit_as_toml_lines() -> None:
    layout = (("n0:0",), (3,))
    rule = MemoryRule(nm=4)
    needs = stage_needs(SIZES, [layout], {"n0:0": ("g", 1000)}, rule)
    fitting = {
        "batch_size": 3,
        "nm": 2,
        "recompute": True,
        "weight_stashing": False,
        "schedule": "1f1b-flush",
    }
    fix = memory_error(needs, model="toy", batch_size=8, rule=rule, fitting=fitting).splitlines()[1]
    assert fix.startswith(
        "  it fits with any one of: [train] batch_size = 3; [wsp] nm = 2; [train] recompute = true; "
        '[train] weight_stashing = false; [train] schedule = "1f1b-flush"; or give it more GPUs'
    )
    vw = "virtual_workers[1] "
    own = memory_error(needs, model="toy", batch_size=8, rule=rule, fitting=fitting, where=vw)
    assert f"any one of: {vw}batch_size = 3; {vw}nm = 2; [train] recompute = true" in own


def test_common_changes_fit_every_vw_that_shares_the_settings() -> None:
    a = {"batch_size": 24, "nm": 3, "recompute": True, "weight_stashing": False, "schedule": "1f1b-flush"}
    b = {"batch_size": 16, "nm": 2, "weight_stashing": False, "schedule": "1f1b-flush"}
    both = {"batch_size": 16, "nm": 2, "weight_stashing": False, "schedule": "1f1b-flush"}
    assert common_changes([a, b]) == both
    assert common_changes([a]) == a and common_changes([]) == {}
    assert common_changes([a, {}]) == {}  # a VW that no single change fits: none to offer

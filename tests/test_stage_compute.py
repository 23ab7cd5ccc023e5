"""StageCompute: retired stashed weight versions are reused for new versions without changing what any
forward or backward computes; the buffers a push carries are copies as of the push."""

from __future__ import annotations

import torch

from hetpipe.compute.stage_buffers import stage_buffers
from hetpipe.compute.stage_compute import StageCompute, StageRules
from hetpipe.core.pipeline.schedule import get_schedule
from hetpipe.models import build_stage, get_model

NM, WAVES = 4, 5


def train(reuse: bool) -> tuple[dict[str, torch.Tensor], set[int]]:
    """One stage on the wsp schedule at Nm 4: final weights and the storages its stashed copies used. Checks
    at every backward that the minibatch's stashed copy still holds the weights its forward saw."""
    torch.manual_seed(0)
    spec = get_model("mlp", hidden=[16, 8])
    compute = StageCompute(
        build_stage(spec, 0, spec.num_layers), "momentum", 0.05, 0.9, 0.0, StageRules(nm=NM)
    )
    if not reuse:
        compute._retire = lambda weights: None  # type: ignore[method-assign]
    seen_at_forward: dict[int, dict[str, torch.Tensor]] = {}
    storages: set[int] = set()
    gen = torch.Generator().manual_seed(1)
    data = {
        p: (torch.randn(8, 784, generator=gen), torch.randint(0, 10, (8,), generator=gen))
        for p in range(NM * WAVES)
    }
    for action in get_schedule("wsp")(1, NM, WAVES, 0).stages[0]:
        p = action.index
        if action.kind == "F":
            compute.forward(p, data[p][0], data[p][1], spec.loss, input_grad=False)
            stash = compute.in_flight[p].weights
            assert stash is not None
            storages.update(t.data_ptr() for t in stash.values())
            seen_at_forward[p] = {k: w.detach().clone() for k, w in compute.params.items()}
        elif action.kind == "B":
            stash = compute.in_flight[p].weights
            assert stash is not None
            assert all(torch.equal(stash[k], w) for k, w in seen_at_forward.pop(p).items()), p
            compute.backward(p, None, data[p][1], spec.loss)
        elif action.kind == "U":
            compute.update(p)
    return {k: w.detach().clone() for k, w in compute.params.items()}, storages


def test_retired_stashes_are_reused_and_change_nothing():
    reused, few = train(reuse=True)
    fresh, many = train(reuse=False)
    assert all(torch.equal(reused[k], fresh[k]) for k in fresh)
    per_copy = len(reused)
    # Nm versions in flight at most, plus the spare ones: the copies stop growing with the waves
    assert len(few) <= per_copy * (NM + 2) < len(many)


def test_push_copies_the_buffers_and_reads_them_where_they_are_now():
    """wave_push's buffers are float32 copies as of the push (a later forward moves the running statistics,
    not the push); the stage reads its buffers through slots found once, which follow an out-of-place
    replacement."""
    torch.manual_seed(0)
    spec = get_model("mnist-cnn", batch_norm=True)
    compute = StageCompute(build_stage(spec, 0, spec.num_layers), "sgd", 0.1, 0.0, 0.0, StageRules(nm=1))
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    live = stage_buffers(compute.module)
    assert {k: id(b) for k, b in compute.buffers().items()} == {k: id(b) for k, b in live.items()}
    assert any(not b.is_floating_point() for b in live.values())  # num_batches_tracked: converted, not cloned
    compute.forward(0, x, y, spec.loss, input_grad=False)
    compute.backward(0, None, y, spec.loss)
    compute.update(0)
    pushed = compute.wave_push(0)
    at_push = {k: b.float().clone() for k, b in live.items()}
    for key, b in live.items():
        assert pushed[key].dtype == torch.float32 and torch.equal(pushed[key], at_push[key])
        assert pushed[key].data_ptr() != b.data_ptr()
    compute.forward(1, x, y, spec.loss, input_grad=False)
    assert all(
        not torch.equal(b.float(), at_push[k]) for k, b in live.items()
    )  # the forward moved every buffer
    assert all(torch.equal(pushed[k], at_push[k]) for k in live)  # and none of the pushed ones
    pulled = {k: v + 1.0 for k, v in compute.values().items()}
    compute.rebase(pulled, own_through=0)
    now = stage_buffers(compute.module)
    assert {k: id(b) for k, b in compute.buffers().items()} == {k: id(b) for k, b in now.items()}
    assert all(now[k] is not live[k] and torch.equal(now[k].float(), pulled[k]) for k in live)
    uncopied = compute.wave_push(1, copy_buffers=False)  # CUDA staging copies them itself, in stream order
    assert all(uncopied[k] is b for k, b in compute.buffers().items())
    assert set(uncopied) == set(pushed)


def test_forwards_no_update_separates_from_their_backward_run_unstashed_to_the_same_weights():
    """StageRules.unstashed (hetpipe.core.pipeline.schedule.unstashed_forwards): those forwards keep no
    stashed copy and compute what they compute on one, bit for bit; the others still stash."""
    from hetpipe.core.pipeline.schedule import unstashed_forwards

    spec = get_model("mnist-cnn", batch_norm=True)
    gen = torch.Generator().manual_seed(2)
    data = {
        p: (torch.randn(4, 1, 28, 28, generator=gen), torch.randint(0, 10, (4,), generator=gen))
        for p in range(NM * 2)
    }
    for schedule in ("pipedream", "wsp"):
        actions = get_schedule(schedule)(1, NM, 2, 0).stages[0]
        results = []
        for unstashed in (frozenset(), unstashed_forwards(actions)):
            torch.manual_seed(0)
            compute = StageCompute(
                build_stage(spec, 0, spec.num_layers),
                "adam",
                1e-3,
                0.0,
                0.0,
                StageRules(nm=NM, unstashed=unstashed),
            )
            for action in actions:
                p = action.index
                if action.kind == "F":
                    compute.forward(p, data[p][0], data[p][1], spec.loss, input_grad=False)
                    assert (compute.in_flight[p].weights is None) == (p in unstashed)
                elif action.kind == "B":
                    compute.backward(p, None, data[p][1], spec.loss)
                elif action.kind == "U":
                    compute.update(p)
            results.append({k: t.detach().clone() for k, t in compute.values().items()})
        assert unstashed_forwards(actions) == (set(range(2 * NM)) if schedule == "pipedream" else {0})
        assert all(torch.equal(results[0][k], results[1][k]) for k in results[0]), schedule


def test_a_frozen_layers_optimizer_state_is_forgotten_from_its_freeze_wave() -> None:
    """[train] freeze = [[2, 2]] on an MLP stage: the momentum buffers of layers 0-1 stay through wave 1's
    updates (in-flight minibatches of wave 1 still step them) and are gone after the first update of wave 2;
    the trainable layers keep theirs."""
    from hetpipe.compute.optimizer_state import state_by_name
    from hetpipe.core.wsp.freezing import FreezeSchedule

    torch.manual_seed(0)
    spec = get_model("mlp", hidden=[16, 8])
    rules = StageRules(nm=NM, freeze=FreezeSchedule.at(((2, 2),)))
    compute = StageCompute(build_stage(spec, 0, spec.num_layers), "momentum", 0.05, 0.9, 0.0, rules)
    gen = torch.Generator().manual_seed(1)
    held: dict[int, set[str]] = {}
    for action in get_schedule("wsp")(1, NM, 4, 0).stages[0]:
        p = action.index
        if action.kind == "F":
            x, y = torch.randn(8, 784, generator=gen), torch.randint(0, 10, (8,), generator=gen)
            compute.forward(p, x, y, spec.loss, input_grad=False)
        elif action.kind == "B":
            compute.backward(p)
        elif action.kind == "U":
            compute.update(p)
            held[p] = set(state_by_name(compute.optimizer, list(compute.params)))
    frozen = {k for k in compute.params if k.split(".")[0] in ("0", "1")}
    assert frozen and all(frozen <= held[p] for p in held if p // NM < 2)
    assert all(not frozen & held[p] and held[p] for p in held if p // NM >= 2)

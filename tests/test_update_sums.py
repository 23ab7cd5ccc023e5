"""UpdateSums' sums of pushed waves kept in host memory (docs/memory.md#what-a-stage-keeps): which waves move,
and on CUDA (skipped without one) the same rebase bit for bit with less on the device."""

from __future__ import annotations

import pytest
import torch

from hetpipe.compute.update_sums import UpdateSums, host_for


def step(sums: UpdateSums, wave: int, scale: float) -> None:
    """One update of `wave`: every tracked tensor moves by a wave-dependent amount."""
    for t in sums.tracked.values():
        t.add_(torch.linspace(-1.0, 1.0, t.numel(), device=t.device).view_as(t) * scale + 0.1 * wave)
    sums.record(wave)


def test_keep_pushed_moves_the_pushed_waves_only() -> None:
    """Waves <= through move to the host; a later wave and the wave whose updates are still open stay."""
    tracked = {"w": torch.zeros(3, 4), "b": torch.zeros(5)}
    sums = UpdateSums(tracked, tracked, 0, None, host=torch.device("meta"))  # a host that shows what moved
    for wave in range(3):
        step(sums, wave, 1.0 + wave)
        sums.push(wave)
    step(sums, 3, 0.5)  # open: not folded yet
    sums.keep_pushed(1)
    assert {w: {t.device.type for t in s.values()} for w, s in sums.sums.items()} == {
        0: {"meta"},
        1: {"meta"},
        2: {"cpu"},
    }
    assert sums.open_wave == 3


def test_without_a_host_keep_pushed_leaves_the_sums_where_they_are() -> None:
    """CPU tensors are in host memory already: no host at any D, and forget(through, pushed) moves nothing."""
    tracked = {"w": torch.zeros(6)}
    assert [host_for(tracked, d) for d in (0, 1, 3)] == [None, None, None]
    sums = UpdateSums(tracked, tracked, 0, None, host_for(tracked, 1))
    step(sums, 0, 1.0)
    kept = sums.push(0)["w"]
    sums.forget(-1, 0)
    assert sums.sums[0]["w"] is kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("average", [0, 2])
def test_on_cuda_pushed_sums_wait_in_pinned_memory_and_rebase_the_same(average: int) -> None:
    """Two stages' sums at D = 1, one keeping pushed waves on the host: after each PUSH its device holds the
    sums of no pushed wave (W less per wave kept), the kept ones are pinned, and the rebase after each pull
    gives the same tensors bit for bit."""
    device = torch.device("cuda:0")
    shapes = {"w": (256, 256), "b": (256,)}
    twins = []
    for d in (0, 1):  # host_for: none at D = 0, the host's memory at D = 1
        tracked = {k: torch.zeros(s, device=device) for k, s in shapes.items()}
        host = host_for(tracked, d)
        assert host == (torch.device("cpu") if d else None)
        twins.append(UpdateSums(tracked, tracked, average, None, host=host))
    plain, kept = twins
    weight_bytes = sum(t.numel() * 4 for t in kept.tracked.values())
    for wave in range(6):
        for sums in twins:
            step(sums, wave, 0.25 * (wave + 1))
            sums.push(wave)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        kept.forget(wave - 2, wave)  # wave - 2 is on the host already; the pushed wave moves there
        torch.cuda.synchronize()
        assert before - torch.cuda.memory_allocated(device) >= weight_bytes - 1024
        assert all(t.is_pinned() for s in kept.sums.values() for t in s.values())
        if wave >= 1:  # the pull of wave - 1 contains own waves <= wave - 2 (D = 1)
            pulled = {k: torch.full(s, 0.5 * wave, device=device) for k, s in shapes.items()}
            for sums in twins:
                sums.rebase(pulled, wave - 2)
            for key in shapes:
                assert torch.equal(plain.tracked[key], kept.tracked[key]), key
    kept.settle()

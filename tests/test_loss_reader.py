"""worker/loss_reader.py: the last stage's losses, read once a wave (on CUDA without draining the device)."""

from __future__ import annotations

import math

import pytest
import torch

from hetpipe.worker.loss_reader import LossReader

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.mark.parametrize("device", DEVICES)
def test_a_read_gives_every_loss_added_since_the_last_in_order(device: str):
    reader = LossReader(torch.device(device))
    assert reader.read() == []
    weights = torch.linspace(0.5, 2.0, 1000, device=device)
    events = []
    for p in range(40):  # more than the reader's first pinned buffer holds
        loss = ((weights * (p + 1)) ** 2).mean()  # queued work, its value not read here
        event = {"p": p}
        reader.add(event, loss)
        event["later"] = p  # a stage fills in the rest of the event after the backward
        events.append((event, ((weights.cpu().double() * (p + 1)) ** 2).mean().item()))
    assert len(reader) == 40
    got = reader.read()
    assert [e for e, _ in got] == [{"p": p, "later": p} for p in range(40)]
    assert [v for _, v in got] == pytest.approx([v for _, v in events], rel=1e-5)
    assert reader.read() == [] and len(reader) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_loss_reads_as_such(device: str):
    reader = LossReader(torch.device(device))
    reader.add({"p": 0}, torch.tensor(1.5, device=device))
    reader.add({"p": 1}, torch.tensor(float("nan"), device=device))
    reader.add({"p": 2}, torch.tensor(float("inf"), device=device, dtype=torch.bfloat16))
    values = [v for _, v in reader.read()]
    assert values[0] == 1.5 and math.isnan(values[1]) and math.isinf(values[2])

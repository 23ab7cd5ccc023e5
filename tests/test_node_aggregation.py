"""Node-local aggregation (docs/wsp.md#node-local-aggregation): which VWs a node's relay serves, the shard's
side of a relayed group (one pre-weighed push per wave completes it for every member), the relay's own state
(its group's sum in VW order, one pull serving every member), the config's refusals, and runs through the
relays equal to the reference (which adds each node's sum first) bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hetpipe.core.config.files import load_config
from hetpipe.core.config.overrides import apply_overrides
from hetpipe.core.errors import ConfigError
from hetpipe.core.wsp.aggregation import MeanAggregation, SumAggregation
from hetpipe.core.wsp.groups import node_groups, relayed
from hetpipe.core.wsp.relay import RelayState
from hetpipe.core.wsp.results import WspError
from hetpipe.core.wsp.state import ShardState

from equivalence import assert_equals_reference

F32 = np.float32


@pytest.mark.parametrize(
    ("gpus", "groups"),
    [
        ([["n0:0"], ["n0:1"], ["n1:0"]], ((0, 1), (2,))),
        ([["n0:0", "n1:0"], ["n0:1"], ["n0:2"]], ((0,), (1, 2))),  # vw 0 spans two nodes: alone
        ([["n1:0"], ["n0:0"], ["n1:1"], ["n0:1", "n0:2"]], ((0, 2), (1, 3))),
        ([["n0:0"], ["n1:0"]], ((0,), (1,))),  # one VW a node: nothing to relay
    ],
)
def test_the_vws_wholly_on_one_node_form_its_group(gpus: list[list[str]], groups: tuple) -> None:
    assert node_groups(gpus) == groups
    assert node_groups(gpus, on=False) == tuple((v,) for v in range(len(gpus)))
    assert relayed(groups) == tuple(g for g in groups if len(g) > 1)


def _shard(rule: MeanAggregation | SumAggregation, weights: tuple[int, ...]) -> ShardState:
    """A shard of a 3-VW run: VWs 0 and 1 through a relay (registered as vw 0, stage 0), VW 2 on its own."""
    state = ShardState(0, "exact", rule)
    initial = {"k": np.arange(4, dtype=F32), "b": np.zeros(4, F32)}
    state.register(0, 0, 3, 1, initial, {"b": "buffer"}, None, 0, weights, (0, 1))
    state.register(2, 0, 3, 1, initial, {"b": "buffer"}, None, 0, weights)
    return state


def test_a_relays_push_completes_the_wave_for_every_member_and_enters_unweighed() -> None:
    """Weights 1, 2, 3: the relay pushes k_0 P_0 + k_1 P_1 already weighed; VW 2's push is weighed by the
    shard; the mean divides by 6 (all three VWs)."""
    weights = (1, 2, 3)
    state = _shard(MeanAggregation(), weights)
    p = {v: np.full(4, F32(v + 1) / F32(7)) for v in range(3)}
    b = {v: np.full(4, F32(10 * (v + 1))) for v in range(3)}
    group = {"k": p[0] + p[1] * F32(2), "b": b[0] + b[1] * F32(2)}
    state.push(2, 0, 0, {"k": p[2], "b": b[2]})
    assert state.c_global == 0 and [state.c_local(v) for v in range(3)] == [0, 0, 1]
    state.push(0, 0, 0, group)
    assert [state.c_local(v) for v in range(3)] == [1, 1, 1] and state.c_global == 1
    got = state.read().tensors
    assert np.array_equal(got["k"], np.arange(4, dtype=F32) + (group["k"] + p[2] * F32(3)) / F32(6))
    assert np.array_equal(got["b"], (group["b"] + b[2] * F32(3)) / F32(6))


def test_a_relayed_vw_cannot_register_on_its_own_and_groups_do_not_overlap() -> None:
    state = _shard(SumAggregation(), ())
    with pytest.raises(WspError, match="relay"):
        state.register(1, 0, 3, 1, {"k": np.zeros(4, F32)}, None, None, 0, ())
    with pytest.raises(WspError, match="relayed by vw 0"):
        state.register(1, 0, 3, 1, {"k": np.zeros(4, F32)}, None, None, 0, (), (1, 2))
    meta, arrays = state.to_state()
    assert ShardState.from_state(meta, arrays, SumAggregation()).membership.leaders == {0: 0, 1: 0}


def test_the_relay_sums_its_group_in_vw_order_and_one_pull_serves_every_member() -> None:
    relay = RelayState((1, 2), 0, MeanAggregation())
    weights = (1, 2, 3)
    for vw in (1, 2):
        for stage in range(2):
            keys = {"a": np.zeros(3, F32)} if stage == 0 else {"b": np.zeros(2, F32)}
            relay.register(vw, stage, 3, 2, keys, None, 4, 0, weights)
    assert relay.registered()
    with pytest.raises(WspError, match="not one of this relay's VWs"):
        relay.register(0, 0, 3, 2, {"a": np.zeros(3, F32)}, None, 4, 0, weights)
    a = {v: np.full(3, F32(v) / F32(3)) for v in (1, 2)}
    relay.push(2, 0, 0, {"a": a[2]})
    relay.push(2, 1, 0, {"b": np.ones(2, F32)})
    relay.push(1, 0, 0, {"a": a[1]})
    assert relay.take_outbox() == []  # vw 1's stage 1 has not pushed wave 0
    relay.push(1, 1, 0, {"b": np.ones(2, F32)})
    [(wave, sums)] = relay.take_outbox()
    assert wave == 0
    assert np.array_equal(sums["a"], a[1] * F32(2) + a[2] * F32(3))
    assert np.array_equal(sums["b"], np.full(2, F32(5)))
    assert not relay.gate_open(2) and relay.wanted(2)  # W_1 (the gate of wave 2 at D = 0) not here yet
    relay.receive(1, {"a": np.ones(3, F32), "b": np.ones(2, F32)}, 1)
    assert relay.gate_open(2) and not relay.wanted(2)
    assert relay.pull(1, 0, 2).tensors.keys() == {"a"} and relay.pull(2, 1, 2).tensors.keys() == {"b"}


def test_an_older_version_is_still_pulled_after_a_newer_one_came_first() -> None:
    """At D = 1 a VW ahead pulls W_3 (its wave 5) before the other's pull of W_2 (wave 4) reaches the relay:
    W_2 must still go upstream (a relay that took the oldest version held as its floor hung here)."""
    relay = RelayState((0, 1), 1, MeanAggregation())
    for vw in (0, 1):
        relay.register(vw, 0, 2, 1, {"a": np.zeros(3, F32)}, None, 10, 4, ())
    relay.receive(3, {"a": np.ones(3, F32)}, 4)
    assert relay.gate_open(5) and relay.pull(1, 0, 5).version == 3
    assert not relay.gate_open(4) and relay.wanted(4)
    relay.receive(2, {"a": np.zeros(3, F32)}, 4)
    assert relay.pull(0, 0, 4).version == 2
    assert relay.oldest == 3 and not relay.wanted(4)  # forgotten once every stage passed it: never again


def _two_nodes(tmp_path: Path, splits: list[tuple[int, ...]], on_node: list[str], extra: str = "") -> Path:
    """A run of VWs with `splits`, VW v wholly on node `on_node[v]` (n0 or n1), Nm and batch per VW."""
    used: dict[str, int] = {"n0": 0, "n1": 0}
    vws = []
    for split, node in zip(splits, on_node, strict=True):
        vws.append([f"{node}:{used[node] + j}" for j in range(len(split))])
        used[node] += len(split)
    work = [(2, 16), (5, 32), (3, 16)][: len(splits)]
    tables = "".join(
        "[[virtual_workers]]\ngpus = ["
        + ", ".join(f'"{g}"' for g in vw)
        + f"]\nnm = {nm}\nbatch_size = {b}\n"
        for vw, (nm, b) in zip(vws, work, strict=True)
    )
    nodes = ""
    for n, k in used.items():
        gpus, devices = ", ".join(['"g"'] * max(1, k)), ", ".join(['"cpu"'] * max(1, k))
        nodes += f'[[nodes]]\nname = "{n}"\ngpus = [{gpus}]\ndevices = [{devices}]\n'
    text = f"""name = "test"
seed = 3
[gpu_types.g]
speed = 1.0
memory_gib = 4.0
{nodes}[ps]
node_aggregation = true
{extra}
[wsp]
staleness = 0
nm = 2
[checkpoint]
dir = ""
[model]
name = "mlp"
options = {{ hidden = [24, 16] }}
[data]
name = "mnist"
test_fraction = 0.2
[train]
batch_size = 16
waves = 3
optimizer = "momentum"
lr = 0.05
out_dir = "{tmp_path / "runs"}"
[emulation]
enabled = false
{tables}"""
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ('on_vw_failure = "evict"', "on_vw_failure"),
        ('auth = "curve"', "auth"),
    ],
)
def test_the_config_refuses_what_relays_do_not_serve_yet(tmp_path: Path, setting: str, match: str) -> None:
    path = _two_nodes(tmp_path, [(4,), (4,)], ["n0", "n0"], setting)
    with pytest.raises(ConfigError, match=match):
        load_config(path)
    latest = _two_nodes(tmp_path, [(4,), (4,)], ["n0", "n0"])
    latest.write_text(
        latest.read_text().replace("nm = 2\n[checkpoint]", 'nm = 2\npull = "latest"\n[checkpoint]')
    )
    with pytest.raises(ConfigError, match="exact pulls only"):
        load_config(latest)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rule", "splits", "on_node"),
    [
        ("mean", [(2, 1, 1), (4,), (3, 1)], ["n0", "n0", "n1"]),  # 3, 1 and 2 stages; a group of two
        ("server", [(4,), (2, 2), (1, 3)], ["n1", "n0", "n1"]),  # the group is vws 0 and 2
        ("sum", [(2, 2), (4,)], ["n0", "n0"]),  # every VW on one node
    ],
)
def test_runs_through_the_relays_equal_the_reference_bit_for_bit(
    tmp_path: Path, rule: str, splits: list[tuple[int, ...]], on_node: list[str]
) -> None:
    path = _two_nodes(tmp_path, splits, on_node)
    config = apply_overrides(load_config(path), [f'ps.aggregation="{rule}"'])
    summary, _ = assert_equals_reference(tmp_path, config, splits)
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("relay-*"))
    assert "registered upstream for vws" in logs
    off = apply_overrides(config, ["ps.node_aggregation=false"])
    assert_equals_reference(tmp_path / "off", off, splits)

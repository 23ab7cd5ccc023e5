"""Multi-process tests of the PS: real shards and clients on 127.0.0.1 (hetpipe.server,
hetpipe.worker.ps_client)."""

from __future__ import annotations

import numpy as np
import pytest

from hetpipe.core.protocol.placement import balanced_placement
from hetpipe.server.shard import ShardSettings
from hetpipe.worker.ps_client import PSClient, PSError, PSTimeout

from conftest import start_shard
from ledger_client import LedgerSpec, ledger_keys, ledger_stage

pytestmark = pytest.mark.slow


def admin(endpoints: list[str], run: str) -> PSClient:
    """A client that only reads (status, read); it registers nothing."""
    return PSClient(endpoints, run, 0, 0, 1, 1, {}, timeout_s=10, retry_s=1)


@pytest.mark.parametrize(
    ("staleness", "mode", "shards"), [(0, "exact", 1), (2, "exact", 2), (0, "latest", 1), (2, "latest", 1)]
)
def test_three_vws_ledger_every_slot_exactly_once(children, staleness, mode, shards):
    spec = LedgerSpec(run="ledger", num_vws=3, num_stages=2, num_waves=8, staleness=staleness, pull_mode=mode)
    endpoints = [
        start_shard(
            children, ShardSettings(spec.run, s, "tcp://127.0.0.1:0", staleness, mode), name=f"ps{s}"
        )[0]
        for s in range(shards)
    ]
    pauses = [0.0, 0.01, 0.04]  # VW 2 is the slow one; VW 0 runs as fast as the bound lets it
    stages = [
        children.start(f"vw{v}-s{j}", ledger_stage, endpoints, spec, v, j, pauses[v])
        for v in range(spec.num_vws)
        for j in range(spec.num_stages)
    ]
    for stage in stages:
        stage.process.join(60)
        assert stage.process.exitcode == 0, stage.log.read_text()
    with admin(endpoints, spec.run) as ps:
        weights = ps.read()
        infos = ps.status()
    for stage in range(spec.num_stages):
        for key in ledger_keys(spec, stage):
            np.testing.assert_array_equal(weights[key], np.ones((spec.num_vws, spec.num_waves), np.float32))
    assert all(info["c_global"] == spec.num_waves and info["c_local"] == [8, 8, 8] for info in infos)


def test_wrong_run_and_unregistered_push_are_refused(children):
    endpoint, _ = start_shard(children, ShardSettings("real", 0, "tcp://127.0.0.1:0", 0))
    place = {"k": 0}
    with PSClient([endpoint], "other", 0, 0, 1, 1, place, timeout_s=5, retry_s=1) as ps:
        with pytest.raises(PSError) as err:
            ps.register({"k": np.zeros(3, np.float32)})
        assert err.value.code == "run_mismatch" and "'real'" in str(err.value)
    with PSClient([endpoint], "real", 0, 0, 1, 1, place, timeout_s=5, retry_s=1) as ps:
        with pytest.raises(PSError) as err:
            ps.push(0, {"k": np.zeros(3, np.float32)})
        assert err.value.code == "not_registered"


def test_pull_timeout_names_the_vw_everyone_waits_for(children):
    endpoint, _ = start_shard(children, ShardSettings("wait", 0, "tcp://127.0.0.1:0", 0))
    place = {"k": 0}
    fast = PSClient([endpoint], "wait", 0, 0, 2, 1, place, timeout_s=2, retry_s=0.5)
    slow = PSClient([endpoint], "wait", 1, 0, 2, 1, place, timeout_s=2, retry_s=0.5)
    with fast, slow:
        fast.register({"k": np.zeros(2, np.float32)})
        slow.register({"k": np.zeros(2, np.float32)})
        fast.push(0, {"k": np.ones(2, np.float32)})
        with pytest.raises(PSTimeout) as err:
            fast.pull(2)  # needs c_global >= 1: vw 1 has not pushed wave 0
        assert "waiting for vw 1, which completed 0 waves" in str(err.value)
        slow.push(0, {"k": np.ones(2, np.float32)})
        pulled = fast.pull(2)
        np.testing.assert_array_equal(pulled.tensors["k"], [2.0, 2.0])


def test_a_pull_parked_at_a_relay_times_out_pointing_past_the_relay(monkeypatch):
    """A relay's status counts its own members only: the message says what it waits for from the PS."""
    relay = {
        "relay": True,
        "members": [0, 1],
        "c_global": 0,
        "version": 0,
        "staleness": 0,
        "c_local": [2, 2, 0],
    }
    with PSClient(["tcp://127.0.0.1:9"], "r", 1, 0, 3, 1, {"k": 0}, timeout_s=1, retry_s=0.5) as client:
        monkeypatch.setattr(client, "status", lambda: [relay])
        text = client._timeout_message("pull of wave 2", 60.0, 2)
    assert text == (
        "pull of wave 2 by vw 1 stage 0 got no answer in 60 s: its node's relay (vws 0, 1) holds W_0 and "
        "waits for W_1 from the PS, which waits for a VW outside the group (the relay's log names it); is "
        "every VW running?"
    )


def test_placement_spreads_keys_and_every_shard_gets_its_part(children):
    endpoints = [
        start_shard(children, ShardSettings("spread", s, "tcp://127.0.0.1:0", 0), name=f"ps{s}")[0]
        for s in range(3)
    ]
    sizes = {f"k{i}": 4 * (i + 1) for i in range(9)}
    place = balanced_placement(sizes, 3)
    tensors = {k: np.full(n // 4, float(i), np.float32) for i, (k, n) in enumerate(sizes.items())}
    with PSClient(endpoints, "spread", 0, 0, 1, 1, place, timeout_s=5, retry_s=1) as ps:
        w0 = ps.register(tensors)
        assert set(w0) == set(sizes)
        infos = ps.status()
        assert [i["registered"] for i in infos] == [1, 1, 1]
        ps.push(0, {k: np.ones_like(v) for k, v in tensors.items()})
        pulled = ps.pull(2)  # D = 0: W_1 = W_0 + wave 0
    for k, v in tensors.items():
        np.testing.assert_array_equal(pulled.tensors[k], v + 1.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_pushes_and_registrations_are_refused(children, bad: float):
    endpoint, _ = start_shard(children, ShardSettings("nan", 0, "tcp://127.0.0.1:0", 0))
    with PSClient([endpoint], "nan", 0, 0, 1, 1, {"k": 0, "j": 0}, timeout_s=5, retry_s=1) as ps:
        with pytest.raises(PSError) as err:
            ps.register({"k": np.array([0.0, bad], np.float32), "j": np.zeros(2, np.float32)})
        assert err.value.code == "non_finite" and "register of vw 0 stage 0: tensor 'k'" in str(err.value)
        ps.register({"k": np.zeros(2, np.float32), "j": np.zeros(2, np.float32)})
        ps.push(0, {"k": np.ones(2, np.float32), "j": np.ones(2, np.float32)})
        poisoned = np.ones(4, np.float32)
        poisoned[2] = bad
        with pytest.raises(PSError) as err:
            ps.push(1, {"k": np.ones(2, np.float32), "j": poisoned[2:]})
        nans, infs = (1, 0) if np.isnan(bad) else (0, 1)
        assert err.value.code == "non_finite"
        assert f"push of vw 0 stage 0 wave 1: tensor 'j' holds {nans} NaN and {infs} inf values" in str(
            err.value
        )
        assert ps.status()[0]["c_global"] == 1  # the refused wave did not count
        ps.push(1, {"k": np.ones(2, np.float32), "j": np.ones(2, np.float32)})  # a clean retry does
        assert ps.read()["j"].tolist() == [2.0, 2.0]


def test_a_stage_parks_one_pull_at_a_time(children):
    """A pull whose gate is closed waits; a second one from the same stage replaces it (the first is answered
    with an error), so parked pulls cannot pile up."""
    from hetpipe.core.protocol import wire

    endpoint, _ = start_shard(children, ShardSettings("park", 0, "tcp://127.0.0.1:0", 0))
    place = {"k": 0}
    with (
        PSClient([endpoint], "park", 0, 0, 2, 1, place, timeout_s=5, retry_s=1) as fast,
        PSClient([endpoint], "park", 1, 0, 2, 1, place, timeout_s=5, retry_s=1) as slow,
    ):
        fast.register({"k": np.zeros(2, np.float32)})
        slow.register({"k": np.zeros(2, np.float32)})
        sock = fast.sockets[0]  # the registered connection, driven by hand
        for request_id in (101, 102, 102, 103):  # 102 twice: a retry keeps its place
            sock.send_multipart(
                wire.encode("pull", {"id": request_id, "run": "park", "vw": 0, "stage": 0, "wave": 2})
            )
        replies = [wire.decode(sock.recv_multipart()) for _ in range(2)]
        assert [(r.fields["id"], r.fields["code"]) for r in replies] == [(101, "conflict"), (102, "conflict")]
        assert "replaced by pull 102 of wave 2" in replies[0].fields["message"]
        info = slow.status()[0]
        assert [(p["vw"], p["wave"]) for p in info["parked"]] == [(0, 2)]
        fast.push(0, {"k": np.ones(2, np.float32)})
        slow.push(0, {"k": np.ones(2, np.float32)})  # the gate opens: the one parked pull (103) is answered
        answer = wire.decode(sock.recv_multipart())
        assert answer.type == "weights" and answer.fields["id"] == 103
        assert not sock.poll(200)  # and nothing else


def test_a_client_facing_no_server_times_out_and_says_so(children):
    """Nothing listens: the request and its status probe time out (once each), the message says the PS is
    silent."""
    from hetpipe.core.runs.procs import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with (
        PSClient([endpoint], "none", 0, 0, 1, 1, {"k": 0}, timeout_s=1, retry_s=0.25) as ps,
        pytest.raises(PSTimeout) as err,
    ):
        ps.register({"k": np.zeros(2, np.float32)})
    assert "register by vw 0 stage 0 got no answer" in str(err.value)
    assert "does not answer either: is it running?" in str(err.value)


def test_a_curve_client_facing_a_plain_shard_times_out_naming_its_key(children, tmp_path):
    """The handshake fails, so the DEALER has no connection to queue on: sends must not block."""
    import zmq

    from hetpipe.core.protocol.keys import client_keys, key_users, write_keys

    if not zmq.has("curve"):
        pytest.skip("this libzmq has no CURVE support")
    write_keys(tmp_path / "keys", key_users(1))
    endpoint, _ = start_shard(children, ShardSettings("plain", 0, "tcp://127.0.0.1:0", 0))
    curve = client_keys(tmp_path / "keys", "vw0")
    with (
        PSClient([endpoint], "plain", 0, 0, 1, 1, {"k": 0}, timeout_s=1, retry_s=0.25, curve=curve) as ps,
        pytest.raises(PSTimeout) as err,
    ):
        ps.register({"k": np.zeros(2, np.float32)})
    assert "Or it refuses this client's CURVE key (vw0)" in str(err.value)


def test_bfloat16_on_the_wire_both_ways_while_the_ps_adds_in_float32(children):
    """[ps] wire_dtype = "bfloat16": pushes and pulls go packed (half the bytes), the PS keeps float32
    weights."""
    from hetpipe.core.protocol.wire import from_bfloat16_bits, to_bfloat16_bits

    def bf16(x: np.ndarray) -> np.ndarray:
        return from_bfloat16_bits(to_bfloat16_bits(x))

    endpoint, _ = start_shard(children, ShardSettings("bf", 0, "tcp://127.0.0.1:0", 0, wire_dtype="bfloat16"))
    rng = np.random.default_rng(0)
    w0, d0, d1 = (rng.standard_normal(1000).astype(np.float32) * s for s in (1.0, 1e-3, 1e-3))
    with PSClient(
        [endpoint], "bf", 0, 0, 1, 1, {"k": 0}, timeout_s=10, retry_s=1, wire_dtype="bfloat16"
    ) as ps:
        np.testing.assert_array_equal(ps.register({"k": w0})["k"], w0)  # W_0 goes as it is
        ps.push(0, {"k": d0})
        ps.push(1, {"k": d1})
        (reply,) = ps.wait(ps.send_pull(2))  # the gate of wave 2 (D = 0) asks for W_1
        view = reply.tensors["k"]
        assert view.packed and view.nbytes == 2 * w0.size
        w1 = w0 + bf16(d0)  # the push arrived rounded; the PS added it in float32
        np.testing.assert_array_equal(view.to_array(), bf16(w1))
        np.testing.assert_array_equal(ps.read()["k"], w1 + bf16(d1))  # admin reads stay float32, unrounded
        assert not np.array_equal(bf16(w1) + bf16(d1), w1 + bf16(d1))  # so rounding pulls would have shown


def test_a_registration_gets_back_only_the_w0_that_differs_from_what_it_sent(children):
    """The first registration of a key sets W_0. A later one with the same bits gets no tensors back (its W_0
    is what it sent: over a slow link the reply would cost what the registration did) and register returns
    its own values; one with other values (another seed, or -0.0 for 0.0) gets the PS's W_0 and register
    returns that."""
    endpoint, _ = start_shard(children, ShardSettings("w0", 0, "tcp://127.0.0.1:0", 0))
    place = {"k": 0, "j": 0}
    w0 = {"k": np.arange(6, dtype=np.float32) - 2.5, "j": np.zeros(3, np.float32)}
    other = {"k": w0["k"] + 1.0, "j": -w0["j"]}  # -0.0: equal as numbers, not as bits
    clients = [PSClient([endpoint], "w0", v, 0, 3, 1, place, timeout_s=5, retry_s=1) for v in range(3)]
    replies: list = []
    for client in clients:
        wait = client.wait
        client.wait = lambda call, wait=wait: replies.append(r := wait(call)) or r  # type: ignore[method-assign]
    with clients[0], clients[1], clients[2]:
        first = clients[0].register(w0)
        same = clients[1].register({k: v.copy() for k, v in w0.items()})
        differs = clients[2].register(other)
    assert [sorted(r.tensors) for (r,) in replies] == [[], [], ["j", "k"]]
    for got in (first, same, differs):
        assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in w0.items()}

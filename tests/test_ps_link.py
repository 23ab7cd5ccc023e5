"""A stage's PS link with its agent in a process of its own (worker/ps_link.py, worker/agent_process.py),
against a real shard: registration, pushes and pulls through the shared buffers, the agent's end, and its
pipe."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import io
import os
import threading
import typing
from pathlib import Path

import numpy as np
import pytest
import torch

from hetpipe.core.errors import HetpipeError
from hetpipe.core.runs.metrics import TraceRecorder
from hetpipe.server.shard import ShardSettings
from hetpipe.worker.agent_pipe import MAX_MESSAGE_BYTES, PipeWriter, read_message
from hetpipe.worker.flat_layout import FlatLayout
from hetpipe.worker.ps_client import ClientSpec, PSClient
from hetpipe.worker.ps_link import ProcessLink, PSLink, ThreadLink, agent_kind, open_link
from hetpipe.worker.transfer import PushStaging

from conftest import start_shard

VALUES = {
    "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "b": torch.tensor([0.5, -1.0]),
    "bn.count": torch.tensor(7, dtype=torch.int64),
}
KINDS = {"w": "param", "b": "param", "bn.count": "buffer"}


def spec(endpoint: str, run: str, vw: int = 0, num_vws: int = 1) -> ClientSpec:
    return ClientSpec([endpoint], run, vw, 0, num_vws, 1, dict.fromkeys(VALUES, 0), timeout_s=20, retry_s=2)


def link(endpoint: str, run: str, on_fatal=lambda exc: None, vw: int = 0, num_vws: int = 1) -> ProcessLink:
    return ProcessLink(
        spec(endpoint, run, vw, num_vws),
        FlatLayout.of(VALUES),
        torch.device("cpu"),
        TraceRecorder(f"vw{vw}", 0),
        1000,
        0.0,
        on_fatal,
        f"test-{run}-vw{vw}",
    )


def test_auto_puts_the_agent_of_a_cuda_stage_in_a_process():
    assert agent_kind("auto", torch.device("cuda:0")) == "process"
    assert agent_kind("auto", torch.device("cpu")) == "thread"
    assert agent_kind("process", torch.device("cpu")) == "process"


def _link_members() -> dict[str, typing.Any]:
    """PSLink's own members (its methods and properties), by name."""
    return {name: value for name, value in vars(PSLink).items() if not name.startswith("_")}


def _shape(function: typing.Callable) -> tuple:
    """A signature as comparable data: each parameter's name, kind, default and type, and the return type."""
    sig = inspect.signature(function, eval_str=True)
    params = [(p.name, p.kind, p.default, p.annotation) for p in sig.parameters.values()]
    return params, sig.return_annotation


def test_ps_link_declares_exactly_what_a_stage_uses_of_its_link():
    """Every `link.X` and `self.link.X` of worker/stage.py is a member of PSLink, and PSLink has no other."""
    origin = importlib.util.find_spec("hetpipe.worker.stage").origin
    used = {
        node.attr
        for node in ast.walk(ast.parse(Path(origin).read_text()))
        if isinstance(node, ast.Attribute)
        and (
            (isinstance(node.value, ast.Name) and node.value.id == "link")
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "link")
        )
    }
    assert used == set(_link_members())
    assert inspect.signature(open_link, eval_str=True).return_annotation is PSLink


@pytest.mark.parametrize("cls", [ThreadLink, ProcessLink])
def test_both_links_have_every_member_of_ps_link_with_its_signature(cls: type):
    """A method with the same parameters (names, kinds, defaults, types) and return type; a property as a
    property of the same type or an attribute declared in the class of that type (or one of its union's)."""
    hints = typing.get_type_hints(cls)
    for name, member in _link_members().items():
        have = getattr(cls, name, None)
        if isinstance(member, property):
            want = inspect.signature(member.fget, eval_str=True).return_annotation
            if isinstance(have, property):
                got = inspect.signature(have.fget, eval_str=True).return_annotation
            else:
                assert name in hints, f"{cls.__name__} declares no attribute {name}"
                got = hints[name]
            assert got == want or got in typing.get_args(want), f"{cls.__name__}.{name}: {got}, not {want}"
        else:
            assert callable(have), f"{cls.__name__} has no method {name}"
            assert _shape(have)[0][1:] == _shape(member)[0][1:], f"{cls.__name__}.{name}'s parameters"
            assert _shape(have)[1] == _shape(member)[1], f"{cls.__name__}.{name}'s return type"


def test_array_views_cut_as_tensor_views_do():
    layout = FlatLayout.of(VALUES)
    flat = np.arange(layout.numel, dtype=np.float32)
    ours = layout.array_views(flat)
    theirs = layout.views(torch.from_numpy(flat))
    for key in VALUES:
        np.testing.assert_array_equal(ours[key], theirs[key].numpy())
        assert np.shares_memory(ours[key], flat)


def test_pipe_messages_round_trip_and_refuse_garbage():
    buf = io.BytesIO()
    writer = PipeWriter(buf)
    writer.send("push", id=3, wave=1, slot=0)
    writer.send("done", id=3, gaps=[[1, 2, 3]], error={"type": "PSError", "code": "stale", "message": "x"})
    buf.seek(0)
    assert read_message(buf) == {"op": "push", "id": 3, "wave": 1, "slot": 0}
    assert read_message(buf)["gaps"] == [[1, 2, 3]]
    assert read_message(buf) is None  # the pipe's end
    with pytest.raises(ValueError, match="over the"):
        read_message(io.BytesIO((MAX_MESSAGE_BYTES + 1).to_bytes(4, "little")))
    with pytest.raises(ValueError, match="'op'"):
        body = b"\x91\x01"  # msgpack [1]
        read_message(io.BytesIO(len(body).to_bytes(4, "little") + body))


def test_client_spec_crosses_the_pipe_whole():
    from hetpipe.core.protocol.keys import ClientKeys

    keyed = ClientSpec(
        ["tcp://127.0.0.1:1"],
        "r",
        1,
        0,
        2,
        1,
        {"w": 0},
        5.0,
        1.0,
        ClientKeys("vw1", b"pub", b"secret", b"server"),
        "bfloat16",
    )
    for one in (keyed, spec("tcp://127.0.0.1:1", "r")):
        buf = io.BytesIO()
        PipeWriter(buf).send("setup", client=one.fields())
        buf.seek(0)
        assert ClientSpec.of(read_message(buf)["client"]) == one


@pytest.mark.slow
def test_process_link_registers_pushes_and_pulls_through_shared_buffers(children):
    endpoint, _ = start_shard(children, ShardSettings("link", 0, "tcp://127.0.0.1:0", 1, "exact"))
    a, b = link(endpoint, "link", vw=0, num_vws=2), link(endpoint, "link", vw=1, num_vws=2)
    assert not a.shared.path.exists(), "the shared file is unlinked once both processes map it"
    w0 = {}
    for one in (a, b):  # concurrently: a shard answers the registrations once every VW has registered
        threading.Thread(
            target=lambda one=one: w0.setdefault(
                id(one), one.register(VALUES, KINDS, num_waves=4, start_wave=0, pulls=True)
            ),
            daemon=True,
        ).start()
    for _ in range(200):
        if len(w0) == 2:
            break
        threading.Event().wait(0.05)
    for key, value in VALUES.items():
        np.testing.assert_array_equal(w0[id(a)][key], value.float().numpy())
    layout = FlatLayout.of(VALUES)
    staged = PushStaging(layout, torch.device("cpu"), a.push_slots)
    a.start(None, None)
    b.start(None, None)
    update = {"w": torch.full((2, 3), 0.25), "b": torch.tensor([1.0, 2.0]), "bn.count": torch.tensor(9)}
    pushes = []
    for wave in range(2):
        arrays, ready = staged.stage(update, lambda slot: None)
        np.testing.assert_array_equal(arrays["w"], update["w"].numpy())  # a copy in the shared slot
        pushes.append(a.push(wave, staged.slot, arrays, ready, reused=True))
        b.push(wave, 0, {}, lambda: None, reused=True).result(timeout=20)  # b's slot 0 still holds its W_0
    assert [p.result(timeout=20).wave for p in pushes] == [0, 1]
    pulled = a.pull(2).result(timeout=20)  # the gate of wave 2 at D 1: W_0
    assert (pulled.version, pulled.own_through) == (0, -1)
    pulled = a.pull(3).result(timeout=20)  # the gate of wave 3: W_1, with both VWs' wave 0
    assert (pulled.version, pulled.own_through) == (1, 0)
    got = layout.views(a.pull_host)
    np.testing.assert_array_equal(got["w"].numpy(), VALUES["w"].numpy() + 0.25 + VALUES["w"].numpy())
    np.testing.assert_array_equal(got["bn.count"].numpy(), np.float32(8))  # the buffers' average of 9 and 7
    for one in (a, b):
        one.close(timeout_s=10)
        assert one.wait_durable(5, progress=0)
    assert a.totals[0] > 0
    a.shutdown()
    b.shutdown()
    assert a.proc.returncode == 0 and b.proc.returncode == 0


@pytest.mark.slow
def test_an_agent_process_that_dies_fails_what_is_open_and_what_comes_after(children):
    endpoint, _ = start_shard(children, ShardSettings("dies", 0, "tcp://127.0.0.1:0", 0, "exact"))
    one = link(endpoint, "dies")
    one.register(VALUES, KINDS, num_waves=4, start_wave=0, pulls=False)
    one.start(None, None)
    gate = threading.Event()
    stuck = one.push(0, 0, {}, gate.wait, reused=True)  # held back in the stage until the gate opens
    one.proc.kill()
    one.proc.wait()
    gate.set()
    with pytest.raises(HetpipeError, match="PS agent process"):
        stuck.result(timeout=20)
    with pytest.raises(HetpipeError, match="PS agent process ended"):
        one.push(1, 1, {}, lambda: None, reused=True)
    one.shutdown()
    assert not os.path.exists(one.shared.path)


@pytest.mark.slow
def test_the_agent_process_ends_when_the_pipe_closes(children):
    endpoint, _ = start_shard(children, ShardSettings("eof", 0, "tcp://127.0.0.1:0", 0, "exact"))
    one = link(endpoint, "eof")
    one.proc.stdin.close()  # as when the stage process dies
    assert one.proc.wait(timeout=20) == 0
    admin = PSClient([endpoint], "eof", 0, 0, 1, 1, {}, timeout_s=5, retry_s=1)
    admin.close()


def test_shared_buffers_go_where_there_is_room(tmp_path, monkeypatch):
    """A file bigger than its filesystem's free space kills whoever touches the missing pages (a container's
    /dev/shm is often 64 MiB): such a folder is passed over, and with no room anywhere the error names the
    fixes."""
    from hetpipe.worker import shared_host

    roomy, cramped = tmp_path / "roomy", tmp_path / "cramped"
    roomy.mkdir()
    cramped.mkdir()
    free = {str(roomy): 1 << 40, str(cramped): 32 << 20}
    monkeypatch.setattr(shared_host, "_free_bytes", lambda folder: free.get(str(folder), 0))
    monkeypatch.setattr(shared_host.tempfile, "gettempdir", lambda: str(roomy))
    assert shared_host.shared_dir(100 << 20, (cramped,)) == roomy
    free[str(cramped)] = 1 << 40
    assert shared_host.shared_dir(100 << 20, (cramped,)) == cramped
    free[str(cramped)] = free[str(roomy)] = 0
    with pytest.raises(HetpipeError, match=r"--shm-size.*TMPDIR.*agent = \"thread\""):
        shared_host.shared_dir(100 << 20, (cramped,))


@pytest.mark.slow
def test_an_agent_process_that_stops_answering_is_named(children):
    import signal

    endpoint, _ = start_shard(children, ShardSettings("mute", 0, "tcp://127.0.0.1:0", 0, "exact"))
    one = link(endpoint, "mute")
    os.kill(one.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(HetpipeError, match=f"pid {one.proc.pid}.* did not answer its exit within 0 s"):
            one._call("exit", 0.3)
    finally:
        os.kill(one.proc.pid, signal.SIGCONT)
    one.shutdown()
    assert one.proc.returncode == 0


@pytest.mark.slow
def test_an_agent_process_talks_curve_with_the_stages_keys(children, tmp_path):
    """auth = "curve": the VW's key pair reaches the agent process through its setup message and the shard
    admits it (a wrong key would leave the registration unanswered)."""
    import zmq

    from hetpipe.core.protocol.keys import client_keys, key_users, server_keys, write_keys

    if not zmq.has("curve"):
        pytest.skip("this libzmq has no CURVE support")
    write_keys(tmp_path / "keys", key_users(1))
    endpoint, _ = start_shard(
        children, ShardSettings("curved", 0, "tcp://127.0.0.1:0", 0, keys=server_keys(tmp_path / "keys", 1))
    )
    keyed = ClientSpec(
        [endpoint],
        "curved",
        0,
        0,
        1,
        1,
        dict.fromkeys(VALUES, 0),
        timeout_s=10,
        retry_s=2,
        curve=client_keys(tmp_path / "keys", "vw0"),
    )
    one = ProcessLink(
        keyed,
        FlatLayout.of(VALUES),
        torch.device("cpu"),
        TraceRecorder("vw0", 0),
        1000,
        0.0,
        lambda exc: None,
        "test-curved",
    )
    w0 = one.register(VALUES, KINDS, num_waves=2, start_wave=0, pulls=False)
    np.testing.assert_array_equal(w0["w"], VALUES["w"].numpy())
    one.close(timeout_s=5)
    one.shutdown()

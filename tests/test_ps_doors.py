"""A shard's doors (server/doors.py): connections capped per address and in all, with descriptors left for its
checkpoints; failed handshakes limited per address; the refusal summary logged once a flood ends."""

from __future__ import annotations

import errno
import os
import resource
import select
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from hetpipe.core.errors import WriteError
from hetpipe.core.protocol.access import HandshakeLimit, RefusalLog
from hetpipe.core.protocol.keys import client_keys, key_users, server_keys, write_keys
from hetpipe.server.checkpoint import (
    CHECKPOINT_FAILURES_FATAL,
    OUT_OF_FILES_RETRIES,
    WAIT_FOR_FILES_S,
    CheckpointHealth,
    write_out_of_files_retried,
)
from hetpipe.server.doors import ConnectionTable, connection_cap, peer_address, shut
from hetpipe.server.launch import serve_settings
from hetpipe.server.shard import ShardSettings
from hetpipe.worker.ps_client import PSClient

from conftest import start_shard

KEY = {"k": 0}


# ---- the rules, without sockets ----------------------------------------------------------------------------
def test_connections_are_capped_per_address_and_in_all() -> None:
    table = ConnectionTable(cap=5, per_peer=3)
    for fd in range(3):
        assert table.refusal("10.0.0.1") is None
        table.opened(fd, "10.0.0.1")
    assert "limit per address" in table.refusal("10.0.0.1")
    table.opened(10, "10.0.0.2")
    table.opened(11, "10.0.0.3")
    assert "holds 5 connections, its limit" in table.refusal("10.0.0.4")
    table.closed(0)
    table.closed(0)  # closed twice (a reused descriptor): counted once
    assert table.refusal("10.0.0.1") is None and len(table.peers) == 4


def test_the_cap_leaves_descriptors_for_checkpoints() -> None:
    assert connection_cap(1024, 40) == 1024 - 40 - 64  # the shard: 1,100 connections took them all
    assert connection_cap(1 << 20, 40) == 2048
    assert connection_cap(64, 40) == 8


def test_a_connection_is_read_and_shut_with_no_descriptor_free() -> None:
    # a burst of idle connections took every descriptor before the monitor's events were read; the doors then
    # could not dup a descriptor to read the peer, and left those connections open and uncounted
    with socket.create_server(("127.0.0.1", 0)) as server, socket.socket() as client:
        client.connect(server.getsockname())
        conn, _ = server.accept()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        filler: list[int] = []
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
            with pytest.raises(OSError) as full:
                while True:
                    filler.append(os.open(os.devnull, os.O_RDONLY))
            assert full.value.errno == errno.EMFILE
            assert peer_address(conn.fileno()) == "127.0.0.1"
            shut(conn.fileno())
        finally:
            for fd in filler:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert client.recv(1) == b""  # the peer sees the connection shut
        assert conn.fileno() >= 0  # still libzmq's to close
        conn.close()


def test_failed_handshakes_close_an_address_for_two_windows() -> None:
    limit = HandshakeLimit(limit=3, window_s=1.0)
    assert [limit.failed("a", 0.1 * i) for i in range(2)] == [None, None]
    assert "closing new connections from a for 2 s: 3 failed handshakes" in limit.failed("a", 0.2)
    assert limit.blocked("a", 1.5) and not limit.blocked("b", 1.5)
    assert not limit.blocked("a", 2.0)  # the flood stopped: the address is served again
    assert limit.failed("a", 2.1) is None  # a new window counts from zero


def test_a_flood_summary_is_logged_when_the_window_ends_without_another_refusal() -> None:
    log = RefusalLog(budget=1, window_s=10.0)
    assert log.note("refused x", 0.0) == ["refused x"]
    for t in range(1, 50):
        assert log.note("refused x" if t % 2 else f"refused y{t}", t / 10) == []
    assert log.flush(9.9) == []
    assert log.flush(10.0) == [
        "refused x (and 25 more times in the last 10 s)",
        "24 more refusals were not logged in the last 10 s",
    ]
    assert log.flush(30.0) == []  # once


def test_checkpoint_failures_warn_and_stop_after_some_in_a_row() -> None:
    health = CheckpointHealth()
    warning = health.failed(4, OSError(24, "Too many open files"))
    assert "warning: checkpoint of clock 4 failed" in warning and "1 in a row" in warning
    health.succeeded()
    for clock in range(CHECKPOINT_FAILURES_FATAL):
        assert not health.fatal
        health.failed(5 + clock, OSError(28, "No space left on device"))
    assert health.fatal
    assert health.info() == {
        "checkpoint_failures": CHECKPOINT_FAILURES_FATAL + 1,
        "checkpoint_failures_in_a_row": CHECKPOINT_FAILURES_FATAL,
        "checkpoint_error": "clock 7: [Errno 28] No space left on device",
    }


def test_a_checkpoint_that_finds_no_descriptor_tries_again_until_one_is_free() -> None:
    # a flood's connections, accepted and then closed over the limits, took the descriptors the reserve had
    # just freed: the manifest's write failed with EMFILE though the shard was within its limits
    tries, waits = [], []

    def write(fails: int, errno_: int):
        def attempt() -> Path:
            tries.append(1)
            if len(tries) <= fails:
                raise WriteError.of(Path("ckpt/.ckpt-1.json.tmp"), OSError(errno_, os.strerror(errno_)))
            return Path("ckpt/ckpt-00000001.bin")

        return attempt

    assert write_out_of_files_retried(write(3, errno.EMFILE), waits.append) == Path("ckpt/ckpt-00000001.bin")
    assert len(tries) == 4 and waits == [WAIT_FOR_FILES_S] * 3
    tries.clear()
    with pytest.raises(WriteError, match="EMFILE"):  # never a descriptor: the failure is counted after all
        write_out_of_files_retried(write(10**6, errno.EMFILE), waits.append)
    assert len(tries) == OUT_OF_FILES_RETRIES + 1
    tries.clear()
    with pytest.raises(WriteError, match="ENOSPC"):  # a full disk is not waited out
        write_out_of_files_retried(write(10**6, errno.ENOSPC), waits.append)
    assert len(tries) == 1


# ---- live shards -------------------------------------------------------------------------------------------
def serve_with_few_files(settings: ShardSettings, queue, limit: int) -> None:
    """A shard whose open-file limit (soft and hard) is `limit`, as on a host with `ulimit -n` low."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    serve_settings(settings, queue)


def wait_for_log(child, *texts: str, timeout_s: float = 20.0) -> str:
    """The log once it holds one of `texts` (a hang guard, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = child.log.read_text()
        if any(text in log for text in texts):
            return log
        time.sleep(0.1)
    raise AssertionError(f"none of {texts} in the shard's log:\n{child.log.read_text()}")


def wait_connected(socks: list[socket.socket], timeout_s: float = 60.0) -> None:
    """Until every non-blocking connect in `socks` has finished (a hang guard, not a timing)."""
    deadline, waiting = time.monotonic() + timeout_s, {sock.fileno(): sock for sock in socks}
    poller = select.poll()
    for fd in waiting:
        poller.register(fd, select.POLLOUT)
    while waiting and time.monotonic() < deadline:
        for fd, _ in poller.poll(500):
            poller.unregister(fd)
            del waiting[fd]
    assert not waiting, f"{len(waiting)} of {len(socks)} connections still not made after {timeout_s:.0f} s"


@pytest.mark.slow
def test_idle_connections_cannot_take_the_descriptors_a_checkpoint_needs(children, tmp_path: Path) -> None:
    # one client held ~1,100 idle connections to a shard at 1,024 open files: 25 checkpoints in a row failed
    # (EMFILE) and nobody heard of it
    settings = ShardSettings(
        "doors", 0, "tcp://127.0.0.1:0", 0, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1
    )
    queue = children.ctx.Queue()
    shard = children.start("ps", serve_with_few_files, settings, queue, 256)
    port = queue.get(timeout=30)
    idle = []
    with PSClient([f"tcp://127.0.0.1:{port}"], "doors", 0, 0, 1, 1, KEY, timeout_s=20, retry_s=2) as ps:
        ps.register({"k": np.zeros(4, np.float32)})
        try:
            for _ in range(400):
                sock = socket.socket()
                sock.setblocking(False)
                sock.connect_ex(("127.0.0.1", port))
                idle.append(sock)
            wait_connected(idle)  # a full accept queue drops SYNs, retried later: wait for all of them
            wait_for_log(shard, "closed a new connection from 127.0.0.1", timeout_s=30)
            ps.push(0, {"k": np.ones(4, np.float32)})  # c_global 1: a checkpoint is due
            log = wait_for_log(shard, "checkpoint ckpt-00000001.bin written", "checkpoint of clock 1 failed")
            assert "checkpoint ckpt-00000001.bin written" in log, log
            info = ps.status()[0]
        finally:
            for sock in idle:
                sock.close()
    assert info["checkpoint_failures"] == 0
    assert info["connections"] < 256 - 64
    assert "closed a new connection from 127.0.0.1" in log


@pytest.mark.slow
@pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE support")
def test_a_flood_of_bad_handshakes_closes_its_address_not_the_others(children, tmp_path: Path) -> None:
    # 7,200 bad handshakes in 10 s cut training from 7.1 to 4.3 waves/s: each cost the shard a ZAP answer
    write_keys(tmp_path / "keys", key_users(1))
    endpoint, shard = start_shard(
        children, ShardSettings("doors", 0, "tcp://127.0.0.1:0", 0, keys=server_keys(tmp_path / "keys", 1))
    )
    ctx = zmq.Context()
    flood = []

    def stranger() -> None:
        """A client with an unknown key, from 127.0.0.1 (a refused client does not retry: new ones do)."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey = server_keys(tmp_path / "keys", 1).public
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.connect(endpoint)
        flood.append(sock)

    try:
        for _ in range(60):
            stranger()
        log = wait_for_log(shard, "closing new connections from 127.0.0.1")
        stranger()  # after the block: closed on arrival (under load, all 60 may have arrived before it)
        # the run's key from another address of this machine gets in during the flood
        other = endpoint.replace("tcp://", "tcp://127.0.0.2:0;")
        with PSClient(
            [other],
            "doors",
            0,
            0,
            1,
            1,
            KEY,
            timeout_s=10,
            retry_s=1,
            curve=client_keys(tmp_path / "keys", "vw0"),
        ) as ps:
            ps.register({"k": np.zeros(4, np.float32)})
            assert ps.status()[0]["registered"] == 1
        log = wait_for_log(shard, "closed a new connection from 127.0.0.1: too many failed handshakes")
    finally:
        for sock in flood:
            sock.close(linger=0)
        ctx.destroy(linger=0)
    assert (
        log.count("refused a CURVE key that is not one of this run's keys") <= 20
    )  # counted, not each logged

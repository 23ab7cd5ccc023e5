"""A PS agent beats for its stage only while the stage runs: an agent in a process of its own kept sending the
heartbeats of a SIGSTOPped stage, so the PS never saw it hang (issue 36 item 1, agent = "process")."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import zmq

from hetpipe.core.runs.procs import is_stopped
from hetpipe.worker.ps_agent import PSAgent


class BeatCounter:
    """What PSAgent's thread asks of its client when there is no job: poll and send heartbeats."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.beats: list[int] = []

    def poll(self, timeout_ms: int, extra: list[zmq.Socket]) -> bool:
        poller = zmq.Poller()
        for sock in extra:
            poller.register(sock, zmq.POLLIN)
        return bool(poller.poll(min(timeout_ms, 20)))

    def send_heartbeat(self, progress: int) -> None:
        self.beats.append(progress)


def test_no_heartbeat_while_the_stage_is_not_alive() -> None:
    client, alive = BeatCounter(), [True]
    agent = PSAgent(client, heartbeat_s=0.02, progress=lambda: 7, stage_alive=lambda: alive[0])
    try:
        time.sleep(0.3)
        assert client.beats and set(client.beats) == {7}
        alive[0] = False
        time.sleep(0.05)  # a beat under way may still land
        client.beats.clear()
        time.sleep(0.3)
        assert client.beats == []
        alive[0] = True  # SIGCONT: the beats come back
        time.sleep(0.3)
        assert client.beats
    finally:
        agent.close(timeout_s=5)
        client.context.term()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stopped_or_gone_process_is_stopped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not is_stopped(child.pid)
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not is_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert is_stopped(child.pid)
        child.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 5
        while is_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not is_stopped(child.pid)
    finally:
        child.kill()
        child.wait()
    assert is_stopped(child.pid)  # reaped: gone

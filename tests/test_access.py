"""Tests for hetpipe/core/protocol/access.py: which key may act as which VW, the ZAP decision, the refusal
log."""

from __future__ import annotations

import pytest
import zmq
import zmq.utils.z85

from hetpipe.core.protocol.access import RefusalLog, refusal, zap_decide

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE support")

# (user the connection was admitted as, request type, vw the request claims, allowed)
RULES = [
    (None, "push", 3, True),  # auth = "none": everything, as before keys existed
    (None, "read", None, True),
    ("vw0", "register", 0, True),
    ("vw0", "push", 0, True),
    ("vw0", "pull", 0, True),
    ("vw0", "status", None, True),
    ("vw0", "register", 1, False),  # impersonation
    ("vw0", "push", 1, False),
    ("vw0", "pull", 1, False),
    ("vw1", "push", 0, False),
    ("vw0", "read", None, False),  # reading every weight is the launcher's, not a VW's
    ("admin", "read", None, True),
    ("admin", "status", None, True),
    ("admin", "register", 0, False),  # the admin key never writes
    ("admin", "push", 0, False),
    ("admin", "pull", 0, False),
    ("server", "status", None, False),  # not a client user
]


@pytest.mark.parametrize(("user", "msg_type", "vw", "allowed"), RULES)
def test_refusal_rules(user: str | None, msg_type: str, vw: int | None, allowed: bool) -> None:
    why = refusal(user, msg_type, vw)
    assert (why is None) == allowed, why


def test_impersonation_message_names_both_vws() -> None:
    assert refusal("vw0", "push", 1) == "the key of vw 0 may act only as vw 0, not as vw 1"


def curve_request(key: bytes, mechanism: bytes = b"CURVE") -> list[bytes]:
    return [b"1.0", b"7", b"hetpipe", b"10.0.0.5", b"", mechanism, key]


def test_zap_admits_a_known_key_as_its_user() -> None:
    public, _ = zmq.curve_keypair()
    decision = zap_decide(curve_request(zmq.utils.z85.decode(public)), {public: "vw1"})
    assert decision.reply == [b"1.0", b"7", b"200", b"OK", b"vw1", b""]
    assert decision.user == "vw1" and decision.address == "10.0.0.5" and decision.key == public.decode()


def test_zap_refuses_an_unknown_key_and_says_which() -> None:
    known, _ = zmq.curve_keypair()
    stranger, _ = zmq.curve_keypair()
    decision = zap_decide(curve_request(zmq.utils.z85.decode(stranger)), {known: "vw0"})
    assert decision.reply[:3] == [b"1.0", b"7", b"400"] and decision.reply[4] == b""
    assert decision.user is None and decision.key == stranger.decode()
    assert "not one of this run's keys" in decision.reason


@pytest.mark.parametrize(
    ("request_frames", "code"),
    [
        ([b"1.0", b"9", b"hetpipe", b"1.2.3.4", b"", b"NULL"], b"400"),
        ([b"1.0", b"9", b"hetpipe", b"1.2.3.4", b"", b"PLAIN", b"user", b"pass"], b"400"),
        ([b"1.0", b"9", b"hetpipe", b"1.2.3.4", b"", b"CURVE", b"short"], b"400"),
        ([b"2.0", b"9", b"hetpipe", b"1.2.3.4", b"", b"CURVE", bytes(32)], b"500"),
        ([b"1.0", b"9"], b"500"),
    ],
)
def test_zap_refuses_anything_but_a_curve_key(request_frames: list[bytes], code: bytes) -> None:
    decision = zap_decide(request_frames, {zmq.curve_keypair()[0]: "vw0"})
    assert decision.user is None
    assert decision.reply[0] == b"1.0" and decision.reply[1] == b"9" and decision.reply[2] == code
    assert len(decision.reply) == 6


def test_refusal_log_logs_each_line_once_per_window_and_counts_repeats() -> None:
    log = RefusalLog(budget=2, window_s=60.0)
    assert log.note("a", now=0.0) == ["a"]
    assert log.note("a", now=0.1) == []  # a client retrying: counted, not logged
    assert log.note("a", now=0.2) == []
    assert log.note("b", now=1.0) == ["b"]
    assert log.note("c", now=2.0) == []  # over the budget of distinct lines
    assert log.note("d", now=59.0) == []
    assert log.note("b", now=61.0) == [
        "a (and 2 more times in the last 61 s)",
        "2 more refusals were not logged in the last 61 s",
        "b",
    ]
    assert log.note("e", now=62.0) == ["e"]
    assert log.note("f", now=200.0) == ["f"]  # nothing repeated or dropped: no count lines

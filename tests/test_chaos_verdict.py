"""chaos.py's verdict per fault (what a run must show to pass), the flood's loopback guard and the small
disk's leftovers, without a run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "bench"))
import chaos  # noqa: E402  (launch/bench is not a package)
import chaos_disk  # noqa: E402
import chaos_flood  # noqa: E402

CLEAN = {"completed": True, "lost": 0, "duplicated": 0, "stray": 0, "victims": [{"target": "x"}]}


def verdict(fault: str, summary: dict | None = None, **fields) -> bool:
    return chaos.passed({**CLEAN, "fault": fault, **fields}, summary or {})


def test_every_fault_needs_a_clean_ledger_and_a_finished_run() -> None:
    assert verdict("kill")
    assert not verdict("kill", duplicated=1)
    assert not verdict("launcher", left=[], completed=False)
    assert not verdict("launcher", left=[], victims=[])  # the run ended before the fault: nothing was shown


def test_a_full_disk_must_stop_the_run_naming_enospc_and_leave_no_temporary_file() -> None:
    named = "error: cannot write /d/run/metrics.jsonl: No space left on device (ENOSPC); free space there"
    assert verdict("full-disk", full_exit=1, enospc_named=named, tmp_left=[])
    assert not verdict("full-disk", full_exit=0, enospc_named=named, tmp_left=[])  # it did not stop
    assert not verdict("full-disk", full_exit=1, enospc_named=None, tmp_left=[])  # a gloo error instead
    assert not verdict("full-disk", full_exit=1, enospc_named=named, tmp_left=["ps/.ckpt-9.bin.tmp"])


def test_a_flood_must_leave_every_checkpoint_written() -> None:
    assert verdict("flood", checkpoint_failures=0, flood_handshakes=900)
    assert not verdict("flood", checkpoint_failures=2, flood_handshakes=900)
    assert not verdict("flood", checkpoint_failures=0, flood_handshakes=0)  # no flood happened


def test_launcher_faults_must_leave_no_process_and_stop_stage_must_evict() -> None:
    assert verdict("corrupt", left=[])
    assert not verdict("corrupt", left=["123 python -m hetpipe.server"])
    assert verdict("stop-stage", {"evicted": [1]}, stopped="vw1-s0", stopped_left=False)
    assert not verdict("stop-stage", {"evicted": []}, stopped="vw1-s0", stopped_left=False)
    assert not verdict("stop-stage", {"evicted": [1]}, stopped="vw1-s0", stopped_left=True)


def test_the_flood_stays_on_loopback() -> None:
    with pytest.raises(ValueError, match="loopback"):
        chaos_flood.Flood("10.77.0.2", 7600, b"k" * 40).start()
    with pytest.raises(ValueError, match="loopback"):
        chaos_flood.Flood("127.0.0.1", 7600, b"k" * 40, source="192.168.1.5").start()


def test_half_written_temporaries_are_found_and_freeing_no_filler_is_harmless(tmp_path: Path) -> None:
    (tmp_path / "ps").mkdir()
    (tmp_path / "ps" / ".ckpt-00000003.bin.tmp").write_bytes(b"half")
    (tmp_path / "ps" / "ckpt-00000002.bin").write_bytes(b"whole")
    assert chaos_disk.temporaries(tmp_path) == ["ps/.ckpt-00000003.bin.tmp"]
    chaos_disk.free(tmp_path)  # no filler yet: nothing to do


def test_the_totals_of_many_runs_count_failures_and_the_flood_rates() -> None:
    import chaos_runs

    base = {"completed": True, "lost": 0, "duplicated": 0, "stray": 0, "ledger_slots": 960}
    flood = [
        {**base, "waves_per_s_before": 2.0, "waves_per_s_during": 1.5, "checkpoint_failures": 0},
        {**base, "waves_per_s_before": 2.4, "waves_per_s_during": 2.0, "checkpoint_failures": 0},
        {**base, "lost": 3, "waves_per_s_before": 2.2, "waves_per_s_during": 1.0, "checkpoint_failures": 1},
    ]
    found = chaos_runs.totals(flood, [0, 0, 1, 1])  # the fourth run wrote no result
    assert (found["runs"], found["passed"], found["no_result"], found["lost"]) == (4, 2, 1, 3)
    assert found["waves_per_s_during"] == {"median": 1.5, "min": 1.0, "max": 2.0}
    assert found["checkpoint_failures"] == 1 and "enospc_named" not in found

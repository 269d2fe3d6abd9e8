"""KV-event stream faults through real processes: a pod's publisher stopped and resumed (the gap
is repaired from its replay buffer), an engine restart (sequence back to 0: old entries cleared),
and a publisher silent while its pod serves (entries aged out, a metric and a log say so).
Duplicated and reordered batches are covered at the subscriber's level in tests/test_subscriber*.py."""

from __future__ import annotations

import pytest

from tests.faults import scenarios

pytestmark = pytest.mark.timeout(90)


async def test_event_gap_restart_and_silence_through_real_processes(tmp_path):
    row = await scenarios.event_faults(tmp_path, silence_s=1.5)
    f = row.figures
    assert row.sent == row.answered, row.saw
    assert f["a_indexed_s"] is not None, f
    assert f["b_cached_while_stopped"] == 0, f          # no events, no (lasting) entry
    assert f["gap_repaired_s"] is not None and f["gap_repaired_s"] < 3, f   # replay filled the gap
    assert f["restart_cleared_s"] is not None and f["restart_cleared_s"] < 3, f
    assert f["d_indexed_after_restart"] is not None, f   # the new stream is followed
    assert f["silence_cleared_s"] is not None and f["silence_cleared_s"] < 1.5 + 3, f
    assert f["d_cached_after_silence"] == 0, f
    assert f["log_says_silent"], "no log line about the silent publisher"

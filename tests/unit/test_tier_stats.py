"""Per-tier statistics: sums, achieved bandwidth, merging, thread safety."""
from __future__ import annotations

import threading

import pytest

from benchmark_scripts import load

TierStats = load("tier_stats").TierStats


def test_gbps_is_bytes_moved_over_busy_time_when_io_recorded():
    s = TierStats()
    s.record_io(0.5, read_bytes=10**9)
    s.record_io(0.5, write_bytes=2 * 10**9)
    assert s.bytes_read == 10**9 and s.bytes_written == 2 * 10**9
    assert s.busy_s == pytest.approx(1.0)
    assert s.gbps == pytest.approx(3.0)


def test_gbps_zero_when_nothing_recorded():
    assert TierStats().gbps == 0.0


def test_merge_sums_every_field_when_two_steps_combined():
    a, b = TierStats(), TierStats()
    a.record_io(1.0, read_bytes=100)
    a.record_token_wait(0.25)
    b.record_io(2.0, write_bytes=50)
    b.record_token_wait(0.5)
    m = a + b
    assert (m.bytes_read, m.bytes_written, m.busy_s, m.token_wait_s, m.token_acquires, m.io_periods) == \
        (100, 50, 3.0, 0.75, 2, 2)
    assert a.bytes_written == 0  # inputs unchanged


def test_as_dict_has_timer_fields_with_prefix():
    s = TierStats()
    s.record_io(2.0, read_bytes=4 * 10**9)
    d = s.as_dict("nvme0-")
    assert d["nvme0-bytes_read"] == 4 * 10**9 and d["nvme0-gbps"] == pytest.approx(2.0)
    assert {"nvme0-busy_s", "nvme0-token_wait_s", "nvme0-bytes_written"} <= set(d)


def test_timed_io_records_elapsed_time_when_used_as_context():
    s = TierStats()
    with s.timed_io(read_bytes=7):
        pass
    assert s.bytes_read == 7 and s.io_periods == 1 and s.busy_s >= 0


def test_negative_record_rejected():
    with pytest.raises(ValueError):
        TierStats().record_io(-1.0)


def test_no_update_lost_when_threads_record_concurrently():
    s = TierStats()

    def work():
        for _ in range(2000):
            s.record_io(0.001, read_bytes=1, write_bytes=2)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (s.bytes_read, s.bytes_written, s.io_periods) == (8000, 16000, 8000)


def test_reset_zeroes_counters():
    s = TierStats()
    s.record_io(1.0, read_bytes=5)
    s.reset()
    assert s.as_dict()["bytes_read"] == 0 and s.busy_s == 0.0

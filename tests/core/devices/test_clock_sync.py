"""NTP-style offset estimation, on made-up timestamps (no sockets)."""

from __future__ import annotations

import pytest

from core.devices.clock_sync import (
    KEPT_SAMPLES,
    ClockEstimate,
    best_estimate,
    clock_sample,
    keep_recent,
    to_coordinator_clock,
)


def test_a_symmetric_probe_recovers_the_agents_offset_exactly():
    # agent clock = coordinator + 5 s; 10 ms each way; the agent holds the probe 2 ms
    s = clock_sample(t0=100.0, t1=105.010, t2=105.012, t3=100.022)
    assert s.offset_s == pytest.approx(5.0) and s.rtt_s == pytest.approx(0.020)


def test_an_asymmetric_probe_is_off_by_at_most_half_its_round_trip():
    s = clock_sample(t0=0.0, t1=5.030, t2=5.030, t3=0.040)  # 30 ms out, 10 ms back
    est = best_estimate([s])
    assert abs(est.offset_s - 5.0) <= est.uncertainty_s and est.uncertainty_s == pytest.approx(0.020)


def test_the_fastest_probe_wins_over_later_slower_ones():
    fast = clock_sample(0.0, 2.001, 2.001, 0.002)
    slow = clock_sample(1.0, 3.100, 3.100, 1.300)
    assert best_estimate([slow, fast, slow]).offset_s == pytest.approx(fast.offset_s)


def test_an_agent_clock_running_behind_while_holding_the_probe_never_gives_a_negative_round_trip():
    assert clock_sample(t0=0.0, t1=1.0, t2=1.5, t3=0.2).rtt_s == 0.0


def test_no_samples_is_no_estimate_and_agent_times_stay_as_they_are():
    assert best_estimate([]) is None
    assert to_coordinator_clock(None, 12.5) == 12.5


def test_agent_times_map_to_the_coordinator_clock_by_subtracting_the_offset():
    assert to_coordinator_clock(ClockEstimate(offset_s=5.0, uncertainty_s=0.001, rtt_s=0.002), 105.25) == 100.25


def test_only_the_most_recent_samples_are_kept():
    samples: tuple = ()
    for i in range(KEPT_SAMPLES + 3):
        samples = keep_recent(samples, clock_sample(i, i + 1.0, i + 1.0, i + 0.001 * (i + 1)))
    assert len(samples) == KEPT_SAMPLES and samples[0].t_received == pytest.approx(3 + 0.004)

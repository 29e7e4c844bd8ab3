"""NTP-style clock offsets between the coordinator and an agent, as pure functions.

For a probe sent at coordinator time t0, received and answered at agent times t1/t2 and
back at t3: ``offset = ((t1 - t0) + (t2 - t3)) / 2`` with error at most
``(t3 - t0 - (t2 - t1)) / 2``. The sample with the smallest round trip wins (queueing
only ever adds delay, so the fastest probe is the least skewed). Agent times map to the
coordinator's clock as ``t - offset``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

KEPT_SAMPLES = 32
"""How many recent probes an estimate is chosen from (old ones age out as clocks drift)."""


@dataclass(frozen=True)
class ClockSample:
    rtt_s: float
    offset_s: float
    t_received: float
    """Coordinator clock when the answer arrived (t3)."""


@dataclass(frozen=True)
class ClockEstimate:
    offset_s: float
    """Agent clock minus coordinator clock."""
    uncertainty_s: float
    rtt_s: float


def clock_sample(t0: float, t1: float, t2: float, t3: float) -> ClockSample:
    """One probe's offset and round trip (the agent's own hold time t2 - t1 excluded)."""
    rtt = max(0.0, (t3 - t0) - (t2 - t1))
    return ClockSample(rtt_s=rtt, offset_s=((t1 - t0) + (t2 - t3)) / 2, t_received=t3)


def keep_recent(samples: Sequence[ClockSample], sample: ClockSample) -> tuple[ClockSample, ...]:
    """``samples`` plus ``sample``, the oldest dropped beyond ``KEPT_SAMPLES``."""
    return (*samples, sample)[-KEPT_SAMPLES:]


def best_estimate(samples: Sequence[ClockSample]) -> ClockEstimate | None:
    """The minimum-RTT sample's offset, uncertain by half its round trip; None without samples."""
    if not samples:
        return None
    best = min(samples, key=lambda s: (s.rtt_s, s.offset_s, s.t_received))
    return ClockEstimate(offset_s=best.offset_s, uncertainty_s=best.rtt_s / 2, rtt_s=best.rtt_s)


def to_coordinator_clock(estimate: ClockEstimate | None, t_agent: float) -> float:
    """An agent timestamp on the coordinator's clock (unchanged before any estimate)."""
    return t_agent - (estimate.offset_s if estimate is not None else 0.0)

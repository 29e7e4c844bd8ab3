"""SLO attainment and goodput: the highest request rate at which 90 % of requests meet both SLOs.

Goodput is found by bisection over the rate: the same requests (``workload.at_rate``) at a
rate bracketed by doubling or halving from a start, then halved in between until the bracket
is within ``rel_tol``. Every step is one simulation, so the search's cost is a few dozen.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import msgspec

from core.techniques.phase_disaggregation.simulator import simulate_pools
from core.techniques.phase_disaggregation.types import (
    SLO, EpdInputError, PhaseCosts, PoolConfig, RequestMetrics, Workload,
)
from core.techniques.phase_disaggregation.workload import at_rate

TARGET = 0.9
"""The fraction of requests that must meet both SLOs (the paper's goodput definition)."""


def attainment(metrics: Sequence[RequestMetrics], slo: SLO) -> float:
    """Fraction of requests meeting both the TTFT and the TPOT SLO."""
    if not metrics:
        return 0.0
    return sum(1 for m in metrics if slo.met(m)) / len(metrics)


class RatePoint(msgspec.Struct, frozen=True, kw_only=True):
    """One simulated rate: what the SLO-attainment chart plots."""

    rate_rps: float
    attainment: float
    ttft_p50_s: float
    tpot_p50_s: float
    ttft_p90_s: float


def rate_point(costs: PhaseCosts, workload: Workload, config: PoolConfig, slo: SLO, rate_rps: float) -> RatePoint:
    return point_of(simulate_pools(costs, at_rate(workload, rate_rps), config).metrics, slo, rate_rps)


def point_of(ms: Sequence[RequestMetrics], slo: SLO, rate_rps: float) -> RatePoint:
    """One rate's point from its requests' metrics, simulated or measured."""
    if not ms:
        raise EpdInputError("a rate point needs at least one request's metrics")
    ttfts = sorted(m.ttft_s for m in ms)
    return RatePoint(rate_rps=rate_rps, attainment=attainment(ms, slo), ttft_p50_s=statistics.median(ttfts),
                     tpot_p50_s=statistics.median(m.tpot_s for m in ms),
                     ttft_p90_s=ttfts[min(len(ttfts) - 1, math.ceil(0.9 * len(ttfts)) - 1)])


class Goodput(msgspec.Struct, frozen=True, kw_only=True):
    rate_rps: float
    """The highest rate found at which ``TARGET`` of the requests meet the SLO (0: not even the lowest)."""
    points: tuple[RatePoint, ...]
    """Every rate simulated on the way, in rate order."""


def goodput(costs: PhaseCosts, workload: Workload, config: PoolConfig, slo: SLO, *, target: float = TARGET,
            start_rps: float = 1.0, rel_tol: float = 0.02, min_rps: float = 1e-3, max_rps: float = 1e5) -> Goodput:
    """Bisection over the rate for the last one meeting ``target`` attainment."""
    if not 0 < target <= 1:
        raise EpdInputError(f"target attainment must be in (0, 1], got {target}")
    if not (0 < min_rps <= start_rps <= max_rps and 0 < rel_tol < 1):
        raise EpdInputError("goodput search needs 0 < min_rps <= start_rps <= max_rps and 0 < rel_tol < 1")
    cap = min(max_rps, capacity_rps(costs, workload, config))
    start_rps = min(start_rps, cap)
    seen: dict[float, RatePoint] = {}

    def ok(rate: float) -> bool:
        if rate not in seen:
            seen[rate] = rate_point(costs, workload, config, slo, rate)
        return seen[rate].attainment >= target

    def done(rate: float) -> Goodput:
        return Goodput(rate_rps=rate, points=tuple(seen[r] for r in sorted(seen)))

    if ok(start_rps):
        lo, hi = start_rps, min(start_rps * 2, cap)
        while hi > lo and ok(hi):
            if hi >= cap:  # met at what the pools can serve: a finite workload hides any queue beyond it
                return done(cap)
            lo, hi = hi, min(hi * 2, cap)
        if hi <= lo:
            return done(lo)
    else:
        lo, hi = start_rps / 2, start_rps
        while not ok(lo):
            lo, hi = lo / 2, lo
            if lo < min_rps:
                return done(0.0)
    while hi - lo > rel_tol * lo:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return done(lo)


def capacity_rps(costs: PhaseCosts, workload: Workload, config: PoolConfig) -> float:
    """The most requests per second ``config``'s pools could sustain on ``workload``'s mix: each
    pool's devices busy all the time at full batch (overheads shared by the batch), the tightest
    pool bounding. Goodput never exceeds it; without it a workload of a few requests, which meets
    the SLO at any rate, bisects up to the search's ceiling (6.55e4 req/s)."""
    reqs = workload.requests
    if not reqs:
        return math.inf
    n = len(reqs)

    def encode(d: str) -> float:
        c = costs.on(d)
        return sum(c.encode_overhead_s / config.encode_batch + r.tiles * c.encode_s_per_tile for r in reqs if r.tiles) / n

    def prefill(d: str) -> float:
        c = costs.on(d)
        return sum(c.prefill_overhead_s / config.prefill_batch + costs.prefill_tokens(r) * c.prefill_s_per_token
                   for r in reqs) / n

    def decode(d: str) -> float:
        return sum(r.output_tokens for r in reqs) / n * costs.decode_step_seconds(config.decode_batch, d) \
            / config.decode_batch

    def pool_rps(devices, seconds) -> float:  # each device at its own speed (PhaseCosts.devices)
        per = [seconds(d) for d in devices]
        return math.inf if any(s <= 0 for s in per) else sum(1 / s for s in per)

    return min(pool_rps(config.encode, encode), pool_rps(config.prefill, prefill), pool_rps(config.decode, decode))


def ladder_goodput(points: Sequence[RatePoint], *, target: float = TARGET) -> float:
    """Goodput from a few rates run for real (too slow to bisect): the highest rate meeting
    ``target`` attainment below which every rate tried met it too (0: not even the lowest)."""
    best = 0.0
    for p in sorted(points, key=lambda p: p.rate_rps):
        if p.attainment < target:
            break
        best = p.rate_rps
    return best


def attainment_curve(costs: PhaseCosts, workload: Workload, config: PoolConfig, slo: SLO,
                     rates: Sequence[float]) -> list[RatePoint]:
    """Attainment and latency at each rate (the studio's SLO chart)."""
    return [rate_point(costs, workload, config, slo, r) for r in rates]


__all__ = ["Goodput", "RatePoint", "TARGET", "attainment", "attainment_curve", "goodput", "ladder_goodput", "point_of",
           "rate_point"]

"""SLO attainment and goodput by bisection over the rate."""

from __future__ import annotations

import pytest

from core.techniques.phase_disaggregation.goodput import RatePoint, attainment, goodput, ladder_goodput, rate_point
from core.techniques.phase_disaggregation.simulator import simulate_pools
from core.techniques.phase_disaggregation.types import SLO, PoolConfig, Workload
from core.techniques.phase_disaggregation.workload import poisson_workload
from tests.techniques.phase_disaggregation.conftest import make_costs, one_request

CFG = PoolConfig(encode=("e0", "e1"), prefill=("p0",), decode=("d0",), irp_degree=2, decode_batch=16)
W = poisson_workload(rate_rps=1.0, requests=80, seed=5, images=(1, 3), tiles_per_image=(2, 4),
                     output_tokens=(8, 24))


def test_attainment_counts_requests_meeting_both_slos():
    ms = simulate_pools(make_costs(), W, CFG).metrics
    loose, none = SLO(ttft_s=1e6, tpot_s=1e6), SLO(ttft_s=1e-6, tpot_s=1e6)
    assert attainment(ms, loose) == 1.0
    assert attainment(ms, none) == 0.0


def test_goodput_is_the_edge_where_attainment_drops_below_ninety_percent():
    slo = SLO(ttft_s=1.5, tpot_s=0.05)
    g = goodput(make_costs(), W, CFG, slo)
    assert g.rate_rps > 0
    assert rate_point(make_costs(), W, CFG, slo, g.rate_rps).attainment >= 0.9
    assert rate_point(make_costs(), W, CFG, slo, g.rate_rps * 1.1).attainment < 0.9


def test_goodput_grows_as_the_slo_loosens():
    rates = [goodput(make_costs(), W, CFG, SLO(ttft_s=t, tpot_s=0.05)).rate_rps for t in (0.8, 1.5, 3.0, 6.0)]
    assert rates == sorted(rates)
    assert rates[-1] > rates[0]


def test_goodput_is_zero_when_even_one_request_alone_misses_the_slo():
    g = goodput(make_costs(), W, CFG, SLO(ttft_s=0.01, tpot_s=0.05))
    assert g.rate_rps == 0.0


def _point(rate, att):
    return RatePoint(rate_rps=rate, attainment=att, ttft_p50_s=0.1, tpot_p50_s=0.01, ttft_p90_s=0.2)


def test_a_ladders_goodput_is_the_last_rate_meeting_the_target_before_one_misses_it():
    points = [_point(2.0, 0.95), _point(1.0, 1.0), _point(4.0, 0.5), _point(8.0, 0.95)]
    assert ladder_goodput(points) == 2.0  # 8 rps meeting it by luck after 4 missed does not count
    assert ladder_goodput([_point(1.0, 0.8)]) == 0.0


def test_a_workload_too_small_to_queue_has_the_goodput_its_busiest_pool_can_serve():
    """Four requests meet any SLO at any rate (nothing queues); the bisection stops at what the
    pools can sustain (here the encode pool: 2 devices, 0.01 s + 4 tiles × 0.05 s a request), not
    at the search's ceiling (it reported 6.55e4 req/s)."""
    few = Workload(requests=tuple(one_request(images=1, tiles=4, prompt=32, output=8, arrival=0.1 * i, rid=i)
                                  for i in range(4)))
    pools = PoolConfig(disaggregation="aggregated", encode=("a", "b"), prefill=("a", "b"), decode=("a", "b"),
                       encode_batch=1, prefill_batch=1, decode_batch=8)
    g = goodput(make_costs(), few, pools, SLO(ttft_s=1e3, tpot_s=1e3))
    assert g.rate_rps == pytest.approx(2 / (0.01 + 4 * 0.05))

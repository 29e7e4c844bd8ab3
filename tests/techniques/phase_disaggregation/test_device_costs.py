"""Per-device phase costs: each device priced at its own measured speeds, in the simulator, the
goodput bound, the search's choice of which device serves which pool, and the per-device fit of a
run against its prediction (hand-computed references, no agents)."""

from __future__ import annotations

import msgspec
import pytest

from core import formats
from core.techniques.phase_disaggregation.goodput import capacity_rps
from core.techniques.phase_disaggregation.on_agents import (
    measurement_rotations, phase_fit, phase_seconds,
)
from core.techniques.phase_disaggregation.search import config_for, device_orders, evaluate, search
from core.techniques.phase_disaggregation.simulator import simulate_pools
from core.techniques.phase_disaggregation.types import (
    SLO, DevicePhaseCosts, EpdInputError, EpdProblem, PhaseCosts, PoolConfig, RequestMetrics,
)
from core.techniques.phase_disaggregation.workload import poisson_workload
from tests.techniques.phase_disaggregation.conftest import make_costs, one_request, single

SLOW = DevicePhaseCosts(device="slow", encode_s_per_tile=0.4, encode_overhead_s=0.08, prefill_s_per_token=8e-4,
                        prefill_overhead_s=0.04, decode_step_s=((1, 0.16), (64, 0.32)))
"""8x the top-level costs (conftest's make_costs) in every phase."""


def test_a_device_with_costs_of_its_own_runs_at_them_and_any_other_at_the_top_level_ones():
    costs = make_costs(devices=(SLOW,))
    assert costs.encode_s(3, "slow") == pytest.approx(0.08 + 3 * 0.4)
    assert costs.encode_s(3, "fast") == costs.encode_s(3) == pytest.approx(0.01 + 3 * 0.05)
    assert costs.prefill_s(100, "slow") == pytest.approx(0.04 + 100 * 8e-4)
    assert costs.decode_step_seconds(1, "slow") == 0.16 and costs.decode_step_seconds(1, "fast") == 0.02


def test_per_device_costs_round_trip_and_a_file_without_them_prices_every_device_alike(tmp_path):
    costs = make_costs(devices=(SLOW,))
    formats.save(tmp_path / "c.json", costs)
    assert formats.load(tmp_path / "c.json", PhaseCosts) == costs
    assert make_costs().devices == () and make_costs().encode_s(1, "slow") == make_costs().encode_s(1)


def test_a_device_listed_twice_or_with_a_bad_phase_time_is_refused_naming_it():
    with pytest.raises(EpdInputError, match="appear twice"):
        make_costs(devices=(SLOW, SLOW))
    with pytest.raises(EpdInputError, match="slow: encode_s_per_tile must be > 0"):
        msgspec.structs.replace(SLOW, encode_s_per_tile=0.0)


def test_the_simulator_times_each_phase_on_the_device_that_serves_it():
    costs, req = make_costs(devices=(SLOW,)), one_request(images=1, tiles=2, output=5)
    m = simulate_pools(costs, single(req), PoolConfig(encode=("slow",), prefill=("p",), decode=("d",))).metrics[0]
    assert m.encode_end_s - m.encode_start_s == pytest.approx(0.08 + 2 * 0.4)
    assert m.prefill_end_s - m.prefill_start_s == pytest.approx(costs.prefill_s(costs.prefill_tokens(req)))
    m = simulate_pools(costs, single(req), PoolConfig(encode=("e",), prefill=("p",), decode=("slow",))).metrics[0]
    assert m.decode_end_s - m.pd_transfer_end_s == pytest.approx(4 * 0.16)


def test_a_pools_capacity_adds_each_devices_own_rate():
    costs = make_costs(devices=(SLOW,))
    w = single(one_request(images=0, output=2))
    pools = PoolConfig(disaggregation="aggregated", encode=("a", "slow"), prefill=("a", "slow"), decode=("a", "slow"))
    prefill = costs.prefill_s(costs.prefill_tokens(w.requests[0]))
    decode = 2 * costs.decode_step_seconds(8) / 8
    slow_prefill, slow_decode = costs.prefill_s(costs.prefill_tokens(w.requests[0]), "slow"), \
        2 * costs.decode_step_seconds(8, "slow") / 8
    assert capacity_rps(costs, w, pools) == pytest.approx(min(1 / prefill + 1 / slow_prefill,
                                                              1 / decode + 1 / slow_decode))


def _problem(costs: PhaseCosts) -> EpdProblem:
    w = poisson_workload(rate_rps=4.0, requests=12, seed=1, images=(1, 2), tiles_per_image=(1, 2),
                         prompt_tokens=(8, 16), output_tokens=(6, 10))
    return EpdProblem(costs=costs, workload=w, slo=SLO(ttft_s=0.5, tpot_s=0.05), devices=("slow", "b", "c"))


def test_devices_priced_alike_keep_the_problems_order_and_priced_apart_are_tried_in_every_order():
    assert device_orders(_problem(make_costs())) == (("slow", "b", "c"),)
    assert len(device_orders(_problem(make_costs(devices=(SLOW,))))) == 6


def test_the_search_keeps_the_heaviest_phase_off_a_device_eight_times_slower():
    problem = _problem(make_costs(devices=(SLOW,)))  # encode (up to 4 tiles) is the heaviest phase here
    best = search(problem, modes=("epd",), trials=12, seed=0).best
    in_order = evaluate(problem, config_for(problem, "epd", (1, 1, 1)))  # the problem's order: slow encodes
    assert best.config.encode != ("slow",) and in_order.config.encode == ("slow",)
    assert best.goodput_rps > in_order.goodput_rps


def test_measurement_rotations_time_every_phase_on_every_agent_once():
    rotations = measurement_rotations(["a", "b", "c"])
    for phase in ("encode", "prefill", "decode"):
        assert sorted(getattr(p, phase)[0] for p in rotations) == ["a", "b", "c"]
    assert [(p.disaggregation, p.encode, p.decode) for p in measurement_rotations(["a", "b"])] == [
        ("pd", ("a",), ("b",)), ("pd", ("b",), ("a",))]
    assert len(measurement_rotations(["a"])) == 1


def _metrics(rid, enc, pre, dec, *, encode_s, prefill_s, token_s, tokens=5) -> RequestMetrics:
    return RequestMetrics(request_id=rid, arrival_s=0.0, encode_start_s=0.0, encode_end_s=encode_s,
                          ep_transfer_end_s=encode_s, prefill_start_s=encode_s, prefill_end_s=encode_s + prefill_s,
                          pd_transfer_end_s=encode_s + prefill_s,
                          decode_end_s=encode_s + prefill_s + (tokens - 1) * token_s, output_tokens=tokens,
                          encode_devices=(enc,), prefill_device=pre, decode_device=dec)


def test_phase_fit_sets_each_devices_median_phase_time_predicted_beside_measured():
    measured = [_metrics(0, "a", "b", "c", encode_s=0.01, prefill_s=0.02, token_s=0.003),
                _metrics(1, "a", "b", "c", encode_s=0.03, prefill_s=0.04, token_s=0.005),
                _metrics(2, "a", "b", "c", encode_s=0.02, prefill_s=0.03, token_s=0.004)]
    predicted = [_metrics(0, "a", "b", "c", encode_s=0.01, prefill_s=0.06, token_s=0.002)]
    assert phase_seconds(measured) == pytest.approx({("a", "encode"): 0.02, ("b", "prefill"): 0.03,
                                                     ("c", "decode"): 0.004})
    fit = phase_fit(predicted, measured)
    assert [(f.device, f.phase) for f in fit] == [("a", "encode"), ("b", "prefill"), ("c", "decode")]
    assert [f.ratio for f in fit] == pytest.approx([0.5, 2.0, 0.5])


def test_the_tiles_trip_to_the_encode_agent_comes_before_its_span_and_the_request_ends_as_late():
    """An agent times its encode from when its compute starts, after the tiles' control hop: the
    simulated span is the compute (by hand: 0.08 + 2 x (0.4 - 0.1)), the trip before it, the worker
    busy for both, so everything after the encode happens when it did with the trip in the span."""
    req, pools = one_request(images=1, tiles=2, output=5), PoolConfig(encode=("slow",), prefill=("p",), decode=("d",))
    inside = simulate_pools(make_costs(devices=(SLOW,)), single(req), pools).metrics[0]
    trip = msgspec.structs.replace(SLOW, encode_input_s_per_tile=0.1)
    m = simulate_pools(make_costs(devices=(trip,)), single(req), pools).metrics[0]
    assert m.encode_start_s - inside.encode_start_s == pytest.approx(2 * 0.1)
    assert m.encode_end_s - m.encode_start_s == pytest.approx(0.08 + 2 * (0.4 - 0.1))
    assert (m.encode_end_s, m.ttft_s, m.e2e_s) == pytest.approx((inside.encode_end_s, inside.ttft_s, inside.e2e_s))


def test_a_tiles_trip_longer_than_its_encode_cost_is_refused_naming_the_device():
    with pytest.raises(EpdInputError, match="slow: encode_input_s_per_tile .* is part of encode_s_per_tile"):
        msgspec.structs.replace(SLOW, encode_input_s_per_tile=0.5)

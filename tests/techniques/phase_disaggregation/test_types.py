"""EPD's shared types validate at construction and round-trip through their JSON formats."""

from __future__ import annotations

import pytest

from core import formats
from core.errors import FormatError
from core.techniques.phase_disaggregation.types import (
    SLO, EpdInputError, PhaseCosts, PoolConfig, Request, RequestMetrics, Workload, load_costs, save_costs,
)


def costs(**kw) -> PhaseCosts:
    base = dict(encode_s_per_tile=0.01, mm_tokens_per_tile=16, prefill_s_per_token=1e-4,
                decode_step_s=((1, 0.01), (8, 0.02)), mm_token_bytes=128, kv_token_bytes=512, link_bandwidth_Bps=1e8)
    return PhaseCosts(**(base | kw))


def test_costs_round_trip_through_their_file(tmp_path):
    c = costs(source="test")
    save_costs(tmp_path / "c.json", c)
    assert load_costs(tmp_path / "c.json") == c


def test_costs_file_with_a_negative_phase_time_names_the_problem(tmp_path):
    p = tmp_path / "c.json"
    p.write_bytes(formats.encode(costs()).replace(b'"encode_s_per_tile": 0.01', b'"encode_s_per_tile": -1'))
    with pytest.raises(FormatError, match="encode_s_per_tile must be > 0"):
        load_costs(p)


def test_a_costs_file_older_than_the_dispatch_delay_loads_with_none_and_a_negative_one_is_refused(tmp_path):
    p = tmp_path / "c.json"
    p.write_bytes(formats.encode(costs()).replace(b',\n  "dispatch_delay_s": 0.0', b""))
    assert b"dispatch_delay_s" not in p.read_bytes() and load_costs(p).dispatch_delay_s == 0.0
    p.write_bytes(formats.encode(costs()).replace(b'"dispatch_delay_s": 0.0', b'"dispatch_delay_s": -0.01'))
    with pytest.raises(FormatError, match="dispatch_delay_s must be >= 0"):
        load_costs(p)


def test_decode_step_time_interpolates_between_and_extends_beyond_the_points():
    c = costs()
    assert c.decode_step_seconds(1) == pytest.approx(0.01)
    assert c.decode_step_seconds(8) == pytest.approx(0.02)
    assert 0.01 < c.decode_step_seconds(4) < 0.02
    assert c.decode_step_seconds(15) == pytest.approx(0.03)


def test_decode_points_must_increase_in_batch():
    with pytest.raises(EpdInputError, match="increase"):
        costs(decode_step_s=((4, 0.01), (2, 0.02)))


def test_request_rejects_zero_output_tokens():
    with pytest.raises(EpdInputError, match="output_tokens"):
        Request(id=0, arrival_s=0.0, images=1, tiles_per_image=2, prompt_tokens=8, output_tokens=0)


def test_workload_rejects_requests_out_of_arrival_order():
    a = Request(id=0, arrival_s=1.0, images=1, tiles_per_image=1, prompt_tokens=4, output_tokens=4)
    b = Request(id=1, arrival_s=0.5, images=1, tiles_per_image=1, prompt_tokens=4, output_tokens=4)
    with pytest.raises(EpdInputError, match="arrival order"):
        Workload(requests=(a, b))


def test_epd_pools_must_be_disjoint():
    with pytest.raises(EpdInputError, match="disjoint"):
        PoolConfig(encode=("a",), prefill=("a",), decode=("b",))


def test_irp_degree_cannot_exceed_encode_devices():
    with pytest.raises(EpdInputError, match="irp_degree"):
        PoolConfig(encode=("e",), prefill=("p",), decode=("d",), irp_degree=2)


def test_pd_only_couples_encode_to_prefill():
    cfg = PoolConfig(disaggregation="pd", encode=("p",), prefill=("p",), decode=("d",))
    assert cfg.devices == ("p", "d")
    with pytest.raises(EpdInputError, match="prefill pool"):
        PoolConfig(disaggregation="pd", encode=("e",), prefill=("p",), decode=("d",))


def test_metrics_give_ttft_tpot_and_e2e():
    m = RequestMetrics(request_id=0, arrival_s=1.0, encode_start_s=1.0, encode_end_s=1.5, ep_transfer_end_s=1.6,
                       prefill_start_s=1.6, prefill_end_s=2.0, pd_transfer_end_s=2.1, decode_end_s=3.0,
                       output_tokens=11)
    assert m.ttft_s == pytest.approx(1.0)
    assert m.tpot_s == pytest.approx(0.1)
    assert m.e2e_s == pytest.approx(2.0)
    assert SLO(ttft_s=1.0, tpot_s=0.1).met(m)
    assert not SLO(ttft_s=0.9, tpot_s=0.1).met(m)


def test_metrics_reject_times_out_of_order():
    with pytest.raises(EpdInputError, match="before"):
        RequestMetrics(request_id=0, arrival_s=1.0, encode_start_s=1.0, encode_end_s=0.5, ep_transfer_end_s=1.6,
                       prefill_start_s=1.6, prefill_end_s=2.0, pd_transfer_end_s=2.1, decode_end_s=3.0,
                       output_tokens=2)

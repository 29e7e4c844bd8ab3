"""The pools simulator's invariants, one behaviour each, on small hand-checkable workloads."""

from __future__ import annotations

import msgspec
import pytest

from core.techniques.phase_disaggregation.simulator import link_lane, simulate_pools
from core.techniques.phase_disaggregation.types import EpdInputError, PoolConfig, Workload
from tests.techniques.phase_disaggregation.conftest import make_costs, one_request, single

EPD = dict(encode=("e0",), prefill=("p0",), decode=("d0",))


def test_one_request_alone_has_ttft_of_encode_plus_transfer_plus_prefill(costs):
    req = one_request(images=2, tiles=4)
    m = simulate_pools(costs, single(req), PoolConfig(**EPD)).metrics[0]
    expected = (costs.encode_s(req.tiles) + costs.transfer_s(costs.mm_tokens(req) * costs.mm_token_bytes)
                + costs.prefill_s(costs.prefill_tokens(req)))
    assert m.ttft_s == pytest.approx(expected)


def test_the_dispatch_delay_starts_a_request_that_much_after_its_arrival_and_adds_to_its_ttft(costs):
    req, pools = one_request(arrival=0.5), PoolConfig(**EPD)
    base = simulate_pools(costs, single(req), pools).metrics[0]
    m = simulate_pools(make_costs(dispatch_delay_s=0.04), single(req), pools).metrics[0]
    assert m.arrival_s == base.arrival_s == 0.5 and m.encode_start_s == pytest.approx(0.54)
    assert m.ttft_s == pytest.approx(base.ttft_s + 0.04) and m.tpot_s == pytest.approx(base.tpot_s)


def test_one_request_alone_has_tpot_of_one_decode_step_after_its_kv_moves(costs):
    req = one_request(output=5)
    m = simulate_pools(costs, single(req), PoolConfig(**EPD)).metrics[0]
    kv = costs.transfer_s(costs.prefill_tokens(req) * costs.kv_token_bytes)
    assert m.pd_transfer_end_s - m.prefill_end_s == pytest.approx(kv)
    assert m.decode_end_s - m.pd_transfer_end_s == pytest.approx(4 * costs.decode_step_seconds(1))


def test_irp_splits_one_requests_tiles_and_lowers_its_ttft(costs):
    req = one_request(images=4, tiles=4)
    one = simulate_pools(costs, single(req), PoolConfig(encode=("e0", "e1"), prefill=("p0",), decode=("d0",)))
    two = simulate_pools(costs, single(req), PoolConfig(encode=("e0", "e1"), prefill=("p0",), decode=("d0",),
                                                       irp_degree=2))
    share = costs.encode_s(8) + costs.transfer_s(8 * costs.mm_tokens_per_tile * costs.mm_token_bytes)
    assert two.metrics[0].ttft_s == pytest.approx(share + costs.prefill_s(costs.prefill_tokens(req)))
    assert two.metrics[0].ttft_s < one.metrics[0].ttft_s
    assert set(two.metrics[0].encode_devices) == {"e0", "e1"}


def test_pd_only_encodes_on_the_prefill_device_with_no_transfer(costs):
    req = one_request()
    m = simulate_pools(costs, single(req), PoolConfig(disaggregation="pd", encode=("p0",), prefill=("p0",),
                                                      decode=("d0",))).metrics[0]
    assert m.ttft_s == pytest.approx(costs.encode_s(req.tiles) + costs.prefill_s(costs.prefill_tokens(req)))
    assert m.encode_devices == ("p0",) and m.decode_device == "d0"


def test_aggregated_prefill_of_a_new_request_stalls_a_running_decode(costs):
    first = one_request(output=40, rid=0)
    second = one_request(arrival=0.5, rid=1)
    w = Workload(requests=(first, second))
    agg = simulate_pools(costs, w, PoolConfig(disaggregation="aggregated", encode=("a",), prefill=("a",),
                                              decode=("a",))).metrics[0]
    alone = simulate_pools(costs, single(first), PoolConfig(disaggregation="aggregated", encode=("a",),
                                                            prefill=("a",), decode=("a",))).metrics[0]
    assert agg.ttft_s == pytest.approx(alone.ttft_s)
    assert agg.tpot_s > alone.tpot_s * 1.2


def test_continuous_batching_runs_concurrent_requests_in_one_step(costs):
    w = Workload(requests=(one_request(rid=0, output=9), one_request(rid=1, output=60, images=0)))
    ms = simulate_pools(costs, w, PoolConfig(**EPD, decode_batch=2), record=True)
    steps = [e for e in ms.events if e.device == "d0" and e.kind == "compute"]
    assert any(e.duration_s == pytest.approx(costs.decode_step_seconds(2)) for e in steps)
    serial = simulate_pools(costs, w, PoolConfig(**EPD, decode_batch=1))
    assert max(m.decode_end_s for m in ms.metrics) < max(m.decode_end_s for m in serial.metrics)


def test_back_pressure_keeps_the_encode_cache_within_its_size():
    costs = make_costs(link_bandwidth_Bps=2e6)  # a slow link: encoded tokens pile up before they are sent
    reqs = tuple(one_request(rid=i, images=1, tiles=2, arrival=0.0) for i in range(6))
    cap = 2 * 2 * 64  # two requests' tokens
    sim = simulate_pools(costs, Workload(requests=reqs), PoolConfig(**EPD, mm_cache_tokens=cap))
    out = next(c for c in sim.caches if c.side == "encode-out")
    assert out.peak_tokens == cap
    assert all(c.peak_tokens <= c.capacity_tokens for c in sim.caches)


def test_a_full_prefill_cache_holds_back_the_next_requests_encode(costs):
    a, b = one_request(rid=0), one_request(rid=1)
    cap = costs.mm_tokens(a)  # room for one request on the prefill side
    ms = simulate_pools(costs, Workload(requests=(a, b)), PoolConfig(encode=("e0", "e1"), prefill=("p0",),
                                                                     decode=("d0",), mm_cache_tokens=cap)).metrics
    assert ms[1].encode_start_s >= ms[0].prefill_end_s


def test_kv_cache_room_decides_when_the_next_kv_moves(costs):
    a, b = one_request(rid=0, output=20), one_request(rid=1, output=20)
    need = costs.prefill_tokens(a) + a.output_tokens
    ms = simulate_pools(costs, Workload(requests=(a, b)), PoolConfig(**EPD, kv_cache_tokens=need)).metrics
    assert ms[1].pd_transfer_end_s >= ms[0].decode_end_s


def test_a_request_larger_than_the_multimodal_cache_is_refused_up_front(costs):
    with pytest.raises(EpdInputError, match="raise mm_cache_tokens"):
        simulate_pools(costs, single(one_request(images=4)), PoolConfig(**EPD, mm_cache_tokens=100))


def test_recorded_run_has_every_token_and_the_shared_events(costs):
    w = Workload(requests=tuple(one_request(rid=i, arrival=0.1 * i, output=6) for i in range(4)))
    sim = simulate_pools(costs, w, PoolConfig(encode=("e0", "e1"), prefill=("p0",), decode=("d0",), irp_degree=2),
                         record=True)
    assert sum(len(t.token_ids) for t in sim.tokens) == 4 * 6
    assert {e.stage for e in sim.events if e.kind == "compute"} == {0, 1, 2}
    assert any(e.device == link_lane("e0") and e.kind == "send" and e.peer == "p0" for e in sim.events)
    assert sim.figures.ttft_s == pytest.approx(min(m.prefill_end_s for m in sim.metrics))


def test_shortest_first_serves_the_small_request_before_the_big_one(costs):
    busy = one_request(rid=0, images=2, arrival=0.0)  # keeps the encoder busy while the other two queue
    big, small = one_request(rid=1, images=4, arrival=0.1), one_request(rid=2, images=1, arrival=0.1)
    w = Workload(requests=(busy, big, small))
    cfg = dict(encode=("e0",), prefill=("p0",), decode=("d0",))
    fcfs = simulate_pools(costs, w, PoolConfig(**cfg)).metrics
    sjf = simulate_pools(costs, w, PoolConfig(**cfg, policy="shortest-first")).metrics
    assert fcfs[1].encode_start_s < fcfs[2].encode_start_s
    assert sjf[2].encode_start_s < sjf[1].encode_start_s


def test_a_recorded_simulation_is_stored_with_its_workload_and_metrics_and_an_unrecorded_one_is_refused(
        costs, tmp_path):
    from core.sessions.store import SessionStore
    from core.techniques.phase_disaggregation.simulator import record_simulation

    w = Workload(requests=tuple(one_request(rid=i, arrival=0.1 * i, output=3) for i in range(2)))
    pools = PoolConfig(**EPD)
    with SessionStore(tmp_path / "ws.sqlite") as store:
        sid = store.create_session("epd")
        run_id = record_simulation(store, sid, simulate_pools(costs, w, pools, record=True), model="sim",
                                   workload=w, pools=pools)
        with pytest.raises(EpdInputError, match="record=True"):
            record_simulation(store, sid, simulate_pools(costs, w, pools), model="sim", workload=w, pools=pools)
        info, tokens = store.run(run_id), store.tokens(run_id)
    assert info.kind == "predicted" and msgspec.convert(info.settings["workload"], Workload) == w
    assert len(info.settings["metrics"]) == 2 and "tokens" not in info.settings and len(tokens) == 2 * 3

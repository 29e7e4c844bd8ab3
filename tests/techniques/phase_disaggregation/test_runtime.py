"""EPD for real on four local agents over CurveZMQ (two encode, one prefill, one decode): a
workload's tokens equal the single-process generate(), every request's metrics are in order and
its phases are on the timeline; bad requests are refused by name and the agents stay up."""

from __future__ import annotations

import pytest
import torch

from agents.techniques.phase_disaggregation.phases import to_bytes
from agents.protocol import AgentState, SamplingSpec
from agents.techniques.phase_disaggregation.messages import EncodeTiles
from core.errors import RunFailed
from core.techniques.phase_disaggregation.runtime import (
    load_pools,
    prepare_requests,
    reference_tokens,
    run_epd,
)
from core.techniques.phase_disaggregation.types import EpdInputError, PoolConfig, Request, Workload
from tests.techniques.phase_disaggregation.conftest import local_agents

POOLS = PoolConfig(encode=("local-0", "local-1"), prefill=("local-2",), decode=("local-3",), irp_degree=2,
                   decode_batch=1)


def workload(n=4, gap_s=0.05, tiles=4, output=6) -> Workload:
    return Workload(requests=tuple(Request(id=i, arrival_s=gap_s * i, images=1 if i % 3 else 2, tiles_per_image=tiles,
                                           prompt_tokens=6 + i, output_tokens=output) for i in range(n)))


@pytest.fixture(scope="module")
def link(tmp_path_factory, model):
    with local_agents(tmp_path_factory.mktemp("epd-run"), 4) as link:
        load_pools(link, model, POOLS)
        yield link


@pytest.mark.parametrize("transfers", ["data-plane", "relay"])
def test_a_workloads_tokens_over_three_pools_equal_the_single_process_generate(link, model, transfers):
    wl = workload()
    prepared = prepare_requests(model, wl)
    run = run_epd(link, model, wl, POOLS, prepared=prepared, load=False, transfers=transfers)
    assert run.tokens == reference_tokens(model, prepared)
    assert all(len(t) == 6 for t in run.tokens.values())


def test_on_the_data_plane_tokens_go_encode_to_prefill_and_kv_prefill_to_decode(link, model):
    run = run_epd(link, model, workload(n=2), POOLS, load=False)
    sends = {(e.device, e.peer) for e in run.events if e.kind == "send"}
    assert sends == {("local-0:link", "local-2"), ("local-1:link", "local-2"), ("local-2:link", "local-3")}
    kv = [e for e in run.events if e.kind == "send" and e.peer == "local-3"]
    assert all(e.nbytes == 2 * 2 * 2 * 16 * 4 * (len(prepare_requests(model, workload(n=2))[e.micro_batch].input_ids))
               for e in kv)


def test_on_the_data_plane_decode_is_asked_for_with_the_prefill_so_it_starts_when_the_kv_cache_arrives(link, model):
    wl = workload(n=3, gap_s=1.5)  # spaced: the decode agent is free when each prefill is asked for
    prepared = prepare_requests(model, wl)
    run = run_epd(link, model, wl, POOLS, prepared=prepared, load=False)
    assert run.tokens == reference_tokens(model, prepared)
    for m in run.metrics:
        asked = {e.stage: e.start_s for e in run.events
                 if e.kind == "recv_wait" and e.micro_batch == m.request_id and e.stage in (1, 2)}
        assert asked[2] <= m.prefill_start_s  # not after the coordinator heard from the prefill agent
        assert m.prefill_end_s <= m.pd_transfer_end_s <= m.decode_end_s


def test_seeded_sampling_over_three_pools_equals_generate_with_that_seed(link, model):
    wl = workload(n=2)
    prepared = prepare_requests(model, wl)
    sampling = SamplingSpec(temperature=0.8, top_k=40, top_p=0.95, seed=5)
    run = run_epd(link, model, wl, POOLS, prepared=prepared, sampling=sampling, load=False)
    assert run.tokens == reference_tokens(model, prepared, sampling)


def test_each_request_is_encoded_on_irp_degree_agents_and_its_metrics_are_in_phase_order(link, model):
    run = run_epd(link, model, workload(), POOLS, load=False)
    for m in run.metrics:
        assert set(m.encode_devices) == {"local-0", "local-1"}
        assert m.prefill_device == "local-2" and m.decode_device == "local-3"
        assert m.arrival_s <= m.encode_start_s <= m.encode_end_s <= m.ep_transfer_end_s <= m.prefill_start_s
        assert m.prefill_end_s <= m.pd_transfer_end_s <= m.decode_end_s and m.ttft_s > 0 and m.tpot_s > 0
        computes = {(e.device, e.stage) for e in run.events if e.micro_batch == m.request_id and e.kind == "compute"}
        assert computes == {("local-0", 0), ("local-1", 0), ("local-2", 1), ("local-3", 2)}
    assert run.figures.tokens == sum(len(t) for t in run.tokens.values())
    assert [t.t_s for t in run.token_events] == sorted(t.t_s for t in run.token_events)


def test_requests_arriving_together_wait_for_a_free_agent_and_none_is_lost(link, model):
    wl = workload(n=5, gap_s=0.0, output=4)
    run = run_epd(link, model, wl, POOLS, load=False)
    assert sorted(run.tokens) == [0, 1, 2, 3, 4]
    prefills = sorted((m.prefill_start_s, m.prefill_end_s) for m in run.metrics)
    assert all(b[0] >= a[1] - 1e-6 for a, b in zip(prefills, prefills[1:]))  # one at a time on local-2


def test_a_multimodal_cache_too_small_for_one_request_is_refused_before_anything_is_sent(link, model):
    small = PoolConfig(encode=POOLS.encode, prefill=POOLS.prefill, decode=POOLS.decode, decode_batch=1,
                       mm_cache_tokens=32)
    with pytest.raises(EpdInputError, match="raise mm_cache_tokens"):
        run_epd(link, model, workload(n=1), small, load=False)


def test_batched_pools_are_refused_for_a_real_run(link, model):
    with pytest.raises(EpdInputError, match="batch"):
        run_epd(link, model, workload(n=1), PoolConfig(encode=("local-0",), prefill=("local-2",),
                                                       decode=("local-3",), prefill_batch=4), load=False)


def test_tiles_of_the_wrong_size_are_refused_by_the_agent_which_stays_ready(link):
    bad = EncodeTiles(request=9, tiles=(0,), shape=(1, 3, 8, 8), data=to_bytes(torch.zeros(1, 3, 8, 8)))
    with pytest.raises(RunFailed, match=r"N×3×32×32"):
        link.request("local-0", bad)
    assert link.status_of(["local-0"])["local-0"].state is AgentState.READY


def test_a_phase_request_to_the_wrong_pool_is_refused_by_name(link):
    tiles = torch.zeros(1, 3, 32, 32)
    with pytest.raises(RunFailed, match="serves decode_tokens, not encode_tiles"):
        link.request("local-3", EncodeTiles(request=1, tiles=(0,), shape=(1, 3, 32, 32), data=to_bytes(tiles)))


def test_a_run_is_recorded_and_replays_with_its_phases_and_metrics(link, model, tmp_path):
    import msgspec

    from core.sessions.replay import Replay
    from core.sessions.store import SessionStore
    from core.techniques.phase_disaggregation.runtime import record_epd_run
    from core.techniques.phase_disaggregation.types import RequestMetrics

    wl = workload(n=2)
    run = run_epd(link, model, wl, POOLS, load=False)
    with SessionStore(tmp_path / "ws.sqlite") as store:
        run_id = record_epd_run(store, store.create_session("epd"), run, model="tiny-llava", workload=wl, pools=POOLS)
        info = store.run(run_id)
        replay = Replay.from_store(store, run_id)
        replay.seek(replay.duration_s)
    assert info.settings["technique"] == "phase-disaggregation" and info.status == "completed"
    assert msgspec.convert(info.settings["metrics"], tuple[RequestMetrics, ...]) == run.metrics
    assert replay.duration_s == pytest.approx(max(max(e.end_s for e in run.events),
                                                  max(t.t_s for t in run.token_events)), abs=1e-6)
    assert replay.figures().tokens == run.figures.tokens == info.figures["tokens"]
    assert {(e.device, e.stage) for e in run.events if e.kind == "compute"} == \
        {(i.event.device, i.event.stage) for i in replay.delivered() if i.event and i.event.kind == "compute"}


def test_profiled_phase_costs_fit_the_checkpoint_and_grow_with_the_work(link, model):
    from core.models.multimodal import check_multimodal_dir
    from core.techniques.phase_disaggregation.profiling import profile_phases

    info = check_multimodal_dir(model)
    costs = profile_phases(link, model, POOLS, tiles=(1, 4), prompt_tokens=(16, 96), decode_batches=(1, 4),
                           decode_steps=4, repeats=3)
    assert costs.mm_tokens_per_tile == 16 and costs.mm_token_bytes == info.hidden * 4
    assert costs.kv_token_bytes == info.layers * 2 * info.kv_heads * info.head_dim * 4
    assert costs.encode_s(4) > costs.encode_s(1) > 0 and costs.prefill_s(96) > costs.prefill_s(16) > 0
    assert costs.decode_step_seconds(4) >= costs.decode_step_seconds(1) > 0
    assert "local-0" in costs.source and costs.link_bandwidth_Bps > 0
    # the release → encode start less the tile's fitted transfer: sub-ms on loopback, so noise may clamp it to 0
    assert 0 <= costs.dispatch_delay_s < 1.0


def test_each_replys_events_carry_the_uncertainty_of_the_one_clock_estimate_their_times_were_mapped_with(link, model):
    """Heartbeats refine a device's clock estimate while a run goes on; here every read of the link gives a
    newer one (1 ms more uncertain each read). A reply's times are mapped with one estimate, so its
    recv_wait, compute and outgoing send all carry that estimate's uncertainty (they carried later reads')."""
    import dataclasses
    import itertools

    reads, clock_of = itertools.count(), link.clock_of

    def refining(device):
        estimate = clock_of(device)
        return None if estimate is None else dataclasses.replace(
            estimate, uncertainty_s=estimate.uncertainty_s + next(reads) * 1e-3)

    link.clock_of = refining
    try:
        run = run_epd(link, model, workload(n=2), POOLS, load=False)
    finally:
        del link.clock_of
    replies = {}
    for e in run.events:
        if e.kind in ("recv_wait", "compute"):
            replies.setdefault((e.device, e.stage, e.micro_batch, e.start_s if e.kind == "compute" else e.end_s),
                               set()).add(e.clock_uncertainty_s)
    assert len(replies) >= 6 and all(len(u) == 1 for u in replies.values())
    computes = {(e.device, e.micro_batch, e.end_s): e.clock_uncertainty_s for e in run.events if e.kind == "compute"}
    sends = [e for e in run.events if e.kind == "send"]
    assert sends and all(e.clock_uncertainty_s == computes[(e.device.removesuffix(":link"), e.micro_batch, e.start_s)]
                         for e in sends)

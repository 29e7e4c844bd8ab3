"""The baselines' layouts run for real on the same agents and runtime as EPD: PD-only (encode
coupled to prefill on one agent, DistServe-style, decode apart) and aggregated (one agent does all
three phases). A hand-off between phases on one agent stays there; tokens equal generate()."""

from __future__ import annotations

import pytest

from agents.protocol import SamplingSpec
from core.techniques.phase_disaggregation.runtime import prepare_requests, reference_tokens, run_epd
from core.techniques.phase_disaggregation.types import PoolConfig, Request, Workload
from tests.techniques.phase_disaggregation.conftest import local_agents

PD = PoolConfig(disaggregation="pd", encode=("local-0", "local-1"), prefill=("local-0", "local-1"),
                decode=("local-2",), decode_batch=1)
AGGREGATED = PoolConfig(disaggregation="aggregated", encode=("local-0", "local-1", "local-2"),
                        prefill=("local-0", "local-1", "local-2"), decode=("local-0", "local-1", "local-2"),
                        decode_batch=1)


def workload(n=4, gap_s=0.05, output=5) -> Workload:
    return Workload(requests=tuple(Request(id=i, arrival_s=gap_s * i, images=1 + i % 2, tiles_per_image=2,
                                           prompt_tokens=6 + i, output_tokens=output) for i in range(n)))


@pytest.fixture(scope="module")
def link(tmp_path_factory):
    with local_agents(tmp_path_factory.mktemp("epd-layouts"), 3) as link:
        yield link


@pytest.mark.parametrize("pools", [PD, AGGREGATED], ids=["pd", "aggregated"])
@pytest.mark.parametrize("transfers", ["data-plane", "relay"])
def test_a_coupled_layouts_tokens_equal_the_single_process_generate(link, model, pools, transfers):
    wl = workload()
    prepared = prepare_requests(model, wl)
    run = run_epd(link, model, wl, pools, prepared=prepared, transfers=transfers)
    assert run.tokens == reference_tokens(model, prepared)


def test_pd_only_encodes_and_prefills_a_request_on_one_agent_and_only_the_kv_cache_crosses_a_link(link, model):
    run = run_epd(link, model, workload(), PD)
    for m in run.metrics:
        assert m.encode_devices == (m.prefill_device,) and m.prefill_device in PD.prefill
        assert m.decode_device == "local-2"
    sends = [e for e in run.events if e.kind == "send"]
    assert len(sends) == len(run.metrics)  # one KV cache each, no multimodal tokens
    assert all(e.stage == 1 and e.peer == "local-2" and e.nbytes > 0 for e in sends)


def test_aggregated_runs_all_three_phases_of_a_request_on_one_agent_with_no_send(link, model):
    run = run_epd(link, model, workload(), AGGREGATED)
    for m in run.metrics:
        assert m.encode_devices == (m.prefill_device,) and m.decode_device == m.prefill_device
        stages = {(e.device, e.stage) for e in run.events if e.micro_batch == m.request_id and e.kind == "compute"}
        assert stages == {(m.prefill_device, 0), (m.prefill_device, 1), (m.prefill_device, 2)}
    assert not [e for e in run.events if e.kind == "send"]


def test_seeded_sampling_on_the_aggregated_layout_equals_generate_with_that_seed(link, model):
    wl = workload(n=2)
    prepared = prepare_requests(model, wl)
    sampling = SamplingSpec(temperature=0.8, top_k=40, top_p=0.95, seed=7)
    run = run_epd(link, model, wl, AGGREGATED, prepared=prepared, sampling=sampling)
    assert run.tokens == reference_tokens(model, prepared, sampling)

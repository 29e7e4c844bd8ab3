"""Small EPD calibrations, workloads and problems the tests share."""

from __future__ import annotations

import contextlib

import pytest

from core.techniques.phase_disaggregation.types import SLO, EpdProblem, PhaseCosts, Request, Workload
from core.techniques.phase_disaggregation.workload import poisson_workload


def make_costs(**kw) -> PhaseCosts:
    base = dict(encode_s_per_tile=0.05, encode_overhead_s=0.01, mm_tokens_per_tile=64, prefill_s_per_token=1e-4,
                prefill_overhead_s=0.005, decode_step_s=((1, 0.02), (64, 0.04)), mm_token_bytes=2048,
                kv_token_bytes=8192, link_bandwidth_Bps=1e8, link_latency_s=0.001)
    return PhaseCosts(**(base | kw))


def one_request(images=2, tiles=4, prompt=32, output=8, arrival=0.0, rid=0) -> Request:
    return Request(id=rid, arrival_s=arrival, images=images, tiles_per_image=tiles, prompt_tokens=prompt,
                   output_tokens=output)


def single(req: Request) -> Workload:
    return Workload(requests=(req,))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llava checkpoint (random weights, fixed seed), made once per test module."""
    from core.models.multimodal import TINY_LLAVA, make_multimodal_model

    return make_multimodal_model(TINY_LLAVA, tmp_path_factory.mktemp("llava") / "m")


@contextlib.contextmanager
def local_agents(directory, n: int):
    """``n`` real agents on loopback (CurveZMQ), linked, ready and clock-synced."""
    from core.devices.agent_link import AgentLink
    from core.devices.local_cluster import LocalCluster

    with LocalCluster(directory, n) as lc:
        with AgentLink(lc.endpoints, lc.keys, heartbeat_timeout_s=30.0, request_timeout_s=60.0) as link:
            link.wait_ready(timeout_s=30)
            link.sync_clocks()
            yield link


@pytest.fixture
def costs() -> PhaseCosts:
    return make_costs()


def image_heavy_problem(devices: int = 6, requests: int = 60) -> EpdProblem:
    """Many tiles per request and a tight TTFT: only splitting a request's encode over devices meets it."""
    w = poisson_workload(rate_rps=1.0, requests=requests, seed=3, images=(4, 8), tiles_per_image=(4, 4),
                         prompt_tokens=(32, 64), output_tokens=(16, 32))
    return EpdProblem(costs=make_costs(), workload=w, slo=SLO(ttft_s=1.2, tpot_s=0.08),
                      devices=tuple(f"dev{i}" for i in range(devices)))

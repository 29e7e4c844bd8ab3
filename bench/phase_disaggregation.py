"""EPD (encode / prefill / decode disaggregation, issue 18) benchmark: prints one JSON line.

Measured half (real agents):
- a Llava checkpoint (CLIP tower 4×128, Llama 4×256, 16 tokens per 32-px tile) generated here;
- a local cluster of 4 real agents over CurveZMQ: 2 encode (IRP 2), 1 prefill, 1 decode,
  emulating edge devices ``SLOWDOWN``× slower than this machine (by CPU time: the four agents
  share two cores, so their compute would otherwise slow each other down);
- ``tokens_equal``: every request's tokens over the three pools equal the single-process
  ``generate()`` (greedy), and ``tokens_equal_sampled`` with seeded sampling;
- ``PhaseCosts`` profiled on the agents (``profiling.profile_phases``), then the same workload
  (Poisson-free: one request every ``GAP_S``) run for real and simulated with those costs
  (``simulator.simulate_pools``): TTFT and TPOT medians side by side and their ratio.

Transfers E→P and P→D are relayed by the coordinator over the control channel (docs).
The load of the machine is reported: the figures are noisy on a shared one.

Run: python bench/phase_disaggregation.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agents.emulation import DeviceEmulation  # noqa: E402
from agents.protocol import SamplingSpec  # noqa: E402
from core.devices.agent_link import AgentLink  # noqa: E402
from core.devices.local_cluster import LocalCluster  # noqa: E402
from core.models.multimodal import MultimodalRecipe, make_multimodal_model  # noqa: E402
from core.techniques.phase_disaggregation.profiling import profile_phases  # noqa: E402
from core.techniques.phase_disaggregation.runtime import (  # noqa: E402
    load_pools, prepare_requests, reference_tokens, run_epd,
)
from core.techniques.phase_disaggregation.simulator import simulate_pools  # noqa: E402
from core.techniques.phase_disaggregation.types import PoolConfig, Request, Workload  # noqa: E402

RECIPE = MultimodalRecipe(layers=4, hidden=256, heads=8, kv_heads=4, intermediate=512, vision_layers=4,
                          vision_hidden=128, vision_heads=4)
SLOWDOWN = 10.0
GAP_S = 0.8
REQUESTS = 12
POOLS = PoolConfig(encode=("local-0", "local-1"), prefill=("local-2",), decode=("local-3",), irp_degree=2,
                   decode_batch=1)


def local_workload(n: int = REQUESTS, gap_s: float = GAP_S) -> Workload:
    return Workload(requests=tuple(Request(id=i, arrival_s=gap_s * i, images=1, tiles_per_image=4, prompt_tokens=12,
                                           output_tokens=12) for i in range(n)))


def _median(xs) -> float:
    return statistics.median(list(xs))


def measured_half(workdir: str) -> tuple[dict, object]:
    """The measured figures and the ``PhaseCosts`` profiled on the agents (for the simulated half)."""
    model = make_multimodal_model(RECIPE, os.path.join(workdir, "llava"))
    wl = local_workload()
    prepared = prepare_requests(model, wl)
    sampled_wl = local_workload(n=2)
    sampled_prepared = prepare_requests(model, sampled_wl)
    sampling = SamplingSpec(temperature=0.8, top_k=50, top_p=0.95, seed=3)
    with LocalCluster(os.path.join(workdir, "cluster"), 4, emulation=DeviceEmulation(compute_slowdown=SLOWDOWN)) as lc:
        with AgentLink(lc.endpoints, lc.keys, heartbeat_timeout_s=60.0, request_timeout_s=120.0) as link:
            link.wait_ready(timeout_s=60)
            link.sync_clocks()
            load_pools(link, model, POOLS)
            t0 = time.perf_counter()
            costs = profile_phases(link, model, POOLS)
            profile_s = time.perf_counter() - t0
            sampled = run_epd(link, model, sampled_wl, POOLS, prepared=sampled_prepared, sampling=sampling, load=False)
            run = run_epd(link, model, wl, POOLS, prepared=prepared, load=False)
    sim = simulate_pools(costs, wl, POOLS)
    m_ttft, s_ttft = _median(m.ttft_s for m in run.metrics), _median(m.ttft_s for m in sim.metrics)
    m_tpot, s_tpot = _median(m.tpot_s for m in run.metrics), _median(m.tpot_s for m in sim.metrics)
    figures = {
        "tokens_equal": run.tokens == reference_tokens(model, prepared),
        "tokens_equal_sampled": sampled.tokens == reference_tokens(model, sampled_prepared, sampling),
        "local": {
            "agents": 4, "pools": {"encode": list(POOLS.encode), "prefill": list(POOLS.prefill),
                                   "decode": list(POOLS.decode), "irp_degree": POOLS.irp_degree},
            "requests": len(wl.requests), "gap_s": GAP_S, "tiles_per_request": 4, "output_tokens": 12,
            "compute_slowdown": SLOWDOWN,
            "ttft_median_measured_s": round(m_ttft, 4), "ttft_median_simulated_s": round(s_ttft, 4),
            "ttft_sim_over_measured": round(s_ttft / m_ttft, 3),
            "tpot_median_measured_s": round(m_tpot, 4), "tpot_median_simulated_s": round(s_tpot, 4),
            "tpot_sim_over_measured": round(s_tpot / m_tpot, 3),
            "within_15pct": abs(s_ttft / m_ttft - 1) <= 0.15 and abs(s_tpot / m_tpot - 1) <= 0.15,
            "profile_s": round(profile_s, 2),
            "costs": {"encode_s_per_tile": costs.encode_s_per_tile, "encode_overhead_s": costs.encode_overhead_s,
                      "prefill_s_per_token": costs.prefill_s_per_token,
                      "prefill_overhead_s": costs.prefill_overhead_s, "decode_step_s": costs.decode_step_s,
                      "link_bandwidth_Bps": round(costs.link_bandwidth_Bps), "link_latency_s": costs.link_latency_s},
        },
    }
    return figures, costs


def main() -> None:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        figures, _costs = measured_half(tmp)
    figures["loadavg_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

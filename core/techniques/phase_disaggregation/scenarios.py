"""Ready-made EPD inputs: an illustrative calibration and the image-heavy workload the bench uses.

The calibration is an *illustrative* edge device (a few tens of milliseconds per tile,
MiniCPM-V-like 64 tokens per tile, a 1 Gb/s link), for trying the CLI and the studio without
profiling; a measured ``PhaseCosts`` (``profiling``) replaces it for anything reported.
"""

from __future__ import annotations

from core.techniques.phase_disaggregation.types import SLO, EpdProblem, PhaseCosts, Workload
from core.techniques.phase_disaggregation.workload import poisson_workload


def illustrative_costs() -> PhaseCosts:
    return PhaseCosts(source="illustrative edge device (not measured)", encode_s_per_tile=0.04,
                      encode_overhead_s=0.005, mm_tokens_per_tile=64, prefill_s_per_token=1.5e-4,
                      prefill_overhead_s=0.01, decode_step_s=((1, 0.025), (8, 0.03), (32, 0.045), (64, 0.07)),
                      mm_token_bytes=2 * 896, kv_token_bytes=2 * 2 * 24 * 128 * 2, link_bandwidth_Bps=125e6,
                      link_latency_s=0.0005)


def image_heavy_workload(*, rate_rps: float = 1.0, requests: int = 200, seed: int = 0) -> Workload:
    """Several images per request, four tiles each, short prompts and answers: encode dominates
    TTFT, the case EPD is for (the paper's image-heavy setting, scaled to edge devices)."""
    return poisson_workload(rate_rps=rate_rps, requests=requests, seed=seed, images=(4, 10), tiles_per_image=(4, 4),
                            prompt_tokens=(32, 128), output_tokens=(32, 96))


def image_heavy_problem(costs: PhaseCosts | None = None, *, devices: int = 8, rate_rps: float = 1.0,
                        requests: int = 200, seed: int = 0, slo: SLO | None = None) -> EpdProblem:
    """``devices`` devices named ``dev0``…; the SLO defaults to 2.5 s TTFT and 80 ms TPOT."""
    return EpdProblem(name="image-heavy", costs=costs or illustrative_costs(),
                      workload=image_heavy_workload(rate_rps=rate_rps, requests=requests, seed=seed),
                      slo=slo or SLO(ttft_s=2.5, tpot_s=0.08), devices=tuple(f"dev{i}" for i in range(devices)))




def derived_slo(costs: PhaseCosts, workload: Workload, *, ttft_slack: float = 1.25, tpot_batch: int = 8,
                tpot_slack: float = 1.5) -> SLO:
    """SLOs scaled to the calibration (so one rule serves measured and illustrative costs):
    TTFT = ``ttft_slack`` × the 90th-percentile request's encode + prefill on one idle device
    (PD-only's floor: an encoder coupled to prefill meets it for 90 % of requests only when idle);
    TPOT = ``tpot_slack`` × a decode step of ``tpot_batch`` sequences."""
    alone = sorted(costs.encode_s(r.tiles) + costs.prefill_s(costs.prefill_tokens(r)) for r in workload.requests)
    p90 = alone[min(len(alone) - 1, int(0.9 * len(alone)))]
    return SLO(ttft_s=ttft_slack * p90, tpot_s=tpot_slack * costs.decode_step_seconds(tpot_batch))


__all__ = ["derived_slo", "illustrative_costs", "image_heavy_problem", "image_heavy_workload"]

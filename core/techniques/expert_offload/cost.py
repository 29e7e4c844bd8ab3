"""The one cost model of expert offloading: compute + storage reads not hidden behind compute.

Per token and MoE layer (batch 1): ``k`` experts are needed; a buffer of ``slots`` of the
model's ``L·E`` experts hits with rate ``h``; misses read ``expert_bytes·bits/32`` at the
storage bandwidth. A fraction ``recall`` of misses was preloaded during the previous layer's
compute, so only what exceeds that compute stalls. Hit rate: EdgeMoE's eviction keeps the
most used experts of the layers about to run, modelled as ``h = slots / (L·E)``; LRU over the
cyclic layer order evicts each expert just before its layer comes round again, so ``h = 0``
until everything fits (measured: bench/expert_offload.py).
"""

from __future__ import annotations

import msgspec

from core.techniques.expert_offload.problem import OffloadPlan, OffloadProblem


class OffloadCost(msgspec.Struct, frozen=True, kw_only=True):
    latency_per_token_s: float
    compute_s: float
    """Per token, all layers."""
    io_stall_s: float
    """Per token: storage reads not hidden behind compute."""
    load_s_per_expert: float
    hit_rate: float
    misses_per_token: float
    memory_bytes: int
    fits: bool
    accuracy_loss: float


def hit_rate(problem: OffloadProblem, plan: OffloadPlan) -> float:
    total = problem.model.layers * problem.model.experts
    if plan.slots >= total:
        return 1.0
    if plan.policy == "lru":
        return 0.0
    return plan.slots / total


def evaluate(problem: OffloadProblem, plan: OffloadPlan) -> OffloadCost:
    m = problem.model
    expert_bytes = m.expert_bytes * plan.bits.avg_bits / 32.0
    load = expert_bytes / problem.bandwidth_bps
    layer_compute = m.layer_compute_s + m.top_k * m.expert_compute_s
    memory = int(m.resident_bytes + plan.slots * expert_bytes)
    if plan.whole_layers:  # STI-like: the next layer's E experts stream in while this one computes
        h, misses = 0.0, float(m.experts)
        layer = max(layer_compute, m.experts * load)
        stall = layer - layer_compute
    else:
        h = hit_rate(problem, plan)
        misses = m.top_k * (1.0 - h)
        recall = problem.predictor_recall if plan.preload > 0 else 0.0
        stall = misses * (1.0 - recall) * load + max(0.0, misses * recall * load - layer_compute)
    return OffloadCost(
        latency_per_token_s=m.layers * (layer_compute + stall) + m.head_s,
        compute_s=m.layers * layer_compute + m.head_s, io_stall_s=m.layers * stall, load_s_per_expert=load,
        hit_rate=h, misses_per_token=m.layers * misses, memory_bytes=memory,
        fits=memory <= problem.memory_budget_bytes, accuracy_loss=plan.bits.accuracy_loss,
    )

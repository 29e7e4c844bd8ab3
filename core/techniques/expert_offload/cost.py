"""The one cost model of expert offloading: compute + storage reads not hidden behind compute.

Per token and MoE layer (batch 1): ``k`` experts are needed; a buffer of ``slots`` of the
model's ``L·E`` experts hits with rate ``h``; a miss reads ``expert_bytes·bits/32`` at the
storage bandwidth after a fixed cost per read (``read_s``: both measured). A fraction ``recall``
of misses was preloaded during the previous layer's compute, so only what exceeds that compute
stalls. Hit rate: EdgeMoE's eviction keeps the
most used experts of the layers about to run, modelled as ``h = slots / (L·E)``; LRU over the
cyclic layer order evicts each expert just before its layer comes round again, so ``h = 0``
until everything fits (measured: bench/expert_offload.py).

A run's step (``step_cost``: the simulator's) carries more tokens: a batch of ``b`` sequences, or
its prefill's ``b × prompt`` tokens, needs ``distinct_experts`` of a block, not ``k``; the prefill
starts on an empty buffer, so each of them is read.
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


def read_s(problem: OffloadProblem, plan: OffloadPlan) -> float:
    """One expert's read: the fixed cost of a read plus its bytes (at the plan's bits) over the bandwidth."""
    return problem.read_fixed_s + problem.model.expert_bytes * plan.bits.avg_bits / 32.0 / problem.bandwidth_bps


def distinct_experts(experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts a block's router picks for ``tokens`` tokens, each picking ``top_k``
    different experts of ``experts`` with even odds: each expert is missed by a token with odds
    ``1 - k/E``, by all of them with ``(1 - k/E)^tokens`` (one token: exactly ``k``)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** max(0.0, tokens))


class StepCost(msgspec.Struct, frozen=True, kw_only=True):
    """One step (a prefill or a decode step) of a batch through every block, per block."""

    reads_per_block: float
    block_s: float
    """One block's compute (its experts included, reads not)."""
    head_s: float


def step_cost(problem: OffloadProblem, plan: OffloadPlan, phase: str, tokens: int) -> StepCost:
    """``tokens``: the step's batch (decode) or batch × prompt length (prefill). Compute from the model's
    measured curves (``from_profile``), else its per-token times scaled by the tokens."""
    from core.devices.profile import interpolate

    m = problem.model
    needed = float(m.experts) if plan.whole_layers else distinct_experts(m.experts, m.top_k, tokens)
    if phase == "prefill":
        reads = needed  # the run starts on an empty buffer: each expert it needs is read once
        xs, block, head = m.prefill_token_counts, m.block_prefill_s, m.head_prefill_s
    else:
        reads = needed if plan.whole_layers else needed * (1.0 - hit_rate(problem, plan))
        xs, block, head = m.decode_batch_sizes, m.block_decode_s, m.head_decode_s
    if xs:
        return StepCost(reads_per_block=reads, block_s=interpolate(xs, block, tokens),
                        head_s=interpolate(xs, head, tokens))
    return StepCost(reads_per_block=reads, block_s=tokens * (m.layer_compute_s + m.top_k * m.expert_compute_s),
                    head_s=tokens * m.head_s)


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
    load = read_s(problem, plan)
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

"""Fixed and rotational staggered pipelining, simulated into the shared TimelineEvents.

n batches share the memory pool; each layer of each batch is a dense slice on a compute
replica, the traffic out, attention on every memory device (its heads, in parallel: the
attention lanes), the output back. ``fixed``: batch b always on replica b mod c (a replica with
more batches than another idles the other); ``rotational``: each next slice goes to the replica
free first (Lamina's rotation), so replicas share the batches evenly. Tasks are placed in order
of readiness (list scheduling), each as early as its inputs and its device allow.
Step 0 is the prefill: dense time of B·prompt tokens, attention by its FLOPs on the memory devices.
"""

from __future__ import annotations

import msgspec

from agents.protocol import TimelineEvent, TokenEvent
from core.runs.metrics import RunFigures, compute_figures
from core.techniques.attention_offload.cost import (
    FRAME_HEADER_BYTES, attention_seconds, dense_seconds, link_seconds,
)
from core.techniques.attention_offload.problem import OffloadPlan, OffloadProblem, check_plan


class OffloadSimulation(msgspec.Struct, frozen=True, kw_only=True):
    events: tuple[TimelineEvent, ...]
    tokens: tuple[TokenEvent, ...]
    figures: RunFigures
    decode_tokens_per_s: float
    """Steady decode throughput: per batch, decode tokens over their span (prefill apart), summed."""


def _prefill_attention_s(problem: OffloadProblem, plan: OffloadPlan) -> float:
    m, p = problem.model, problem.workload.prompt_tokens
    q_heads_share = -(-m.kv_heads // len(plan.memory)) * (m.q_heads // m.kv_heads)
    flops = 4 * plan.batch * p * p * q_heads_share * m.head_dim / 2  # QK^T and PV, causal half
    return max(flops / problem.device(d).flops for d in plan.memory)


def simulate(problem: OffloadProblem, plan: OffloadPlan, mode: str | None = None, *,
             generated_tokens: int | None = None, **_) -> OffloadSimulation:
    """``mode``: ``fixed`` or ``rotational`` (default: the plan's schedule)."""
    check_plan(problem, plan)
    schedule = mode or plan.schedule
    if schedule not in ("fixed", "rotational"):
        raise ValueError(f"unknown schedule {schedule!r}: fixed or rotational")
    steps = generated_tokens or problem.workload.generated_tokens
    memory = [problem.device(d) for d in plan.memory]
    c, layers, n = len(plan.compute), problem.model.layers, plan.in_flight
    heads = plan.kv_heads_of(problem.model.kv_heads)
    ctx = problem.workload.prompt_tokens
    compute_free = {d: 0.0 for d in plan.compute}
    memory_free = 0.0
    ready = [0.0] * n
    position = [(0, 0)] * n  # (step, layer) each batch does next
    turn = 0
    events: list[TimelineEvent] = []
    tokens: list[TokenEvent] = []
    wire = plan.batch * problem.model.wire_bytes_per_token_layer()
    remaining = n * steps * layers
    while remaining:
        b = min((i for i in range(n) if position[i][0] < steps), key=lambda i: (ready[i], i))
        step, layer = position[b]
        phase = "prefill" if step == 0 else "decode"
        if schedule == "fixed":
            device = plan.compute[b % c]
        else:
            device = min(plan.compute, key=lambda d: (compute_free[d], (plan.compute.index(d) - turn) % c))
            turn = (plan.compute.index(device) + 1) % c
        dev = problem.device(device)
        tokens_now = plan.batch * (ctx if step == 0 else 1)
        dense = dense_seconds(problem, dev, tokens_now)
        start = max(ready[b], compute_free[device])
        end = start + dense
        compute_free[device] = end
        common = dict(step=step, micro_batch=b, phase=phase)
        events.append(TimelineEvent(device=device, stage=layer, kind="compute", start_s=start, end_s=end, **common))
        link = link_seconds(problem, dev, memory, tokens_now)
        sent = end + link / 2
        for m_id in plan.memory:
            events.append(TimelineEvent(device=device, stage=layer, kind="send", start_s=end, end_s=sent,
                                        nbytes=wire * (ctx if step == 0 else 1) * len(heads[m_id]) // problem.model.kv_heads
                                        + 2 * FRAME_HEADER_BYTES,
                                        peer=m_id, **common))
        attn = (_prefill_attention_s(problem, plan) if step == 0
                else attention_seconds(problem, memory, plan.batch, ctx + step - 1))
        a_start = max(sent, memory_free)
        memory_free = a_start + attn
        for m_id in plan.memory:
            events.append(TimelineEvent(device=m_id, stage=layer, kind="compute", start_s=a_start,
                                        end_s=a_start + attn, **common))
        ready[b] = memory_free + link / 2
        remaining -= 1
        if layer + 1 < layers:
            position[b] = (step, layer + 1)
        else:
            position[b] = (step + 1, 0)
            tokens.append(TokenEvent(micro_batch=b, step=step,
                                     sequence_ids=tuple(range(b * plan.batch, (b + 1) * plan.batch)),
                                     token_ids=(0,) * plan.batch, t_s=ready[b]))
    events.sort(key=lambda e: (e.start_s, e.device))
    tokens.sort(key=lambda t: t.t_s)
    # Steady decode rate: each batch's tokens from its first decode step to its last (prefill apart).
    decode_tps = 0.0
    for b in range(n):
        mine = [t.t_s for t in tokens if t.micro_batch == b and t.step >= 1]
        if len(mine) > 1 and mine[-1] > mine[0]:
            decode_tps += plan.batch * (len(mine) - 1) / (mine[-1] - mine[0])
    return OffloadSimulation(events=tuple(events), tokens=tuple(tokens), figures=compute_figures(events, tokens),
                             decode_tokens_per_s=decode_tps)

"""Fixed and rotational staggered pipelining, simulated into the shared TimelineEvents.

The order is not decided here: ``agents.schedule.staggered_slices`` (the one schedule, which the
agents execute too) says which replica runs each slice of each batch and in what order. Here
it is timed: each replica performs its slices in that order, each as early as its batch's
previous slice (its attention outputs and residual) and the replica allow; the memory pool
serves the attentions in the same order, every memory device in parallel on its heads (the
attention lanes). Events are what a real run records (agents.attention_offload_staggered): a
``compute`` per slice on its replica (stage = the layer whose attention follows, ``layers`` for
the tail), a ``send`` from the replica to each memory device (q, k, v and a frame header), the
attention ``compute`` and its answer ``send`` (the output) on each memory device, and a ``send``
of the residual when the next slice runs on another replica.
Step 0 is the prefill: dense time of B·prompt tokens, attention by its FLOPs on the memory devices.
"""

from __future__ import annotations

import msgspec

from agents.protocol import TimelineEvent, TokenEvent
from agents.schedule import STAGGERED_SCHEDULES, staggered_slices
from core.runs.metrics import RunFigures, compute_figures
from core.techniques.attention_offload.cost import (
    FRAME_HEADER_BYTES, attention_seconds, dense_seconds, head_seconds, link_seconds, residual_seconds,
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
    if schedule not in STAGGERED_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: fixed or rotational")
    steps = generated_tokens or problem.workload.generated_tokens
    model = problem.model
    memory = [problem.device(d) for d in plan.memory]
    c, layers, n = len(plan.compute), model.layers, plan.in_flight
    heads = plan.kv_heads_of(model.kv_heads)
    ctx = problem.workload.prompt_tokens
    bpe, group = model.bytes_per_element, model.q_heads // model.kv_heads
    compute_free = {d: 0.0 for d in plan.compute}
    memory_free = 0.0
    ready = [0.0] * n  # when the batch's previous slice's outputs reach its next replica
    moved_in = [0.0] * n  # the residual frame the batch's next replica receives first
    events: list[TimelineEvent] = []
    tokens: list[TokenEvent] = []
    order = staggered_slices(schedule, c, n, steps, layers)
    nxt = {(s.micro_batch, s.index): s.replica for s in order}
    for s in order:
        b, step, layer = s.micro_batch, s.step, s.layer
        device = plan.compute[s.replica]
        dev = problem.device(device)
        common = dict(step=step, micro_batch=b, phase=s.phase)
        rows = plan.batch * (ctx if step == 0 and s.index < layers else 1)  # tokens this slice's dense part runs
        samples = s.index >= layers and s.index % layers == 0  # the head of the step before, then sampling
        head = head_seconds(problem, dev, plan.batch) if samples else 0.0
        start = max(ready[b], compute_free[device])
        end = start + moved_in[b] + head + (0.0 if s.is_tail else dense_seconds(problem, dev, rows, len(memory)))
        moved_in[b] = 0.0
        compute_free[device] = end
        events.append(TimelineEvent(device=device, stage=layer, kind="compute", start_s=start, end_s=end, **common))
        if samples:
            done = step - 1 if not s.is_tail else step
            tokens.append(TokenEvent(micro_batch=b, step=done,
                                     sequence_ids=tuple(range(b * plan.batch, (b + 1) * plan.batch)),
                                     token_ids=(0,) * plan.batch, t_s=start + head))
        if s.is_tail:
            continue
        following = plan.compute[nxt[(b, s.index + 1)]]
        link = link_seconds(problem, dev, memory, rows)
        sent = end + link / 2
        for m_id in plan.memory:
            h = len(heads[m_id])
            events.append(TimelineEvent(device=device, stage=layer, kind="send", start_s=end, end_s=sent,
                                        nbytes=rows * (h * group + 2 * h) * model.head_dim * bpe + FRAME_HEADER_BYTES,
                                        peer=m_id, **common))
        attn = (_prefill_attention_s(problem, plan) if step == 0
                else attention_seconds(problem, memory, plan.batch, ctx + step - 1))
        a_start = max(sent, memory_free)
        memory_free = a_start + attn
        for m_id in plan.memory:
            h = len(heads[m_id])
            events.append(TimelineEvent(device=m_id, stage=layer, kind="compute", start_s=a_start,
                                        end_s=memory_free, **common))
            events.append(TimelineEvent(device=m_id, stage=layer, kind="send", start_s=memory_free,
                                        end_s=memory_free + link / 2,
                                        nbytes=rows * h * group * model.head_dim * bpe + FRAME_HEADER_BYTES,
                                        peer=following, **common))
        ready[b] = memory_free + link / 2
        if following != device:
            moved = residual_seconds(problem, dev, problem.device(following), rows)
            events.append(TimelineEvent(device=device, stage=layer, kind="send", start_s=end, end_s=end + moved,
                                        nbytes=rows * model.hidden * bpe + FRAME_HEADER_BYTES, peer=following,
                                        **common))
            ready[b] = max(ready[b], end + moved)
            compute_free[device] = end + dev.frame_s  # the residual's frame: sent here, received there
            moved_in[b] = problem.device(following).frame_s
    events.sort(key=lambda e: (e.start_s, e.device))
    tokens.sort(key=lambda t: t.t_s)
    return OffloadSimulation(events=tuple(events), tokens=tuple(tokens), figures=compute_figures(events, tokens),
                             decode_tokens_per_s=decode_tokens_per_s(tokens))


def decode_tokens_per_s(tokens) -> float:
    """Steady decode rate of a run (simulated or measured, ``TokenEvent``s): each batch's tokens from
    its first decode step to its last (the prefill apart), summed over the batches."""
    total = 0.0
    for b in sorted({t.micro_batch for t in tokens}):
        mine = sorted((t.t_s, len(t.sequence_ids)) for t in tokens if t.micro_batch == b and t.step >= 1)
        if len(mine) > 1 and mine[-1][0] > mine[0][0]:
            total += sum(n for _, n in mine[1:]) / (mine[-1][0] - mine[0][0])
    return total

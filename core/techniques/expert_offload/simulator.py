"""EdgeMoE's simulated schedule as the shared TimelineEvents, shaped like an agent's run.

A run's batch (``micro_batch_sizes``: the Run screen's split of its prompts) goes through the
MoE blocks step by step, as the agent's stage does: one ``compute`` box per step and micro-batch
on the device's lane, from its start to its sampled token (the agent times its whole forward,
demand reads included), and per block the expected expert reads on the device's storage lane
(``<device>:storage``, kind ``io``, peer ``storage``): preloaded reads start with the previous
block's compute, on-demand reads stall this block's. The step's reads and compute are
``cost.step_cost``'s: the prefill reads every expert its prompt tokens pick (the buffer starts
empty), a decode step the misses among the experts its ``b`` sequences pick.
"""

from __future__ import annotations

import msgspec

from agents.protocol import TimelineEvent, TokenEvent, storage_lane
from core.runs.metrics import RunFigures, compute_figures
from core.techniques.expert_offload.cost import read_s, step_cost
from core.techniques.expert_offload.problem import OffloadPlan, OffloadProblem


class OffloadSimulation(msgspec.Struct, frozen=True, kw_only=True):
    events: tuple[TimelineEvent, ...]
    tokens: tuple[TokenEvent, ...]
    figures: RunFigures


def simulate(problem: OffloadProblem, plan: OffloadPlan, mode: str = "sequential", *,
             generated_tokens: int | None = None, micro_batch_sizes: tuple[int, ...] | None = None,
             prompt_tokens: int | None = None, **_) -> OffloadSimulation:
    """``micro_batch_sizes``: sequences per micro-batch of the run (None: one sequence);
    ``prompt_tokens``: the prompts' length (None: the problem's)."""
    m = problem.model
    sizes = tuple(s for s in (micro_batch_sizes or ()) if s > 0) or (1,)
    prompt = prompt_tokens or problem.prompt_tokens
    load = read_s(problem, plan)
    expert_bytes = m.expert_bytes * plan.bits.avg_bits / 32
    recall = 0.0 if plan.whole_layers else (problem.predictor_recall if plan.preload > 0 else 0.0)
    events: list[TimelineEvent] = []
    tokens: list[TokenEvent] = []
    t = previous_start = 0.0
    for step in range(generated_tokens or problem.generated_tokens):
        phase = "prefill" if step == 0 else "decode"
        first_sequence = 0
        for mb, size in enumerate(sizes):
            cost = step_cost(problem, plan, phase, size * prompt if step == 0 else size)
            common = dict(stage=0, phase=phase, step=step, micro_batch=mb)
            read_time = cost.reads_per_block * load
            nbytes = cost.reads_per_block * expert_bytes
            ahead = read_time if plan.whole_layers else read_time * recall  # read during the previous block
            step_start = t
            for _block in range(m.layers):
                demand = read_time - ahead
                if ahead > 0:
                    events.append(TimelineEvent(device=storage_lane(plan.device), kind="io", start_s=previous_start,
                                                end_s=previous_start + ahead, nbytes=int(nbytes * ahead / read_time),
                                                peer="storage", **common))
                t = max(t, previous_start + ahead)
                if demand > 0:
                    events.append(TimelineEvent(device=storage_lane(plan.device), kind="io", start_s=t,
                                                end_s=t + demand, nbytes=int(nbytes * demand / read_time),
                                                peer="storage", **common))
                    t += demand
                previous_start = t
                t += cost.block_s
            t += cost.head_s
            # the next step's first reads start no earlier than the cost model says (a decode step's head)
            previous_start += step_cost(problem, plan, "decode", size).head_s
            events.append(TimelineEvent(device=plan.device, kind="compute", start_s=step_start, end_s=t, **common))
            ids = tuple(range(first_sequence, first_sequence + size))
            first_sequence += size
            tokens.append(TokenEvent(micro_batch=mb, step=step, sequence_ids=ids, token_ids=(0,) * size, t_s=t))
    return OffloadSimulation(events=tuple(events), tokens=tuple(tokens), figures=compute_figures(events, tokens))

"""EdgeMoE's simulated schedule as the shared TimelineEvents.

Each token runs the MoE layers in order on the device's compute lane; the expected expert
reads of each layer are one box on the device's storage lane (``<device>:storage``, kind
``recv_wait`` with peer ``storage``: the shared timeline has no I/O kind yet): preloaded
reads start with the previous layer's compute, on-demand reads stall this layer's compute.
"""

from __future__ import annotations

import msgspec

from agents.protocol import TimelineEvent, TokenEvent, storage_lane
from core.runs.metrics import RunFigures, compute_figures
from core.techniques.expert_offload.cost import evaluate
from core.techniques.expert_offload.problem import OffloadPlan, OffloadProblem


class OffloadSimulation(msgspec.Struct, frozen=True, kw_only=True):
    events: tuple[TimelineEvent, ...]
    tokens: tuple[TokenEvent, ...]
    figures: RunFigures


def simulate(problem: OffloadProblem, plan: OffloadPlan, mode: str = "sequential", *,
             generated_tokens: int | None = None, **_) -> OffloadSimulation:
    c = evaluate(problem, plan)
    m = problem.model
    layer_compute = m.layer_compute_s + m.top_k * m.expert_compute_s
    per_layer_reads = c.misses_per_token / m.layers
    read_s = per_layer_reads * c.load_s_per_expert
    recall = 0.0 if plan.whole_layers else (problem.predictor_recall if plan.preload > 0 else 0.0)
    events: list[TimelineEvent] = []
    tokens: list[TokenEvent] = []
    nbytes = int(per_layer_reads * m.expert_bytes * plan.bits.avg_bits / 32)
    t = previous_start = 0.0
    for step in range(generated_tokens or problem.generated_tokens):
        phase = "prefill" if step == 0 else "decode"
        for layer in range(m.layers):
            common = dict(stage=0, phase=phase, step=step, micro_batch=0)
            ahead = read_s if plan.whole_layers else read_s * recall  # read during the previous layer
            demand = read_s - ahead
            if ahead > 0:
                events.append(TimelineEvent(device=storage_lane(plan.device), kind="io", start_s=previous_start,
                                            end_s=previous_start + ahead, nbytes=int(nbytes * ahead / read_s),
                                            peer="storage", **common))
            t = max(t, previous_start + ahead)
            if demand > 0:
                events.append(TimelineEvent(device=storage_lane(plan.device), kind="io", start_s=t,
                                            end_s=t + demand, nbytes=int(nbytes * demand / read_s), peer="storage",
                                            **common))
                t += demand
            events.append(TimelineEvent(device=plan.device, kind="compute", start_s=t, end_s=t + layer_compute,
                                        **common))
            previous_start = t
            t += layer_compute
        t += m.head_s
        previous_start += m.head_s  # the next token's first reads start no earlier than the cost model says
        tokens.append(TokenEvent(micro_batch=0, step=step, sequence_ids=(0,), token_ids=(0,), t_s=t))
    return OffloadSimulation(events=tuple(events), tokens=tuple(tokens), figures=compute_figures(events, tokens))

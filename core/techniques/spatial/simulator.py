"""Spatial partitioning's simulated schedule: the shared TimelineEvents, per image and group.

Each device's lane shows, per group, the wait for its strip from the gateway (``recv_wait``,
the scatter, bytes and peer named), its compute, and the send of its result (``send``, the
gather); the gateway's lane ends each image with the FC head. Images stream one after
another; each image's class scores are one "token" (``TokenEvent``) so the shared figures,
recording, replay and export take the run as it is (step = image index).
"""

from __future__ import annotations

import msgspec

from agents.protocol import TimelineEvent, TokenEvent
from agents.techniques.spatial.network import strip_bounds
from core.runs.metrics import RunFigures, compute_figures
from core.techniques.spatial.cost import group_times, head_seconds, tile_seconds
from core.techniques.spatial.problem import SpatialPlan, SpatialProblem, check


class SpatialSimulation(msgspec.Struct, frozen=True, kw_only=True):
    events: tuple[TimelineEvent, ...]
    tokens: tuple[TokenEvent, ...]
    figures: RunFigures


def simulate(problem: SpatialProblem, plan: SpatialPlan, mode: str = "sequential", *,
             images: int | None = None, **_) -> SpatialSimulation:
    check(problem, plan)
    spec = problem.model.spec()
    n = images or problem.images
    events: list[TimelineEvent] = []
    tokens: list[TokenEvent] = []
    t = 0.0
    gw = problem.gateway
    for image in range(n):
        for g, ((start, end), ws) in enumerate(zip(plan.groups, plan.widths)):
            times = group_times(problem, spec, start, end, plan.devices, ws)
            for d, st, (lo, hi) in zip(plan.devices, times, strip_bounds(ws)):
                if hi <= lo:
                    continue
                common = dict(device=d, stage=g, phase="prefill", step=image, micro_batch=0)
                at = t
                if st.scatter_s:
                    events.append(TimelineEvent(kind="recv_wait", start_s=at, end_s=at + st.scatter_s,
                                                nbytes=st.in_bytes, peer=gw, **common))
                    at += st.scatter_s
                events.append(TimelineEvent(kind="compute", start_s=at, end_s=at + st.compute_s, **common))
                at += st.compute_s
                if st.gather_s:
                    events.append(TimelineEvent(kind="send", start_s=at, end_s=at + st.gather_s,
                                                nbytes=st.out_bytes, peer=gw, **common))
            t += tile_seconds(problem, plan.devices, ws, times)
        head = head_seconds(problem, spec)
        events.append(TimelineEvent(device=gw, stage=len(plan.groups), kind="compute", phase="prefill", step=image,
                                    micro_batch=0, start_s=t, end_s=t + head))
        t += head
        tokens.append(TokenEvent(micro_batch=0, step=image, sequence_ids=(image,), token_ids=(0,), t_s=t))
    return SpatialSimulation(events=tuple(events), tokens=tuple(tokens), figures=compute_figures(events, tokens))

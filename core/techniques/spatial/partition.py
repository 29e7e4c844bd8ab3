"""Partitioners: how many output columns each device computes, per group of layers.

- ``even``: equal strips.
- ``bodp``: strips in proportion to compute speed only (1/a), the partitioning EdgeMI improves on.
- ``cbps``: EdgeMI's compute- and bandwidth-based partitioning: start from the compute shares,
  then move ``step`` columns from the slowest device (compute + its transfers) to the fastest
  until the spread falls under ``threshold`` of the slowest or a move stops helping.
- ``fused``: beyond the paper: consecutive layers fused into one tile (halos recomputed inside,
  one scatter/gather per tile), boundaries chosen by dynamic programming over the cost model,
  CBPS widths within each tile; and the device count chosen by the cost model.
Every one is a pure function of the problem.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agents.spatial import CnnSpec
from core.techniques.spatial.cost import evaluate, group_times, tile_seconds
from core.techniques.spatial.problem import SpatialPlan, SpatialProblem, check

Widths = tuple[int, ...]
GroupPartitioner = Callable[[SpatialProblem, CnnSpec, int, int, Sequence[str]], Widths]


def proportional(total: int, weights: Sequence[float]) -> Widths:
    """Integers summing to ``total`` in proportion to ``weights`` (largest remainder)."""
    s = sum(weights)
    raw = [total * w / s for w in weights]
    out = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: (out[i] - raw[i], i))[: total - sum(out)]:
        out[i] += 1
    return tuple(out)


def even_widths(problem, spec, start, end, devices) -> Widths:
    return proportional(spec.layers[end - 1].w_out, [1.0] * len(devices))


def bodp_widths(problem, spec, start, end, devices) -> Widths:
    return proportional(spec.layers[end - 1].w_out, [1.0 / problem.device(d).time.a for d in devices])


def _group_span(problem, spec, start, end, devices, widths) -> float:
    """A group's time with the gateway's own per-tile and per-worker work (what the DP sums)."""
    return tile_seconds(problem, devices, widths, group_times(problem, spec, start, end, devices, widths))


def cbps_widths(problem, spec, start, end, devices, *, step: int = 1, threshold: float = 0.02) -> Widths:
    """EdgeMI's CBPS for one group: compute-proportional start, then ``step`` columns at a time
    move from the slowest device (compute + its transfers) to the one that would be fastest
    with them, until the spread T_max − T_min is under ``threshold``·T_max; the best widths seen
    are kept (a move can overshoot when a per-call or per-message constant dominates)."""
    layers_w = spec.layers[end - 1].w_out
    widths = list(bodp_widths(problem, spec, start, end, devices))
    best = (_group_span(problem, spec, start, end, devices, widths), tuple(widths))
    for _ in range(layers_w * len(devices)):
        times = [t.total_s for t in group_times(problem, spec, start, end, devices, widths)]
        busy = [t for t, w in zip(times, widths) if w]
        slow = max(range(len(times)), key=lambda i: times[i])
        if max(busy) - min(busy) <= threshold * max(busy):
            break
        moved = min(step, widths[slow])

        def after(i: int) -> float:
            trial = list(widths)
            trial[i] += moved
            trial[slow] -= moved
            return group_times(problem, spec, start, end, devices, trial)[i].total_s

        to = min((i for i in range(len(devices)) if i != slow), key=after, default=None)
        if to is None or after(to) >= times[slow]:
            break
        widths[slow] -= moved
        widths[to] += moved
        span = _group_span(problem, spec, start, end, devices, widths)
        if span < best[0]:
            best = (span, tuple(widths))
    return best[1]


PER_LAYER: dict[str, GroupPartitioner] = {"even": even_widths, "bodp": bodp_widths, "cbps": cbps_widths}


def per_layer_plan(problem: SpatialProblem, name: str, devices: Sequence[str] | None = None) -> SpatialPlan:
    """One group per layer (a scatter and gather around every layer), widths by ``name``."""
    check(problem)
    spec = problem.model.spec()
    devs = tuple(devices or _ordered(problem))
    groups = tuple((i, i + 1) for i in range(len(spec.layers)))
    widths = tuple(PER_LAYER[name](problem, spec, s, e, devs) for s, e in groups)
    return SpatialPlan(strategy=name, devices=devs, groups=groups, widths=widths)


def fused_plan(problem: SpatialProblem, devices: Sequence[str] | None = None,
               partition: GroupPartitioner = cbps_widths) -> SpatialPlan:
    """Fused tiles: the group boundaries minimising the summed group times (exact DP over every
    segmentation, for the widths ``partition`` gives each candidate group)."""
    check(problem)
    spec = problem.model.spec()
    devs = tuple(devices or _ordered(problem))
    n = len(spec.layers)
    best: list[tuple[float, int, Widths]] = [(0.0, 0, ())] + [(float("inf"), 0, ())] * n
    for end in range(1, n + 1):
        for start in range(end):
            ws = partition(problem, spec, start, end, devs)
            t = best[start][0] + _group_span(problem, spec, start, end, devs, ws)
            if t < best[end][0]:
                best[end] = (t, start, ws)
    groups, widths, end = [], [], n
    while end:
        _, start, ws = best[end]
        groups.append((start, end))
        widths.append(ws)
        end = start
    return SpatialPlan(strategy="fused", devices=devs, groups=tuple(groups[::-1]), widths=tuple(widths[::-1]))


def _ordered(problem: SpatialProblem) -> list[str]:
    """The gateway first, then the others by speed (fastest first)."""
    others = sorted((d for d in problem.devices if d.id != problem.gateway), key=lambda d: (d.time.a, d.id))
    return [problem.gateway] + [d.id for d in others]


def device_count_choices(problem: SpatialProblem, make: Callable[[SpatialProblem, Sequence[str]], SpatialPlan]
                         ) -> list[tuple[int, SpatialPlan, float]]:
    """(count, plan, seconds per image) for the gateway plus the k−1 fastest others, k = 1..n."""
    order = _ordered(problem)
    out = []
    for k in range(1, len(order) + 1):
        plan = make(problem, order[:k])
        out.append((k, plan, evaluate(problem, plan).latency_s))
    return out


def with_best_device_count(problem: SpatialProblem,
                           make: Callable[[SpatialProblem, Sequence[str]], SpatialPlan]) -> SpatialPlan:
    """The planner's device count: the fewest devices within 0.5 % of the best time (more devices
    stop paying once transfers dominate)."""
    choices = device_count_choices(problem, make)
    best = min(t for _, _, t in choices)
    return next(p for _, p, t in choices if t <= best * 1.005)

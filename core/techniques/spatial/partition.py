"""Partitioners: how many output columns each device computes, per group of layers.

- ``even``: equal strips.
- ``bodp``: strips in proportion to compute speed only (1/a), the partitioning EdgeMI improves on.
- ``cbps``: EdgeMI's compute- and bandwidth-based partitioning: start from the compute shares,
  then move ``step`` columns from the slowest device (compute + its transfers) to the fastest
  until the spread falls under ``threshold`` of the slowest or a move stops helping.
- ``fused``: beyond the paper: consecutive layers fused into one tile (halos recomputed inside,
  one scatter/gather per tile), boundaries chosen by dynamic programming over the cost model,
  CBPS widths within each tile; and the device count chosen by the cost model.
Every one is a pure function of the problem. BODP, CBPS and fused never give a device a strip
narrower than ``min_strip_width`` (0 or at least that many columns: ``without_slivers``); ``even``
stays even.
"""

from __future__ import annotations

import math

from collections.abc import Callable, Sequence

from agents.techniques.spatial.network import CnnSpec, Layer
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


MIN_CONV_STRIP_COLUMNS = 2
"""No device computes fewer output columns of a convolution (or residual block) than this, unless
none. Measured on one thread through the strip path (``compute_strip``, VGG16 96², channels / 2,
docs/spatial.md *Narrow strips*): a 1-column strip took 82–98 % of a 2-column one's time, and
162–167 % on the 256-channel 6×6 maps (0.80 ms against 0.49) — half the work for little or no time
saved — and 1.13–2.06× what the per-layer time model predicts on the 24-, 12- and 6-column maps,
whose terms (FLOPs, weight bytes, activation bytes) cannot see a strip's column count; 2-column
strips there came within 0.90–1.15× of it. CBPS's W_step moves can leave such slivers, e.g. 1
column of each 256-channel 6×6 conv to an 8× slower gateway."""


def min_strip_width(layers: Sequence[Layer], conv_columns: int = MIN_CONV_STRIP_COLUMNS) -> int:
    """The fewest output columns of a group's last layer a device may compute (or 0): enough that
    every convolution and residual block of the group computes at least ``conv_columns`` columns;
    at most the map's width. Walking back through a group a strip never narrows (a conv reads its
    output columns plus halo, a pool twice its output columns), so the last conv or residual
    block decides: ``conv_columns`` halved for every pool after it in the group; a group of pools
    alone has no minimum (1)."""
    need = float(conv_columns)
    for layer in reversed(layers):
        if layer.kind != "pool":
            return max(1, min(math.ceil(need), layers[-1].w_out))
        need /= 2
    return 1


def without_slivers(widths: Sequence[int], minimum: int, score: Callable[[Widths], float]) -> Widths:
    """``widths`` (the same total) with every strip 0 or at least ``minimum`` columns. While a
    strip is narrower (a sliver; the leftmost first), either its columns go to another device's
    non-empty strip or it is topped up to ``minimum`` from a strip that stays 0 or at least
    ``minimum`` — whichever ``score`` (lower is better; ties: the first found) likes best. Strips
    are consecutive column ranges, so moving columns between two devices shifts the strips between
    them without changing their widths. Widths with no sliver come back unchanged."""
    ws = tuple(widths)
    minimum = min(minimum, sum(ws))
    while True:
        i = next((k for k, w in enumerate(ws) if 0 < w < minimum), None)
        if i is None:
            return ws
        short = minimum - ws[i]
        options = []
        for j, w in enumerate(ws):
            if j == i:
                continue
            if w:
                options.append(_moved(ws, i, j, ws[i]))
            if w - short == 0 or w - short >= minimum:
                options.append(_moved(ws, j, i, short))
        ws = min(options, key=score)


def _moved(widths: Widths, src: int, dst: int, n: int) -> Widths:
    out = list(widths)
    out[src] -= n
    out[dst] += n
    return tuple(out)


def even_widths(problem, spec, start, end, devices) -> Widths:
    return proportional(spec.layers[end - 1].w_out, [1.0] * len(devices))


def _compute_shares(problem, spec, end, devices) -> Widths:
    return proportional(spec.layers[end - 1].w_out, [1.0 / problem.device(d).time.a for d in devices])


def bodp_widths(problem, spec, start, end, devices) -> Widths:
    """Strips in proportion to compute speed; a sliver goes where the slowest compute-only time
    (columns × a) is least."""
    a = [problem.device(d).time.a for d in devices]
    return without_slivers(_compute_shares(problem, spec, end, devices), min_strip_width(spec.layers[start:end]),
                           lambda ws: max(w * x for w, x in zip(ws, a)))


def _group_span(problem, spec, start, end, devices, widths) -> float:
    """A group's time with the gateway's own per-tile and per-worker work (what the DP sums)."""
    return tile_seconds(problem, devices, widths, group_times(problem, spec, start, end, devices, widths))


def cbps_widths(problem, spec, start, end, devices, *, step: int = 1, threshold: float = 0.02) -> Widths:
    """EdgeMI's CBPS for one group: compute-proportional start, then ``step`` columns at a time
    move from the slowest device (compute + its transfers) to the one that would be fastest
    with them, until the spread T_max − T_min is under ``threshold``·T_max; the best widths seen
    are kept (a move can overshoot when a per-call or per-message constant dominates), each seen
    without its slivers (``without_slivers`` by the group's time: no strip narrower than
    ``min_strip_width``), BODP's widths among them."""
    layers_w = spec.layers[end - 1].w_out
    minimum = min_strip_width(spec.layers[start:end])

    def span(ws) -> float:
        return _group_span(problem, spec, start, end, devices, ws)

    widths = list(_compute_shares(problem, spec, end, devices))
    best = min(((span(ws), ws) for ws in (without_slivers(widths, minimum, span),
                                           bodp_widths(problem, spec, start, end, devices))),
               key=lambda c: c[0])
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
        seen = without_slivers(widths, minimum, span)
        if (t := span(seen)) < best[0]:
            best = (t, seen)
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

"""Calibrate the spatial cost model from one real run, so the simulator predicts real runs.

The profiled time model (conv sweeps, best of several calls on a quiet core) and the links'
nominal bandwidth leave out what a real run pays: compute on cores shared with the other
agents (and, on an emulated device, that sharing scaled by its slowdown), each strip's
framing, encryption and queueing on both ends, and the gateway's own work per tile (cutting
strips, concatenating). ``calibrate`` fits those from one measured run's events — a pure
function of the run, so any run (a probe plan, or last session's) can calibrate:

- per device, its time models (conv and head) scaled by measured / predicted compute of the
  strips it really computed (a and b fitted apart by least squares extrapolated worse from
  the probe's small strips to whole maps: tried, dropped);
- per worker, its per-message latency: the median of (scatter or gather seconds − bytes /
  bandwidth) over its transfers (the nominal bandwidth is kept);
- the problem's ``tile_overhead_s``: what the run took per image beyond its tiles' slowest
  strips and the head, spread over the tiles;
- with runs on fewer devices (``ladder``: even strips over the gateway and k − 1 workers, k = 1
  the gateway alone), the host-sharing factor per k (the gateway's compute scale in that run over
  its scale in the probe, ``concurrency_scale``; measured for every k, not interpolated between
  alone and all: on a 2-core host one and two computing agents hardly slow each other, four do),
  and the gateway's own work per worker (``worker_overhead_s``: each run's per-tile overhead, least
  squares over its worker count — cutting, framing and taking in one more strip per tile is what
  a plan on fewer devices saves). With only ``solo`` (the gateway alone, no duration) the factor
  is linear from alone to the probe's device count, as before.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

import msgspec

from agents.protocol import TimelineEvent
from core.techniques.spatial.cost import group_times, head_seconds
from core.techniques.spatial.problem import SpatialInputError, SpatialPlan, SpatialProblem, check


class Calibration(msgspec.Struct, frozen=True, kw_only=True):
    problem: SpatialProblem
    """The problem with calibrated time models, latencies and tile overhead."""
    compute_scale: dict[str, float]
    """Per device: measured / predicted compute over the probe's strips."""
    head_scale: float
    latency_s: dict[str, float]
    tile_overhead_s: float
    concurrency_scale: tuple[float, ...] = ()
    worker_overhead_s: float = 0.0


def calibrate(problem: SpatialProblem, plan: SpatialPlan, events: Sequence[TimelineEvent],
              duration_s: float, solo: tuple[SpatialPlan, Sequence[TimelineEvent]] | None = None,
              ladder: Sequence[tuple[SpatialPlan, Sequence[TimelineEvent], float]] = ()) -> Calibration:
    """Fit the problem to a real run of ``plan`` (its events and its measured duration); with
    ``ladder`` (runs on fewer devices: plan, events, duration) the host sharing per device count
    and the gateway's per-worker work, with only ``solo`` (a plan of the gateway alone and its
    run's events) the host sharing, linear. ``SpatialInputError`` when a run has no image or no
    compute to fit from."""
    check(problem, plan)
    gw = problem.gateway
    base = msgspec.structs.replace(problem, tile_overhead_s=0.0, worker_overhead_s=0.0, concurrency_scale=())
    cal = _calibrate(base, plan, events, duration_s)
    n = _computing(plan)
    runs = list(ladder)
    if solo is not None:
        if set(solo[0].devices) != {gw}:
            raise SpatialInputError("the solo run must be the gateway alone")
        runs.append((solo[0], solo[1], 0.0))
    if not runs:
        return cal
    if gw not in cal.compute_scale:
        raise SpatialInputError("the solo run and the probe must both have the gateway compute")
    counts = {_computing(p) for p, _, _ in runs}
    scale = (1.0,) * n
    # Fixed point: a probe's tiles on small maps have fewer columns than devices, so fewer devices
    # compute them; predicting each tile with its own count's factor separates the device models
    # from the sharing (a few rounds settle it to float precision).
    for _ in range(8):
        cal = _calibrate(msgspec.structs.replace(base, concurrency_scale=scale), plan, events, duration_s)
        rho = {n: scale[n - 1]}
        for p, evs, _ in runs:
            r = _compute_scale(cal.problem, p, evs).get(gw)
            if not r:
                raise SpatialInputError("the solo run and the probe must both have the gateway compute")
            rho[_computing(p)] = scale[_computing(p) - 1] * r
        scale = _per_count(rho, n) if counts else scale
    overhead = {_workers(problem, plan): cal.tile_overhead_s}  # per tile, by workers per tile
    for p, evs, took in runs:
        if took > 0:
            overhead[_workers(problem, p)] = _tile_residual(problem, p, evs, took)
    c0, c1 = _line(overhead) if len(overhead) > 1 else (cal.tile_overhead_s, 0.0)
    fitted = msgspec.structs.replace(cal.problem, concurrency_scale=scale, tile_overhead_s=c0, worker_overhead_s=c1)
    return msgspec.structs.replace(cal, problem=fitted, concurrency_scale=scale, tile_overhead_s=c0,
                                   worker_overhead_s=c1)


def _workers(problem: SpatialProblem, plan: SpatialPlan) -> float:
    """Workers per tile, on average over the plan's tiles (a small map has fewer columns than devices)."""
    return statistics.mean(sum(1 for d, w in zip(plan.devices, ws) if w and d != problem.gateway)
                           for ws in plan.widths)


def _computing(plan: SpatialPlan) -> int:
    return max(sum(1 for w in ws if w) for ws in plan.widths)


def _per_count(rho: dict[int, float], n: int) -> tuple[float, ...]:
    """The factor for 1..n computing devices: measured where there is a run, else linear between
    the nearest measured counts (the nearest one beyond either end)."""
    known = sorted(rho)
    out = []
    for k in range(1, n + 1):
        lo = max((c for c in known if c <= k), default=None)
        hi = min((c for c in known if c >= k), default=None)
        if lo is None or hi is None or lo == hi:
            out.append(rho[lo if hi is None else hi if lo is None else lo])
        else:
            out.append(rho[lo] + (rho[hi] - rho[lo]) * (k - lo) / (hi - lo))
    return tuple(out)


def _line(points: dict[float, float]) -> tuple[float, float]:
    """Least squares y = c0 + c1·x over ``points`` with both coefficients ≥ 0."""
    xs, ys = list(points), [points[x] for x in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    c1 = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    c0 = my - c1 * mx
    if c1 < 0:
        return max(0.0, my), 0.0
    if c0 < 0:
        sx2 = sum(x * x for x in xs)
        return 0.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / sx2) if sx2 else 0.0
    return c0, c1


def _compute_scale(problem: SpatialProblem, plan: SpatialPlan, events: Sequence[TimelineEvent]) -> dict[str, float]:
    """Per device: measured / predicted compute seconds over the strips of ``plan`` it computed."""
    spec = problem.model.spec()
    predicted = {(g, d): st.compute_s for g, ((start, end), ws) in enumerate(zip(plan.groups, plan.widths))
                 for d, st in zip(plan.devices, group_times(problem, spec, start, end, plan.devices, ws))}
    measured, pred = defaultdict(float), defaultdict(float)
    for e in events:
        if e.kind == "compute" and (e.stage, e.device) in predicted:
            measured[e.device] += e.end_s - e.start_s
            pred[e.device] += predicted[(e.stage, e.device)]
    return {d: measured[d] / pred[d] for d in measured if pred[d] > 0}


def _calibrate(problem: SpatialProblem, plan: SpatialPlan, events: Sequence[TimelineEvent],
               duration_s: float) -> Calibration:
    spec = problem.model.spec()
    n_groups = len(plan.groups)
    images = sorted({e.step for e in events})
    if not images or duration_s <= 0:
        raise SpatialInputError("the run to calibrate from has no measured image")
    head_m, excess = [], defaultdict(list)
    for e in events:
        took = e.end_s - e.start_s
        if e.kind == "compute" and e.stage == n_groups:
            head_m.append(took)
            continue
        if e.stage >= n_groups or e.device not in plan.devices:
            continue
        if e.kind in ("recv_wait", "send") and e.device != problem.gateway:
            excess[e.device].append(took - e.nbytes / problem.device(e.device).bandwidth_Bps)
    scale = _compute_scale(problem, plan, events)
    if not scale:
        raise SpatialInputError("the run to calibrate from computed no strip")
    head_pred = head_seconds(problem, spec)
    head_scale = statistics.median(head_m) / head_pred if head_m and head_pred > 0 else 1.0
    latency = {d: max(0.0, statistics.median(x)) for d, x in excess.items()}
    devices = []
    for d in problem.devices:
        changes = {}
        if d.id in scale:
            changes["time"] = d.time.scaled(scale[d.id])
        if d.id == problem.gateway:
            changes["fc_time"] = (d.fc_time or d.time).scaled(head_scale)
        if d.id in latency:
            changes["latency_s"] = latency[d.id]
        devices.append(msgspec.structs.replace(d, **changes))
    overhead = _tile_residual(problem, plan, events, duration_s)
    calibrated = msgspec.structs.replace(problem, devices=tuple(devices), tile_overhead_s=overhead)
    return Calibration(problem=calibrated, compute_scale=scale, head_scale=head_scale, latency_s=latency,
                       tile_overhead_s=overhead)



def _tile_residual(problem: SpatialProblem, plan: SpatialPlan, events: Sequence[TimelineEvent],
                   duration_s: float) -> float:
    """What a run took per image and tile beyond its tiles' slowest measured strips and the head:
    the gateway's own work per tile (measured only, no model)."""
    n_groups = len(plan.groups)
    per_image = defaultdict(lambda: defaultdict(float))  # image -> (tile, device) -> seconds
    head_m = []
    for e in events:
        if e.kind == "compute" and e.stage == n_groups:
            head_m.append(e.end_s - e.start_s)
        elif e.stage < n_groups and e.device in plan.devices:
            per_image[e.step][(e.stage, e.device)] += e.end_s - e.start_s
    if not per_image:
        raise SpatialInputError("the run to calibrate from has no measured image")
    tiles = [sum(max(v for (g, _), v in times.items() if g == t) for t in {g for g, _ in times})
             for times in per_image.values()]
    head_each = statistics.median(head_m) if head_m else head_seconds(problem, problem.model.spec())
    return max(0.0, (duration_s / len(per_image) - statistics.mean(tiles) - head_each) / n_groups)


def calibrate_on_agents(link, problem: SpatialProblem, *, images: int = 3, rounds: int = 2,
                        seed: int = 0) -> Calibration:
    """Run the probes on the problem's agents (named as its devices) — even strips over the gateway
    and its first k − 1 workers, k = 1 (the gateway alone) to all — each ``rounds`` times after a
    warm run, and calibrate from the fastest of each (the load of other work only slows a run)."""
    import torch

    from core.runs.metrics import duration_s
    from core.techniques.spatial.partition import per_layer_plan
    from core.techniques.spatial.run import run_spatial

    spec = problem.model.spec()
    x = torch.randn(images, 3, spec.image, spec.image, generator=torch.Generator().manual_seed(seed))
    others = [d.id for d in problem.devices if d.id != problem.gateway]
    probes = {k: per_layer_plan(problem, "even", [problem.gateway, *others[:k - 1]])
              for k in range(1, len(others) + 2)}
    best: dict[int, tuple] = {}
    for plan in probes.values():
        run_spatial(link, problem, plan, x[:1], seed=seed)
    for _ in range(rounds):
        for k, plan in probes.items():
            run = run_spatial(link, problem, plan, x, seed=seed)
            took = duration_s(run.events, run.tokens)
            if k not in best or took < best[k][1]:
                best[k] = (run, took)
    n = len(probes)
    probe_run, probe_s = best[n]
    return calibrate(problem, probes[n], probe_run.events, probe_s,
                     ladder=[(probes[k], best[k][0].events, best[k][1]) for k in range(1, n)])

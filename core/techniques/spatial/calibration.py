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
- with a second run of the gateway alone (``solo``), the host-sharing factor: the gateway's
  compute scale alone over its scale in the probe, as ``concurrency_scale`` (linear from that
  factor with one device computing to 1 with as many as the probe).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

import msgspec

from agents.protocol import TimelineEvent
from core.techniques.spatial.cost import group_times, head_seconds
from core.techniques.spatial.problem import SpatialInputError, SpatialPlan, SpatialProblem, TimeModel, check


class Calibration(msgspec.Struct, frozen=True, kw_only=True):
    problem: SpatialProblem
    """The problem with calibrated time models, latencies and tile overhead."""
    compute_scale: dict[str, float]
    """Per device: measured / predicted compute over the probe's strips."""
    head_scale: float
    latency_s: dict[str, float]
    tile_overhead_s: float
    concurrency_scale: tuple[float, ...] = ()


def _scaled(model: TimeModel, factor: float) -> TimeModel:
    return msgspec.structs.replace(model, a=model.a * factor, b=model.b * factor)


def calibrate(problem: SpatialProblem, plan: SpatialPlan, events: Sequence[TimelineEvent],
              duration_s: float, solo: tuple[SpatialPlan, Sequence[TimelineEvent]] | None = None) -> Calibration:
    """Fit the problem to a real run of ``plan`` (its events and its measured duration), and
    with ``solo`` (a plan of the gateway alone and its run's events) the host sharing.
    ``SpatialInputError`` when a run has no image or no compute to fit from."""
    check(problem, plan)
    base = msgspec.structs.replace(problem, tile_overhead_s=0.0, concurrency_scale=())
    cal = _calibrate(base, plan, events, duration_s)
    if solo is None:
        return cal
    solo_plan, solo_events = solo
    if set(solo_plan.devices) != {problem.gateway}:
        raise SpatialInputError("the solo run must be the gateway alone")
    rho = _compute_scale(cal.problem, solo_plan, solo_events).get(problem.gateway)
    if not rho or problem.gateway not in cal.compute_scale:
        raise SpatialInputError("the solo run and the probe must both have the gateway compute")
    n = max(sum(1 for w in ws if w) for ws in plan.widths)
    scale = tuple(rho + (1 - rho) * (k - 1) / (n - 1) for k in range(1, n + 1)) if n > 1 else (1.0,)
    return msgspec.structs.replace(cal, problem=msgspec.structs.replace(cal.problem, concurrency_scale=scale),
                                   concurrency_scale=scale)


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
    per_image = defaultdict(lambda: defaultdict(float))  # image -> (tile, device) -> seconds
    for e in events:
        took = e.end_s - e.start_s
        if e.kind == "compute" and e.stage == n_groups:
            head_m.append(took)
            continue
        if e.stage >= n_groups or e.device not in plan.devices:
            continue
        per_image[e.step][(e.stage, e.device)] += took
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
            changes["time"] = _scaled(d.time, scale[d.id])
        if d.id == problem.gateway:
            changes["fc_time"] = _scaled(d.fc_time or d.time, head_scale)
        if d.id in latency:
            changes["latency_s"] = latency[d.id]
        devices.append(msgspec.structs.replace(d, **changes))
    tiles = [sum(max(v for (g, _), v in times.items() if g == t) for t in {g for g, _ in times})
             for times in per_image.values()]
    head_each = statistics.median(head_m) if head_m else head_pred
    overhead = max(0.0, (duration_s / len(images) - statistics.mean(tiles) - head_each) / n_groups)
    calibrated = msgspec.structs.replace(problem, devices=tuple(devices), tile_overhead_s=overhead)
    return Calibration(problem=calibrated, compute_scale=scale, head_scale=head_scale, latency_s=latency,
                       tile_overhead_s=overhead)



def calibrate_on_agents(link, problem: SpatialProblem, *, images: int = 3, rounds: int = 2,
                        seed: int = 0) -> Calibration:
    """Run the two probes on the problem's agents (named as its devices) — the gateway alone, and
    even strips over every device — each ``rounds`` times after a warm run, and calibrate from the
    fastest of each (the load of other work only slows a run)."""
    import torch

    from core.runs.metrics import duration_s
    from core.techniques.spatial.partition import per_layer_plan
    from core.techniques.spatial.run import run_spatial

    spec = problem.model.spec()
    x = torch.randn(images, 3, spec.image, spec.image, generator=torch.Generator().manual_seed(seed))
    others = [d.id for d in problem.devices if d.id != problem.gateway]
    solo = per_layer_plan(problem, "even", [problem.gateway])
    probe = per_layer_plan(problem, "even", [problem.gateway, *others])
    best: dict[str, tuple] = {}
    for plan in (solo, probe):
        run_spatial(link, problem, plan, x[:1], seed=seed)
    for _ in range(rounds):
        for key, plan in (("solo", solo), ("probe", probe)):
            run = run_spatial(link, problem, plan, x, seed=seed)
            took = duration_s(run.events, run.tokens)
            if key not in best or took < best[key][1]:
                best[key] = (run, took)
    probe_run, probe_s = best["probe"]
    return calibrate(problem, probe, probe_run.events, probe_s, solo=(solo, best["solo"][0].events))

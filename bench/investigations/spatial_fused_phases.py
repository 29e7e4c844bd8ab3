"""Where a fused plan's time goes, per strip and per phase: bench/spatial_partition.py's emulated
cluster (same slowdowns, links, network), probes and compared plans run round-robin (interleaved)
like that bench, calibrated like it; then the plans made on the calibrated model measured
interleaved with the earlier ones. Per plan, from the run's timeline events (median over images of
each tile) beside the calibrated model's prediction, in ms:

- per worker strip: scatter (``recv_wait``: handed to the gateway's link → computing), compute,
  gather (``send``: computed → at the gateway);
- the gateway: ``pre`` (tile start → its own strip's compute: cutting and framing every worker's
  strip, serially), its compute, ``post`` (the last of its own compute and the gathers → the next
  tile's start or the head: concatenating, the loop);
- the tile's span, predicted (``tile_seconds``) and measured; each computing device's path (tile
  start → its strip back at the gateway, or its own compute's end), predicted and measured, and
  how often each one was the last; the predicted critical device's phases summed over the tiles.

The phase medians are over every round's images (the fastest run of each plan gives its time).

Also every layer of every strip of the fused plans timed alone in this process (1 thread, best of
3, ``SpatialNet.layer_cols``) beside the per-layer time model fitted in this process
(``fit_layer_time_model(layer_timing_samples())``), summed per layer kind: which layer kinds the
model misses.

Run: python bench/investigations/spatial_fused_phases.py [ROUNDS]   (one JSON line; about a minute on 2 cores)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

_HERE = Path(__file__).resolve()
sys.path[:0] = [str(_HERE.parents[2]), str(_HERE.parents[1])]  # this checkout's code, bench/'s shared modules

import msgspec  # noqa: E402
import torch  # noqa: E402

from spatial_partition import (  # noqa: E402
    SLOWDOWNS, calibrate_from_probes, emulated_cluster, fastest_runs, layer_maps, plan_strips)

from agents.arguments import int_in  # noqa: E402
from agents.techniques.spatial.network import build_network, layer_timing_samples  # noqa: E402
from core.techniques.spatial.cost import group_times, tile_seconds  # noqa: E402
from core.techniques.spatial.partition import fused_plan, per_layer_plan  # noqa: E402
from core.techniques.spatial.problem import CnnRef, SpatialProblem, fit_layer_time_model  # noqa: E402
from core.techniques.spatial.simulator import simulate  # noqa: E402

_ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_ARGS.add_argument("rounds", nargs="?", type=int_in(1, 100), default=3, help="measured rounds (default 3)")
_OPTIONS = _ARGS.parse_args()
ROUNDS = _OPTIONS.rounds
MODEL = CnnRef(network="vgg16", image=96, width_div=2, classes=10)


def ms(x: float) -> float:
    return round(x * 1e3, 2)


def phases(problem: SpatialProblem, plan, events) -> dict:
    """Per tile: each strip's measured phases (median over images) beside the prediction."""
    spec = problem.model.spec()
    gw = problem.gateway
    n_groups = len(plan.groups)
    by = defaultdict(lambda: defaultdict(float))  # (image, tile) -> (device, kind) -> seconds
    start = defaultdict(lambda: float("inf"))  # (image, tile) -> first event start
    end = defaultdict(float)  # (image, tile) -> last event end
    head_start = {}
    for e in events:
        if e.stage == n_groups:
            head_start[e.step] = e.start_s
            continue
        by[(e.step, e.stage)][(e.device, e.kind)] += e.end_s - e.start_s
        by[(e.step, e.stage)][(e.device, "end")] = max(by[(e.step, e.stage)][(e.device, "end")], e.end_s)
        start[(e.step, e.stage)] = min(start[(e.step, e.stage)], e.start_s)
        end[(e.step, e.stage)] = max(end[(e.step, e.stage)], e.end_s)
        if e.device == gw and e.kind == "compute":
            by[(e.step, e.stage)][(gw, "compute_start")] = e.start_s
    images = sorted({s for s, _ in by})
    tiles, totals = [], defaultdict(lambda: [0.0, 0.0])
    for g, ((s, t), ws) in enumerate(zip(plan.groups, plan.widths)):
        times = group_times(problem, spec, s, t, plan.devices, ws)
        row = {"layers": [s, t], "kinds": "".join(layer.kind[0] for layer in spec.layers[s:t]),
               "pred_span": ms(tile_seconds(problem, plan.devices, ws, times))}
        span_m, pre_m, post_m = [], [], []
        for i in images:
            nxt = start.get((i, g + 1), head_start.get(i, end[(i, g)])) if g + 1 < n_groups else head_start.get(
                i, end[(i, g)])
            span_m.append(nxt - start[(i, g)])
            post_m.append(nxt - end[(i, g)])
            cs = by[(i, g)].get((gw, "compute_start"))
            if cs is not None:
                pre_m.append(cs - start[(i, g)])
        last = defaultdict(int)
        paths = defaultdict(list)
        for i in images:
            ends = {d: by[(i, g)][(d, "end")] - start[(i, g)] for d, w in zip(plan.devices, ws) if w}
            last[max(ends, key=ends.get)] += 1
            for d, v in ends.items():
                paths[d].append(v)
        row["last"] = dict(last)
        row["path_pred_meas"] = {d: [ms(st.total_s), ms(statistics.median(paths[d]))]
                                 for d, st, w in zip(plan.devices, times, ws) if w}
        row["span"] = ms(statistics.median(span_m))
        row["gw_pre"] = ms(statistics.median(pre_m)) if pre_m else None
        row["post"] = ms(statistics.median(post_m))
        crit_pred = max(range(len(times)), key=lambda k: times[k].total_s)
        row["critical_pred"] = plan.devices[crit_pred]
        for d, st, w in zip(plan.devices, times, ws):
            if not w:
                continue
            med = {k: statistics.median(by[(i, g)].get((d, k), 0.0) for i in images)
                   for k in ("recv_wait", "compute", "send")}
            cell = {"w": w, "c": [ms(st.compute_s), ms(med["compute"])]}
            if d != gw:
                cell["s"] = [ms(st.scatter_s), ms(med["recv_wait"])]
                cell["g"] = [ms(st.gather_s), ms(med["send"])]
                cell["bytes"] = [st.in_bytes, st.out_bytes]
            row[d] = cell
            for k, (p, m) in (("compute", (st.compute_s, med["compute"])),
                              ("scatter", (st.scatter_s, med["recv_wait"])),
                              ("gather", (st.gather_s, med["send"]))):
                if d == plan.devices[crit_pred]:
                    totals[f"critical_{k}"][0] += p
                    totals[f"critical_{k}"][1] += m
        totals["span"][0] += row["pred_span"] / 1e3
        totals["span"][1] += row["span"] / 1e3
        totals["gw_pre"][1] += (row["gw_pre"] or 0.0) / 1e3
        totals["post"][1] += row["post"] / 1e3
        tiles.append(row)
    overhead_pred = problem.tile_overhead_s * n_groups + problem.worker_overhead_s * sum(
        sum(1 for d, w in zip(plan.devices, ws) if w and d != gw) for ws in plan.widths)
    totals["tile+worker_overhead"][0] += overhead_pred
    return {"tiles": tiles, "sum_ms_pred_meas": {k: [ms(p), ms(m)] for k, (p, m) in totals.items()}}


def layer_check(problem: SpatialProblem, plans: dict) -> dict:
    """Every layer of every strip of ``plans`` timed alone here (1 thread) against a per-layer
    model fitted here: measured / predicted summed per layer kind, and the worst layers."""
    torch.set_num_threads(1)
    fit = fit_layer_time_model(layer_timing_samples(threads=1))
    spec = problem.model.spec()
    net = build_network(spec, seed=0)
    x = torch.randn(1, 3, spec.image, spec.image, generator=torch.Generator().manual_seed(0))
    kinds = defaultdict(lambda: [0.0, 0.0])
    worst = []
    with torch.inference_mode():
        full = layer_maps(net, x)
        for key, plan in plans.items():
            for s, t, _lo, _hi, ranges in plan_strips(spec, plan):
                layers = spec.layers[s:t]
                for j, (layer, (i0, i1), (o0, o1)) in enumerate(zip(layers, ranges, ranges[1:])):
                    xin = full[s + j][..., i0:i1].contiguous()
                    net.layer_cols(s + j, xin, i0, o0, o1)
                    best = float("inf")
                    for _ in range(3):
                        t0 = time.perf_counter()
                        net.layer_cols(s + j, xin, i0, o0, o1)
                        best = min(best, time.perf_counter() - t0)
                    pred = fit.strip_seconds(layer, i1 - i0, o1 - o0)
                    kinds[f"{key}:{layer.kind}"][0] += pred
                    kinds[f"{key}:{layer.kind}"][1] += best
                    worst.append((best / pred, key, s + j, layer.kind, layer.c_in, layer.h_in, i1 - i0, o1 - o0,
                                  ms(pred), ms(best)))
    worst.sort(reverse=True)
    return {"fit": {"gflops": round(1e-9 / fit.a, 1), "b_ms": ms(fit.b),
                    "w_ms_per_mb": ms(fit.per_weight_byte * 1e6), "m_ms_per_mb": ms(fit.per_activation_byte * 1e6),
                    "median_rel_error": round(fit.median_rel_error, 3)},
            "by_kind_ms_pred_meas": {k: [ms(p), ms(m), round(m / p, 2)] for k, (p, m) in kinds.items()},
            "worst": [list(w[1:]) + [round(w[0], 2)] for w in worst[:12]]}


def main() -> int:
    out = {"bench": "spatial_fused_phases", "loadavg": open("/proc/loadavg").read().split()[:3], "rounds": ROUNDS}
    slow = SLOWDOWNS
    order = list(slow)
    images = torch.randn(3, 3, 96, 96, generator=torch.Generator().manual_seed(0))
    with emulated_cluster(MODEL, "spatial-phases-") as (link, problem, models):
        out["profiled"] = {d: {"gflops": round(1e-9 / m[0].a, 2), "b_ms": ms(m[0].b),
                               "w_ms_per_mb": ms(m[0].per_weight_byte * 1e6),
                               "m_ms_per_mb": ms(m[0].per_activation_byte * 1e6)} for d, m in models.items()}

        every: dict = defaultdict(list)  # plan -> every run's events, images renumbered

        def renumbered(key, run) -> None:
            base = 1000 * len(every[key])
            every[key].append([msgspec.structs.replace(e, step=base + e.step) for e in run.events])

        def fastest(plans: dict, best: dict) -> None:
            best.update(fastest_runs(link, problem, plans, images, ROUNDS, on_run=renumbered))

        probes = {k: per_layer_plan(problem, "even", order[:k]) for k in range(1, 5)}
        plans = {f"probe/{k}": p for k, p in probes.items()}
        plans["fused/2"] = fused_plan(problem, order[:2])
        plans["fused/4"] = fused_plan(problem, order)
        plans["cbps/4"] = per_layer_plan(problem, "cbps", order)
        best: dict = {}
        fastest(plans, best)
        cal = calibrate_from_probes(problem, probes, best)
        cp = cal.problem
        out["calibration"] = {"sharing": [round(x, 3) for x in cal.concurrency_scale],
                              "compute_scale": {d: round(v, 3) for d, v in cal.compute_scale.items()},
                              "tile_ms": ms(cal.tile_overhead_s), "worker_ms": ms(cal.worker_overhead_s),
                              "latency_ms": {d: ms(v) for d, v in cal.latency_s.items()}}
        later = {"fused-calibrated/4": fused_plan(cp, order), "cbps-calibrated/4": per_layer_plan(cp, "cbps", order),
                 "fused/4 again": plans["fused/4"],
                 "probe/4 again": probes[4]}
        fastest(later, best)
        plans.update(later)
        for key, plan in plans.items():
            run, took = best[key]
            calp = simulate(cp, plan, images=3).figures.duration_s
            row = {"meas_ms": ms(took / 3), "cal_ms": ms(calp / 3), "cal/meas": round(calp / took, 3),
                   "tiles": len(plan.groups)}
            if not key.startswith("probe") or key.startswith("probe/4"):
                row["phases"] = phases(cp, plan, [e for evs in every[key] for e in evs])
            out[key] = row
        out["loadavg_cluster_after"] = open("/proc/loadavg").read().split()[:3]
    out["layers_in_process"] = layer_check(problem, {"fused/4": plans["fused/4"],
                                                     "fused-calibrated/4": plans["fused-calibrated/4"],
                                                     "probe/4": probes[4]})
    out["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

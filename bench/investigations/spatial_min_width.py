"""Narrow strips: what picks ``partition.MIN_CONV_STRIP_COLUMNS`` and what the rule does to real
runs. One JSON line.

- ``in_process``: every convolution of bench/spatial_partition.py's network (VGG16 96², channels
  / 2), output strips of 1, 2 and 3 columns in the middle of the map, timed alone on one thread
  through the strip path (``compute_strip``, best of 7 × 5 calls), beside the per-layer time
  model fitted in this process (``fit_layer_time_model(layer_timing_samples())``): per layer the
  milliseconds, measured / model, and a 1-column strip's time over a 2-column one's;
- ``cluster``: that bench's emulated cluster (same slowdowns, links, probes, calibration), and
  per partitioner two plans made on the same model — slivers allowed (the rule off: every
  ``min_strip_width`` 1, the partitioners as they were) and the rule on — measured round-robin
  (interleaved, ``ROUNDS`` rounds after a warm run, each plan's fastest), beside the calibrated
  prediction; first the plans on the profiled model (with the calibration probes), then the plans
  on the calibrated model. Plans the rule does not change are run once (``same``).

Run: python bench/investigations/spatial_min_width.py [ROUNDS] [--in-process-only]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve()
sys.path[:0] = [str(_HERE.parents[2]), str(_HERE.parents[1])]  # this checkout's code, bench/'s shared modules

import torch  # noqa: E402

from spatial_partition import SLOWDOWNS, calibrate_from_probes, emulated_cluster, fastest_runs  # noqa: E402

from agents.arguments import int_in  # noqa: E402
from agents.techniques.spatial.network import CnnSpec, build_network, compute_strip, layer_timing_samples  # noqa: E402
from core.techniques.spatial import partition  # noqa: E402
from core.techniques.spatial.problem import CnnRef, fit_layer_time_model  # noqa: E402

_ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_ARGS.add_argument("rounds", nargs="?", type=int_in(1, 100), default=3, help="measured rounds (default 3)")
_ARGS.add_argument("--in-process-only", action="store_true", help="only the in-process strip timings, no cluster")
_OPTIONS = _ARGS.parse_args()
ROUNDS = _OPTIONS.rounds
MODEL = CnnRef(network="vgg16", image=96, width_div=2, classes=10)


def ms(x: float) -> float:
    return round(x * 1e3, 3)


@contextlib.contextmanager
def slivers_allowed():
    """The partitioners as they were before the rule: no strip minimum."""
    keep = partition.min_strip_width
    partition.min_strip_width = lambda layers, conv_columns=1: 1
    try:
        yield
    finally:
        partition.min_strip_width = keep


def in_process() -> dict:
    torch.set_num_threads(1)
    fit = fit_layer_time_model(layer_timing_samples(threads=1))
    spec = MODEL.spec()
    out = {}
    for i, layer in enumerate(spec.layers):
        if layer.kind == "pool":
            continue
        net = build_network(CnnSpec(name="t", image=layer.h_in, layers=(layer,), head_in=1, fc=(1,), flatten=True), 1)
        row = {}
        for w in (1, 2, 3):
            lo = (layer.w_out - w) // 2
            a, b = layer.needs(lo, lo + w)
            x = torch.randn(1, layer.c_in, layer.h_in, b - a, generator=torch.Generator().manual_seed(0))
            data, shape = x.numpy().tobytes(), tuple(x.shape)
            for _ in range(3):
                compute_strip(net, 0, 1, a, lo, lo + w, shape, data)
            best = float("inf")
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(5):
                    compute_strip(net, 0, 1, a, lo, lo + w, shape, data)
                best = min(best, (time.perf_counter() - t0) / 5)
            row[f"{w}col_ms"] = ms(best)
            row[f"{w}col_over_model"] = round(best / fit.strip_seconds(layer, b - a, w), 2)
        row["1col_over_2col"] = round(row["1col_ms"] / row["2col_ms"], 2)
        out[f"{i}: {layer.c_in}->{layer.c_out} {layer.h_in}x{layer.w_in}"] = row
    return out


def slivers(problem, plan) -> int:
    layers = problem.model.spec().layers
    rule = partition.MIN_CONV_STRIP_COLUMNS
    return sum(1 for (s, e), ws in zip(plan.groups, plan.widths)
               for w in ws if 0 < w < partition.min_strip_width(layers[s:e], rule))


def cluster() -> dict:
    from core.techniques.spatial.simulator import simulate

    order = list(SLOWDOWNS)
    images = torch.randn(3, 3, 96, 96, generator=torch.Generator().manual_seed(0))
    out: dict = {}

    def pairs(problem, prefix: str) -> dict:
        made = {}
        for name in ("cbps", "bodp", "fused"):
            def make(p=problem, name=name):
                return partition.fused_plan(p, order) if name == "fused" else partition.per_layer_plan(p, name, order)
            with slivers_allowed():
                old = make()
            new = make()
            if new == old:
                made[f"{prefix}{name}/4 same"] = new
            else:
                made[f"{prefix}{name}/4 slivers"], made[f"{prefix}{name}/4 rule"] = old, new
        return made

    with emulated_cluster(MODEL, "spatial-minwidth-") as (link, problem, _):
        best: dict = {}

        def fastest(plans: dict) -> None:
            best.update(fastest_runs(link, problem, plans, images, ROUNDS))

        probes = {k: partition.per_layer_plan(problem, "even", order[:k]) for k in range(1, 5)}
        plans = {f"probe/{k}": p for k, p in probes.items()} | pairs(problem, "")
        fastest(plans)
        cal = calibrate_from_probes(problem, probes, best)
        later = pairs(cal.problem, "calibrated ")
        fastest(later)
        plans.update(later)
        for key, plan in plans.items():
            took = best[key][1]
            pred = simulate(cal.problem, plan, images=3).figures.duration_s
            out[key] = {"meas_ms": ms(took / 3), "cal_ms": ms(pred / 3), "cal/meas": round(pred / took, 3),
                        "slivers": slivers(problem, plan)}
    return out


def main() -> int:
    doc = {"bench": "spatial_min_width", "rounds": ROUNDS, "loadavg": open("/proc/loadavg").read().split()[:3],
           "min_conv_strip_columns": partition.MIN_CONV_STRIP_COLUMNS, "in_process": in_process()}
    if not _OPTIONS.in_process_only:
        doc["cluster"] = cluster()
    doc["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Spatial CNN partitioning (EdgeMI, issue 17) benchmark: prints one JSON line.

- exactness: for VGG16 and the ResNet-style net (64×64 input, channels / 8) and every
  partitioner's plan on a 3-device problem, max |partitioned − single device| of the class
  scores (real torch, strips cut with halos exactly as the gateway cuts them);
- time-model fit error on this machine, per emulated device (1 and 2 torch threads):
  median |predicted − measured| / measured over the profiling samples;
- the time model against real strip compute: every strip of the fused and CBPS plans timed
  for real through the agent's path (``compute_strip``, best of 3) beside a·FLOPs + b per
  layer (median relative error);
- simulated, paper-shaped scenario (VGG16 224², Raspberry-Pi-class nodes, 1 Gbit/s): speedup
  over one device of CBPS / BODP / even / fused with 2 and 4 nodes (paper: CBPS 1.84×, 3.58×),
  and the device count the planner picks (per-layer CBPS and fused) as bandwidth falls.

- measured on a local cluster of 4 real agents over CurveZMQ, emulating slow heterogeneous
  devices (compute slowdown 4, 6, 8, 8: the slowdown sleeps, so 4 agents share 2 cores like
  4 devices): speedup over the gateway alone with 2 and 4 devices for CBPS / BODP / even /
  fused (fused with the devices fixed), and the simulator's prediction for each, from time
  models profiled on the agents and each strip path's latency and bandwidth measured with
  cheap ComputeStrip round trips (``measure_strip_links``). The scatter/gather goes through the coordinator's control
  channel, which the agents' emulated links do not shape (docs/spatial.md).

Run: python bench/spatial_partition.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from agents.spatial import (  # noqa: E402
    build_network, compute_strip, conv_timing_samples, group_input_ranges, run_partitioned, strip_bounds,
)
from core.techniques.spatial.cost import evaluate, single_device_seconds  # noqa: E402
from core.techniques.spatial.partition import per_layer_plan, with_best_device_count  # noqa: E402
from core.techniques.spatial.problem import (  # noqa: E402
    CnnRef, SpatialDevice, SpatialProblem, TimeModel, fit_time_model,
)
from core.techniques.spatial.scenarios import paper_shaped  # noqa: E402
from core.techniques.spatial.strategies import ORDER, run_strategy  # noqa: E402


def local_problem(network: str, fit: TimeModel) -> SpatialProblem:
    """Three devices shaped by this machine's fit: 1×, 2× and 3× slower, 100/50 Mbit/s links."""
    devices = tuple(SpatialDevice(id=f"d{i}", time=TimeModel(a=fit.a * f, b=fit.b * f), bandwidth_Bps=bw * 1e6 / 8,
                                  latency_s=2e-4) for i, (f, bw) in enumerate(((1, 1), (2, 100), (3, 50))))
    return SpatialProblem(name=f"local-{network}", model=CnnRef(network=network, image=64, width_div=8, classes=10),
                          devices=devices, gateway="d0")


def exactness(fit: TimeModel) -> dict:
    out = {}
    for network in ("vgg16", "resnet-style"):
        problem = local_problem(network, fit)
        net = build_network(problem.model.spec(), seed=0)
        x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            ref = net.forward(x)
            for name in ORDER:
                plan = run_strategy(problem, name).plan
                got = run_partitioned(net, x, plan.groups, plan.widths)
                out[f"{network}/{name}"] = float((got - ref).abs().max())
    return out


def strip_prediction(fit: TimeModel) -> float:
    """Median |a·FLOPs + b − measured| / measured over every strip of two plans (1 thread)."""
    torch.set_num_threads(1)
    errs = []
    problem = local_problem("vgg16", fit)
    spec = problem.model.spec()
    net = build_network(spec, seed=0)
    x = torch.randn(1, 3, 64, 64)
    with torch.inference_mode():
        for name in ("fused", "cbps"):
            plan = run_strategy(problem, name).plan
            h = x
            for (start, end), ws in zip(plan.groups, plan.widths):
                layers = spec.layers[start:end]
                for lo, hi in strip_bounds(ws):
                    if hi <= lo:
                        continue
                    ranges = group_input_ranges(layers, lo, hi)
                    a, b = ranges[0]
                    piece = h[..., a:b].contiguous()
                    data, shape = piece.numpy().tobytes(), tuple(piece.shape)
                    compute_strip(net, start, end, a, lo, hi, shape, data)
                    best = min(_timed(lambda: compute_strip(net, start, end, a, lo, hi, shape, data))
                               for _ in range(3))
                    pred = sum(fit.seconds(layer.flops(r[1] - r[0])) for layer, r in zip(layers, ranges[1:]))
                    errs.append(abs(pred - best) / best)
                h = run_partitioned_features(net, h, start, end, ws)
    return statistics.median(errs)


def run_partitioned_features(net, x, start, end, widths):
    layers = net.spec.layers[start:end]
    parts = []
    for lo, hi in strip_bounds(widths):
        if hi > lo:
            a, b = group_input_ranges(layers, lo, hi)[0]
            parts.append(net.strip(start, end, x[..., a:b], a, lo, hi))
    return torch.cat(parts, dim=-1)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def paper_figures() -> dict:
    speedups = {}
    for nodes in (2, 4):
        p = paper_shaped(nodes)
        one = single_device_seconds(p)
        for name in ORDER:
            speedups[f"{name}/{nodes}"] = round(one / run_strategy(p, name).latency_s, 3)
    counts = {}
    for mbps in (1000, 300, 100, 30, 10, 3, 1, 0.3):
        p = paper_shaped(4, mbps)
        cbps = with_best_device_count(p, lambda q, d: per_layer_plan(q, "cbps", d))
        fused = run_strategy(p, "fused").plan
        counts[str(mbps)] = {"cbps_devices": len(cbps.devices),
                             "cbps_speedup": round(single_device_seconds(p) / evaluate(p, cbps).latency_s, 3),
                             "fused_devices": len(fused.devices),
                             "fused_speedup": round(single_device_seconds(p) / evaluate(p, fused).latency_s, 3)}
    return {"speedup": speedups, "paper": {"cbps/2": 1.84, "cbps/4": 3.58}, "devices_by_mbps": counts}


def measured_local_cluster() -> dict:
    import tempfile

    from msgspec import structs

    from agents.emulation import DeviceEmulation
    from core.devices.agent_link import AgentLink
    from core.devices.local_cluster import LocalCluster
    from core.runs.metrics import duration_s
    from core.techniques.spatial.partition import fused_plan
    from core.techniques.spatial.profiling import measure_strip_links, profile_device_models
    from core.techniques.spatial.run import run_spatial
    from core.techniques.spatial.simulator import simulate

    slow = {"local-0": 4.0, "local-1": 6.0, "local-2": 8.0, "local-3": 8.0}
    model = CnnRef(network="vgg16", image=64, width_div=2, classes=10)
    images = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    out = {"slowdowns": slow, "network": model.spec().name, "images": 3, "speedup": {}, "predicted": {},
           "predicted_over_measured": {}}
    with LocalCluster(tempfile.mkdtemp(prefix="spatial-bench-"), list(slow),
                      emulation={d: DeviceEmulation(compute_slowdown=f) for d, f in slow.items()}) as lc:
        with AgentLink(lc.endpoints, lc.keys, heartbeat_timeout_s=60.0, request_timeout_s=300.0) as link:
            link.wait_ready(timeout_s=60)
            link.sync_clocks()
            models = profile_device_models(link, list(slow), sizes=[16, 32, 48, 64], channels=[32, 64], repeats=3)
            out["agent_fit_median_rel_error"] = {d: {"conv": round(m.median_rel_error, 4),
                                                     "fc": round(fc.median_rel_error, 4)}
                                                 for d, (m, fc) in models.items()}
            links = measure_strip_links(link, list(slow))
            out["strip_link"] = {d: {"mbit_s": round(bw * 8 / 1e6, 1), "latency_ms": round(lat * 1e3, 3)}
                                 for d, (bw, lat) in links.items()}
            devices = tuple(SpatialDevice(id=d, time=models[d][0], fc_time=models[d][1], bandwidth_Bps=links[d][0], latency_s=links[d][1])
                            for d in slow)
            problem = SpatialProblem(name="local-cluster", model=model, devices=devices, gateway="local-0")
            order = list(slow)

            def timed(plan) -> tuple[float, float]:
                run_spatial(link, problem, plan, images[:1])  # warm: networks generated, kernels built
                run = run_spatial(link, problem, plan, images)
                return duration_s(run.events, run.tokens), simulate(problem, plan, images=3).figures.duration_s

            one_meas, one_pred = timed(per_layer_plan(problem, "even", order[:1]))
            out["one_device_s"] = {"measured": round(one_meas, 4), "predicted": round(one_pred, 4)}
            for k in (2, 4):
                for name in ("cbps", "bodp", "even", "fused"):
                    plan = fused_plan(problem, order[:k]) if name == "fused" else per_layer_plan(problem, name,
                                                                                                 order[:k])
                    meas, pred = timed(plan)
                    key = f"{name}/{k}"
                    out["speedup"][key] = round(one_meas / meas, 3)
                    out["predicted"][key] = round(one_pred / pred, 3)
                    out["predicted_over_measured"][key] = round(pred / meas, 3)
    return out


def main() -> int:
    load = open("/proc/loadavg").read().split()[:3]
    fits = {}
    for threads in (1, 2):
        fit = fit_time_model(conv_timing_samples(threads=threads))
        fits[f"threads-{threads}"] = {"gflops": round(1e-9 / fit.a, 2), "b_ms": round(fit.b * 1e3, 4),
                                      "median_rel_error": round(fit.median_rel_error, 4)}
        if threads == 1:
            fit1 = fit
    torch.set_num_threads(1)
    doc = {
        "bench": "spatial_partition",
        "loadavg": load,
        "max_abs_error": exactness(fit1),
        "time_model_fit": fits,
        "strip_compute_median_rel_error": round(strip_prediction(fit1), 4),
        "simulated_paper_shaped": paper_figures(),
        "measured_local_cluster": measured_local_cluster(),
    }
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

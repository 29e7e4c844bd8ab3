"""Where a fused plan's time goes: fused / CBPS with 2 and 4 devices on bench/spatial_partition.py's
emulated cluster (same slowdowns and links), calibrated like that bench from even probes over
1..4 devices, each plan's fastest of ROUNDS runs; per plan the profiled and calibrated prediction
over measured, and per tile the calibrated prediction beside the measured median of each device's
compute ("c"), scatter ("s") and gather ("g") and the tile's span, in ms. One JSON line.

Run: python bench/spatial_fused_breakdown.py [ROUNDS]   (lighter than spatial_partition.py --measured-only)
"""
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from spatial_partition import LINK_LATENCY_MS, LINK_MBIT, SLOWDOWNS  # noqa: E402
from agents.emulation import DeviceEmulation
from core.devices.agent_link import AgentLink
from core.devices.local_cluster import LocalCluster
from core.runs.metrics import duration_s
from core.techniques.spatial.calibration import calibrate
from core.techniques.spatial.cost import group_times, tile_seconds
from core.techniques.spatial.partition import fused_plan, per_layer_plan
from core.techniques.spatial.problem import CnnRef, SpatialDevice, SpatialProblem
from core.techniques.spatial.profiling import profile_device_models
from core.techniques.spatial.run import run_spatial
from core.techniques.spatial.simulator import simulate

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
slow = SLOWDOWNS
model = CnnRef(network="vgg16", image=96, width_div=2, classes=10)
images = torch.randn(3, 3, 96, 96, generator=torch.Generator().manual_seed(0))
out = {"loadavg": open("/proc/loadavg").read().split()[:3]}
with LocalCluster(tempfile.mkdtemp(prefix="edgemi2-"), list(slow), link_mbit=LINK_MBIT, link_latency_ms=LINK_LATENCY_MS,
                  emulation={d: DeviceEmulation(compute_slowdown=f) for d, f in slow.items()}) as lc:
    with AgentLink(lc.endpoints, lc.keys, heartbeat_timeout_s=60.0, request_timeout_s=300.0) as link:
        link.wait_ready(timeout_s=60); link.sync_clocks()
        models = profile_device_models(link, list(slow), sizes=[16, 32, 48, 64], channels=[32, 64], repeats=3)
        devices = tuple(SpatialDevice(id=d, time=models[d][0], fc_time=models[d][1], bandwidth_Bps=LINK_MBIT * 1e6 / 8,
                                      latency_s=LINK_LATENCY_MS / 1e3) for d in slow)
        problem = SpatialProblem(name="emulated-cluster", model=model, devices=devices, gateway="local-0")
        order = list(slow)
        probes = {k: per_layer_plan(problem, "even", order[:k]) for k in range(1, 5)}
        plans = {f"probe/{k}": p for k, p in probes.items()}
        plans["fused/2"] = fused_plan(problem, order[:2]); plans["fused/4"] = fused_plan(problem, order)
        plans["cbps/2"] = per_layer_plan(problem, "cbps", order[:2]); plans["cbps/4"] = per_layer_plan(problem, "cbps", order)
        for p in plans.values():
            run_spatial(link, problem, p, images[:1])
        best = {}
        for _ in range(ROUNDS):
            for k, p in plans.items():
                r = run_spatial(link, problem, p, images)
                took = duration_s(r.events, r.tokens)
                if k not in best or took < best[k][1]:
                    best[k] = (r, took)
        cal = calibrate(problem, probes[4], best["probe/4"][0].events, best["probe/4"][1],
                        ladder=[(probes[k], best[f"probe/{k}"][0].events, best[f"probe/{k}"][1]) for k in range(1, 4)])
        cp = cal.problem
        out["cal"] = {"scale": [round(x, 3) for x in cal.concurrency_scale], "compute": {d: round(v, 3) for d, v in cal.compute_scale.items()},
                      "tile_ms": round(cal.tile_overhead_s * 1e3, 3), "worker_ms": round(cal.worker_overhead_s * 1e3, 3),
                      "lat_ms": {d: round(v * 1e3, 3) for d, v in cal.latency_s.items()}}
        spec = model.spec()
        for k in ("fused/2", "fused/4", "cbps/2", "cbps/4", "probe/1", "probe/4"):
            p = plans[k]; r, took = best[k]
            prof = simulate(problem, p, images=3).figures.duration_s
            calp = simulate(cp, p, images=3).figures.duration_s
            out[k] = {"meas_ms": round(took / 3 * 1e3, 1), "prof/meas": round(prof / took, 3), "cal/meas": round(calp / took, 3)}
            if k.startswith("probe"):
                continue
            # per group: measured (median over images) compute per device, scatter, gather, span, vs calibrated
            per = defaultdict(lambda: defaultdict(list))
            span = defaultdict(dict)
            for e in r.events:
                per[(e.stage, e.device, e.kind)][e.step].append(e.end_s - e.start_s)
                s = span[(e.stage, e.step)]
                s["a"] = min(s.get("a", 1e9), e.start_s); s["b"] = max(s.get("b", -1e9), e.end_s)
            rows = []
            for g, ((start, end), ws) in enumerate(zip(p.groups, p.widths)):
                times = group_times(cp, spec, start, end, p.devices, ws)
                pred_span = tile_seconds(cp, p.devices, ws, times)
                meas_span = statistics.median(v["b"] - v["a"] for (gg, _), v in span.items() if gg == g)
                row = {"g": [start, end], "span": [round(pred_span * 1e3, 2), round(meas_span * 1e3, 2)]}
                for d, st, w in zip(p.devices, times, ws):
                    if not w: continue
                    m = lambda kind: round(statistics.median(sum(v) for v in per[(g, d, kind)].values()) * 1e3, 2) if per[(g, d, kind)] else 0.0
                    row[d] = {"c": [round(st.compute_s * 1e3, 2), m("compute")], "s": [round(st.scatter_s * 1e3, 2), m("recv_wait")], "g": [round(st.gather_s * 1e3, 2), m("send")]}
                rows.append(row)
            head_m = statistics.median(e.end_s - e.start_s for e in r.events if e.stage == len(p.groups))
            out[k]["head_ms"] = round(head_m * 1e3, 2)
            out[k]["groups"] = rows
        out["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
print(json.dumps(out))

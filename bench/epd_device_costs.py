"""EPD per-device phase costs on the demo's cluster (issue 26 item 1): prints one JSON line.

The demo's three emulated devices (``gui.demo_cluster``: edge-a 1×, edge-b 1.5×, edge-c 8×
slower, their links and budgets) serve the shipped ``demo-llava``. Its phases are measured
with ``on_agents.measure_costs`` — every phase timed on every agent (three rotations) — twice on
the same agents, one after the other (``--after-first`` swaps them): ``before`` as stop 35 measured
(no untimed first call of each phase after loading, and the tiles' trip to the encode agent drawn
inside the encode span: ``encode_input_s_per_tile`` 0) and ``after`` (``warm_up``, the trip before
the span, as the agent times it).

Then layouts are served for real on a workload none of the probes used (``--seed``), and each
device's phases (medians over the requests: ``on_agents.phase_seconds``) are set predicted
beside measured, for both costs against the same runs; ``within_20pct`` counts the phases
predicted within ±20 %. The 1-minute load is printed beside each step.

``scaling``: whether one measured phase scaled by a device's compute factor would do instead:
for each phase, its per-device time over edge-a's (a device's factor is the same for every
phase if scaling holds) beside the emulated slowdown.

Tokens of every run equal the single-process ``generate()`` (``tokens_equal``).

Run: python bench/epd_device_costs.py [--seed 11] [--after-first] [--slowdowns 8,12,16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgspec  # noqa: E402

from core.devices.agent_link import AgentLink  # noqa: E402
from core.devices.local_cluster import LocalCluster  # noqa: E402
from core.techniques.phase_disaggregation.on_agents import (  # noqa: E402
    agent_workload, measure_costs, phase_fit,
)
from core.techniques.phase_disaggregation.runtime import (  # noqa: E402
    load_pools, prepare_requests, reference_tokens, run_epd,
)
from core.techniques.phase_disaggregation.simulator import simulate_pools  # noqa: E402
from core.techniques.phase_disaggregation.types import PoolConfig  # noqa: E402
from gui.demo_cluster import DEMO_DEVICES, DEMO_LINK_LATENCY_MS, demo_emulation, demo_shape  # noqa: E402
from gui.demo_model import demo_checkpoints, shipped_model_dir  # noqa: E402

LAYOUTS = {
    "epd as measured (E a, P b, D c)": PoolConfig(encode=("edge-a",), prefill=("edge-b",), decode=("edge-c",)),
    "epd swapped (E c, P a, D b)": PoolConfig(encode=("edge-c",), prefill=("edge-a",), decode=("edge-b",)),
    "pd (EP b, D a)": PoolConfig(disaggregation="pd", encode=("edge-b",), prefill=("edge-b",), decode=("edge-a",)),
    "aggregated": PoolConfig(disaggregation="aggregated", encode=DEMO_DEVICES, prefill=DEMO_DEVICES,
                             decode=DEMO_DEVICES),
}


def _load() -> float:
    return round(os.getloadavg()[0], 1)


def _fit_rows(fit) -> list[dict]:
    return [dict(device=f.device, phase=f.phase, predicted_ms=round(f.predicted_s * 1e3, 2),
                 measured_ms=round(f.measured_s * 1e3, 2), ratio=round(f.ratio, 2)) for f in fit]


def as_before(costs):
    """``costs`` priced as before ``encode_input_s_per_tile``: the tiles' trip inside the encode span."""
    return msgspec.structs.replace(costs, encode_input_s_per_tile=0.0, devices=tuple(
        msgspec.structs.replace(d, encode_input_s_per_tile=0.0) for d in costs.devices))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=11, help="the served workload's seed (not one the probes used)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3, help="each probe's repeats (the studio's: 3)")
    ap.add_argument("--after-first", action="store_true", help="measure the after costs first")
    ap.add_argument("--slowdowns", metavar="A,B,C", help="each device's emulated slowdown instead of the demo's "
                    "(e.g. 8,12,16: every device timed by CPU time x F, so a shared host's load stays out of "
                    "the figures; the demo's 1x and 1.5x devices take their wall time)")
    args = ap.parse_args()
    checkpoints = demo_checkpoints(shipped_model_dir())
    llava, llama = checkpoints["phase-disaggregation"], checkpoints["layer-sharding"]
    emulation = demo_emulation(DEMO_DEVICES, llama)
    if args.slowdowns:
        factors = [float(f) for f in args.slowdowns.split(",")]
        emulation = {d: dataclasses.replace(emulation[d], compute_slowdown=f) for d, f in zip(DEMO_DEVICES, factors)}
    out: dict = {"load_start": _load(), "model": os.path.basename(llava),
                 "slowdowns": {d: e.compute_slowdown for d, e in emulation.items()}}
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(tmp, list(DEMO_DEVICES), link_mbit={d: demo_shape(d).link_mbit for d in DEMO_DEVICES},
                         link_latency_ms=DEMO_LINK_LATENCY_MS, emulation=emulation) as lc, \
            AgentLink(lc.endpoints, lc.keys, request_timeout_s=120.0, heartbeat_timeout_s=30.0) as link:
        link.wait_ready(timeout_s=60)
        measured = {}
        for name in ("after", "before") if args.after_first else ("before", "after"):
            t0 = time.perf_counter()
            measured[name] = measure_costs(link, llava, DEMO_DEVICES, repeats=args.repeats, warm_up=name == "after")
            out[f"measure_{name}_s"] = round(time.perf_counter() - t0, 1)
            out[f"load_after_measure_{name}"] = _load()
        costs = measured["after"]
        single = as_before(measured["before"])
        out["costs"] = {name: {d.device: dict(
            encode_2_tiles_ms=round(c.encode_s(2, d.device) * 1e3, 2),
            encode_trip_2_tiles_ms=round(c.encode_input_s(2, d.device) * 1e3, 2),
            prefill_48_tokens_ms=round(c.prefill_s(48, d.device) * 1e3, 2),
            decode_step_ms=[round(c.decode_step_seconds(b, d.device) * 1e3, 2) for b in (1, 2, 4)])
            for d in c.devices} for name, c in measured.items()}
        a = DEMO_DEVICES[0]  # a phase at a size the workload has: 2 tiles, 48 prompt tokens, a step of 1
        out["scaling"] = {d.device: dict(
            encode=round(costs.encode_s(2, d.device) / costs.encode_s(2, a), 2),
            prefill=round(costs.prefill_s(48, d.device) / costs.prefill_s(48, a), 2),
            decode=round(costs.decode_step_seconds(1, d.device) / costs.decode_step_seconds(1, a), 2),
            emulated_slowdown=emulation[d.device].compute_slowdown) for d in costs.devices}
        workload = agent_workload(requests=args.requests, rate_rps=args.rate, seed=args.seed)
        prepared = prepare_requests(llava, workload)
        reference = reference_tokens(llava, prepared)
        layouts = {}
        for name, pools in LAYOUTS.items():
            load_pools(link, llava, pools)
            link.sync_clocks()
            run = run_epd(link, llava, workload, pools, prepared=prepared)
            before = phase_fit(simulate_pools(single, workload, pools).metrics, run.metrics)
            after = phase_fit(simulate_pools(costs, workload, pools).metrics, run.metrics)
            layouts[name] = dict(
                tokens_equal=run.tokens == reference, load=_load(),
                before=_fit_rows(before), after=_fit_rows(after),
                within_20pct_before=f"{sum(abs(f.ratio - 1) <= 0.2 for f in before)}/{len(before)}",
                within_20pct_after=f"{sum(abs(f.ratio - 1) <= 0.2 for f in after)}/{len(after)}")
        out["layouts"] = layouts
        for name in ("before", "after"):  # over every layout: how many within ±20 %, the median error factor
            ratios = [r["ratio"] for lay in layouts.values() for r in lay[name]]
            out[f"within_20pct_{name}"] = f"{sum(abs(r - 1) <= 0.2 for r in ratios)}/{len(ratios)}"
            out[f"median_error_factor_{name}"] = round(statistics.median(max(r, 1 / r) for r in ratios), 2)
    out["load_end"] = _load()
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""EPD per-device phase costs on the demo's cluster (issue 26 item 1): prints one JSON line.

The demo's three emulated devices (``gui.demo_cluster``: edge-a 1×, edge-b 1.5×, edge-c 8×
slower, their links and budgets) serve the shipped ``demo-llava``. Its phases are measured
once with ``on_agents.measure_costs`` — every phase timed on every agent (three rotations) —
which also gives the one-calibration costs the studio used before (the first rotation alone:
encode timed on edge-a, prefill on edge-b, decode on edge-c, every device priced at those).

Then layouts are served for real on a workload none of the probes used (``--seed``), and each
device's phases (medians over the requests: ``on_agents.phase_seconds``) are set predicted
beside measured, for the one calibration (``before``) and the per-device one (``after``);
``within_20pct`` counts the phases predicted within ±20 %.

``scaling``: whether one measured phase scaled by a device's compute factor would do instead:
for each phase, its per-device time over edge-a's (a device's factor is the same for every
phase if scaling holds) beside the emulated slowdown.

Tokens of every run equal the single-process ``generate()`` (``tokens_equal``).

Run: python bench/epd_device_costs.py [--rounds 1] [--seed 11]
"""

from __future__ import annotations

import argparse
import json
import os
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=11, help="the served workload's seed (not one the probes used)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3, help="each probe's repeats (the studio's: 3)")
    args = ap.parse_args()
    checkpoints = demo_checkpoints(shipped_model_dir())
    llava, llama = checkpoints["phase-disaggregation"], checkpoints["layer-sharding"]
    emulation = demo_emulation(DEMO_DEVICES, llama)
    out: dict = {"load_start": _load(), "model": os.path.basename(llava)}
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(tmp, list(DEMO_DEVICES), link_mbit={d: demo_shape(d).link_mbit for d in DEMO_DEVICES},
                         link_latency_ms=DEMO_LINK_LATENCY_MS, emulation=emulation) as lc, \
            AgentLink(lc.endpoints, lc.keys, request_timeout_s=120.0, heartbeat_timeout_s=30.0) as link:
        link.wait_ready(timeout_s=60)
        t0 = time.perf_counter()
        costs = measure_costs(link, llava, DEMO_DEVICES, repeats=args.repeats)
        out["measure_s"] = round(time.perf_counter() - t0, 1)
        out["load_after_measure"] = _load()
        single = msgspec.structs.replace(costs, devices=())
        out["costs"] = {d.device: dict(encode_2_tiles_ms=round(costs.encode_s(2, d.device) * 1e3, 2),
                                       prefill_48_tokens_ms=round(costs.prefill_s(48, d.device) * 1e3, 2),
                                       decode_step_ms=round(costs.decode_step_seconds(1, d.device) * 1e3, 2))
                        for d in costs.devices}
        a = DEMO_DEVICES[0]  # a phase at a size the workload has: 2 tiles, 48 prompt tokens, a step of 1
        out["scaling"] = {d.device: dict(
            encode=round(costs.encode_s(2, d.device) / costs.encode_s(2, a), 2),
            prefill=round(costs.prefill_s(48, d.device) / costs.prefill_s(48, a), 2),
            decode=round(costs.decode_step_seconds(1, d.device) / costs.decode_step_seconds(1, a), 2),
            emulated_slowdown=demo_shape(d.device).slowdown) for d in costs.devices}
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
    out["load_end"] = _load()
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""The paper's setup in miniature, measured on the netns testbed; prints one JSON line.

Edge-Solo, Cloud-Edge-Even, Cloud-Edge-Opt and EdgeShard, planned on the measured profile of
a testbed shaped like the paper's (slow source-cloud link, 50 Mbit/s ±20 % elsewhere, edges
emulated slower than the cloud), each run for real on agents deployed over SSH, each figure
beside the simulator's prediction for the same plan (core.runs.miniature). Needs root.

Usage: nice -n -10 python bench/miniature.py [--layers 8] [--hidden 512] [--new-tokens 24]
       [--rounds 2] [--slow-link-mbit 0.5] [--edge-slowdown 3]
(under nice the testbed's sshd, and so the agents, inherit the priority.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def main() -> None:
    from core.runs.experiments import LABELS, miniature_result
    from core.runs.miniature import MiniatureSetup, measure_miniature

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slow-link-mbit", type=float, default=0.5)
    ap.add_argument("--edge-slowdown", type=float, default=3.0)
    args = ap.parse_args()
    setup = MiniatureSetup(layers=args.layers, hidden=args.hidden, new_tokens=args.new_tokens, rounds=args.rounds,
                           slow_link_mbit=args.slow_link_mbit, edge_slowdown=args.edge_slowdown)
    started = time.perf_counter()
    m = measure_miniature(setup)
    result = miniature_result(m)

    def r2(v):
        return None if v is None else round(v, 2)

    print(json.dumps({
        "bench": "miniature",
        "machine": f"{platform.machine()} {os.cpu_count()} cores, load {m.load[0]:.2f} -> {m.load[1]:.2f}",
        "model": f"llama {setup.layers} layers, hidden {setup.hidden}, fp32",
        "methods": {LABELS[r.method]: {
            "latency_plan": r.stages, "measured_ms": r2(r.measured_ms), "predicted_ms": r2(r.predicted_ms),
            "throughput_plan": r.throughput_stages, "mxk": r.mk, "measured_tok_s": r2(r.measured_tps),
            "predicted_tok_s": r2(r.predicted_tps), "tokens_equal_edge_solo": r.tokens_equal_edge_solo,
            "status": r.status} for r in m.rows},
        "findings": {f.claim: f.held for f in result.findings},
        "links_mbit_ms": m.links,
        "wall_s": round(time.perf_counter() - started, 1),
    }, ensure_ascii=False))


if __name__ == "__main__":
    main()

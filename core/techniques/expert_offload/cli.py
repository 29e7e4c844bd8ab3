"""``edgeshard moe ...``: the technique's own verbs (registered through Technique.register_cli).

scenario writes a problem; compare/plan read one; configure writes a plan's buffer options
beside a checkpoint (``expert-offload.json``), which agents loading the ``expert-offload``
stage kind read. Errors are one line (EdgeShardError), exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec

from core.arguments import float_in
from core.formats import load, save


def register(sub: argparse._SubParsersAction) -> None:
    top = sub.add_parser("moe", help="MoE expert offloading (EdgeMoE): scenario, compare, plan, configure",
                         description="Experts on storage, a bounded expert buffer (docs/expert-offload.md).")
    verbs = top.add_subparsers(dest="moe_command", metavar="VERB", required=True)

    s = verbs.add_parser("scenario", help="write a problem shaped like EdgeMoE's setting (assumed sizes and times)")
    s.add_argument("--budget-fraction", type=float_in(0.0, 1.0, lo_open=True), default=0.25,
                   help="memory budget as a fraction of the whole model")
    s.add_argument("--bandwidth-mbps", type=float_in(0.0, 1e6, lo_open=True), default=200.0,
                   help="storage read bandwidth, MB/s")
    s.add_argument("--out", required=True, metavar="PROBLEM.json")
    s.set_defaults(func=_scenario)

    c = verbs.add_parser("compare", help="EdgeMoE and the paper's baselines side by side")
    c.add_argument("problem", metavar="PROBLEM.json")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=_compare)

    p = verbs.add_parser("plan", help="one strategy's plan")
    p.add_argument("problem", metavar="PROBLEM.json")
    p.add_argument("--strategy", choices=("edgemoe", "io-free", "io-exp", "io-qexp", "sti"), default="edgemoe")
    p.add_argument("--out", metavar="PLAN.json")
    p.set_defaults(func=_plan)

    g = verbs.add_parser("configure", help="write a plan's buffer options beside a checkpoint for its agents")
    g.add_argument("plan", metavar="PLAN.json")
    g.add_argument("model_dir", metavar="MODEL_DIR")
    g.add_argument("--bandwidth-mbps", type=float_in(0.0, 1e6, lo_open=True), default=None,
                   help="make agents throttle expert reads to this (emulate slower storage)")
    g.add_argument("--run-plan", metavar="RUN_PLAN.json",
                   help="also write the plan `edgeshard run --plan` runs: one expert-offload stage on the "
                        "plan's device (its live timeline shows expert reads on a storage lane)")
    g.set_defaults(func=_configure)


def _problem(path: str):
    from core.techniques.expert_offload.problem import OffloadProblem

    return load(path, OffloadProblem)


def _scenario(args) -> int:
    from core.techniques.expert_offload.scenarios import paper_shaped

    save(args.out, paper_shaped(args.budget_fraction, args.bandwidth_mbps * 1e6))
    print(f"wrote {args.out}")
    return 0


def _compare(args) -> int:
    from core.techniques import technique_named

    problem = _problem(args.problem)
    outs = technique_named("expert-offload").compare(problem, "latency")
    if args.json:
        rows = [{"strategy": o.strategy, "status": o.status, "error": o.error, "tokens_per_s": o.tokens_per_s,
                 "plan": msgspec.to_builtins(o.plan) if o.plan else None,
                 "memory_bytes": o.cost.memory_bytes if o.cost else None} for o in outs]
        print(json.dumps({"format": "edgeshard.expert-offload-comparison", "version": 1, "strategies": rows},
                         indent=2))
        return 0
    print(f"{problem.model.name}: budget {problem.memory_budget_bytes / 1e6:.0f} MB, "
          f"storage {problem.bandwidth_bps / 1e6:.0f} MB/s")
    print(f"  {'strategy':<8} {'tokens/s':>9} {'slots':>6} {'bits':>10} {'preload':>8} {'MB':>7}  status")
    for o in outs:
        if o.cost is None:
            print(f"  {o.strategy:<8} {'—':>9} {'—':>6} {'—':>10} {'—':>8} {'—':>7}  {o.status}: {o.error}")
            continue
        print(f"  {o.strategy:<8} {o.tokens_per_s:9.2f} {o.plan.slots:>6} {o.plan.bits.name:>10} "
              f"{o.plan.preload:>8} {o.cost.memory_bytes / 1e6:7.0f}  {o.status}")
    return 0


def _plan(args) -> int:
    from core.errors import EdgeShardError
    from core.techniques.expert_offload.strategies import run_strategy

    out = run_strategy(_problem(args.problem), args.strategy)
    if out.plan is None:
        raise EdgeShardError(out.error)
    if args.out:
        save(args.out, out.plan)
    sys.stdout.write(msgspec.json.encode(out.plan).decode() + "\n")
    return 0


def _configure(args) -> int:
    from core.techniques.expert_offload.problem import OffloadPlan
    from core.techniques.expert_offload.running import run_plan, write_options

    plan = load(args.plan, OffloadPlan)
    bandwidth = None if args.bandwidth_mbps is None else args.bandwidth_mbps * 1e6
    if args.run_plan:
        save(args.run_plan, run_plan(plan, args.model_dir, bandwidth))
        print(f"wrote {Path(args.model_dir) / 'expert-offload.json'} and {args.run_plan} "
              f"(run it: edgeshard run --plan {args.run_plan} --model {args.model_dir} ...)")
        return 0
    print(f"wrote {write_options(plan, args.model_dir, bandwidth)}")
    return 0

"""Solver scale benchmark: prints one JSON line of figures.

- the paper's testbed (12 AGX Orin, 2 Orin NX, 1 RTX 3090; 50 Mbit/s ±20 % between
  edges, 1 Mbit/s to the server), Llama-2-7B/13B/70B: exact latency and throughput times;
- 64 devices of the same classes (50/10/4): plan and proven gap within a 10 s budget;
- harder, every device different (random TFLOPS, bandwidth, memory; no symmetry to
  exploit), 15, 64, 128 and 256 devices: time, proven gap;
- re-plan after one device fails (the second stage's device of the previous plan),
  warm-started from the previous plan, 64 all-different devices: time to proven
  optimal (budget 10 s) and the plan and proven gap under a 100 ms budget (and 50-300 ms,
  with the CPU seconds each got), beside a cold solve of the same reduced problem.

Run: python bench/solver.py [--replan-only]
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.planning.problem import Workload  # noqa: E402
from core.planning.scenarios import DeviceSpec, paper_devices, legacy_paper_problem  # noqa: E402
from core.planning.cost import evaluate  # noqa: E402
from core.planning.problem import with_changes  # noqa: E402
from core.planning.solvers import (  # noqa: E402
    even_split, replan_after_failure, solve_max_throughput, solve_min_latency,
)
from core.planning.solvers.comparison import run_strategy  # noqa: E402


def _timed(fn, problem, **kw):
    t = time.perf_counter()
    res = fn(problem, **kw)
    return res, time.perf_counter() - t


def _cpu_timed(fn, problem, **kw):
    """Wall and CPU seconds of the call (CPU: this process's, the figure a loaded machine moves least)."""
    t, c = time.perf_counter(), time.process_time()
    res = fn(problem, **kw)
    return res, time.perf_counter() - t, time.process_time() - c


def _figures(tag: str, problem, limit: float, out: dict) -> None:
    lat, t_lat = _timed(solve_min_latency, problem, time_limit_s=limit)
    tput, t_tput = _timed(solve_max_throughput, problem, time_limit_s=limit)
    out[f"{tag}_latency_s"] = round(t_lat, 4)
    out[f"{tag}_latency_proven"] = lat.proven_optimal
    out[f"{tag}_latency_gap"] = round(lat.gap, 6)
    out[f"{tag}_latency_ms_per_token"] = round(lat.value * 1e3, 3)
    out[f"{tag}_stages"] = len(lat.plan.stages)
    out[f"{tag}_throughput_s"] = round(t_tput, 4)
    out[f"{tag}_throughput_proven"] = tput.proven_optimal
    out[f"{tag}_throughput_gap"] = round(tput.gap, 6)
    out[f"{tag}_tokens_per_s"] = round(tput.value, 4)
    out[f"{tag}_micro_batching"] = f"{tput.plan.micro_batch_size}x{tput.plan.micro_batches}"


def _heterogeneous(n: int, seed: int = 1):
    rng = random.Random(seed)
    return [DeviceSpec(id=f"dev-{i:02d}", tflops=rng.uniform(5, 60), memory_bandwidth_gb_s=rng.uniform(50, 400),
                       memory_gib=rng.choice([8, 16, 32, 64])) for i in range(n)]


def _replan_figures(problem, out: dict) -> None:
    """Re-plan without the previous plan's second device: warm (proven, and 100 ms) beside cold."""
    for objective, solve in (("latency", solve_min_latency), ("throughput", solve_max_throughput)):
        previous = solve(problem, time_limit_s=10.0).plan
        failed = previous.stages[1].device
        tag = f"replan64_{objective}"
        warm, t_warm, c_warm = _cpu_timed(lambda p: replan_after_failure(p, previous, failed, time_limit_s=10.0),
                                          problem)
        fast, t_fast, c_fast = _cpu_timed(lambda p: replan_after_failure(p, previous, failed, time_limit_s=0.1),
                                          problem)
        cold, t_cold = _timed(solve, with_changes(problem, excluded_devices=(failed,)), time_limit_s=10.0)
        out[f"{tag}_warm_s"] = round(t_warm, 4)
        out[f"{tag}_warm_cpu_s"] = round(c_warm, 4)
        out[f"{tag}_warm_nodes"] = warm.nodes
        out[f"{tag}_warm_proven"] = warm.proven_optimal
        out[f"{tag}_warm_gap"] = round(warm.gap, 6)
        out[f"{tag}_cold_s"] = round(t_cold, 4)
        out[f"{tag}_cold_proven"] = cold.proven_optimal
        out[f"{tag}_100ms_s"] = round(t_fast, 4)
        out[f"{tag}_100ms_cpu_s"] = round(c_fast, 4)
        out[f"{tag}_100ms_proven"] = fast.proven_optimal
        out[f"{tag}_100ms_gap"] = round(fast.gap, 6)
        out[f"{tag}_100ms_value_vs_best"] = round(
            (fast.value / warm.value) if objective == "throughput" else (warm.value / fast.value), 6)
        # the proven gap against the budget (wall-clock limits: on a loaded machine a budget buys
        # less CPU, so the CPU seconds each run got are beside it)
        by_budget = {}
        for ms in (50, 100, 150, 200, 300):
            r, _, c = _cpu_timed(lambda p: replan_after_failure(p, previous, failed, time_limit_s=ms / 1e3), problem)
            by_budget[ms] = {"gap": round(r.gap, 5), "cpu_s": round(c, 4)}
        out[f"{tag}_gap_by_budget_ms"] = by_budget


def main() -> None:
    out: dict = {"bench": "solver", "cpus": os.cpu_count(), "loadavg": os.getloadavg()[0]}
    if "--replan-only" in sys.argv:  # the recovery path's figures alone (seconds, not minutes)
        _replan_figures(legacy_paper_problem("llama-2-70b", devices=_heterogeneous(64)), out)
        print(json.dumps(out))
        return
    for model in ("llama-2-7b", "llama-2-13b", "llama-2-70b"):
        _figures(f"paper15_{model.split('-')[-1]}", legacy_paper_problem(model), 30.0, out)
    _figures("paper64_70b", legacy_paper_problem("llama-2-70b", devices=paper_devices(agx=50, nx=10, servers=4, calibrated=False)), 10.0, out)
    batch16 = Workload(prompt_tokens=128, generated_tokens=128, batch_size=16)
    _figures("paper15_70b_batch16", legacy_paper_problem("llama-2-70b", workload=batch16), 10.0, out)
    _figures("hetero15_70b", legacy_paper_problem("llama-2-70b", devices=_heterogeneous(15)), 10.0, out)
    _figures("hetero64_70b", legacy_paper_problem("llama-2-70b", devices=_heterogeneous(64)), 10.0, out)
    _figures("hetero128_70b", legacy_paper_problem("llama-2-70b", devices=_heterogeneous(128)), 10.0, out)
    _figures("hetero256_70b", legacy_paper_problem("llama-2-70b", devices=_heterogeneous(256)), 10.0, out)
    _replan_figures(legacy_paper_problem("llama-2-70b", devices=_heterogeneous(64)), out)
    # side by side in the same run: the optimum against the exo / llama.cpp-style split
    problem = legacy_paper_problem("llama-2-70b")
    for objective, field in (("latency", "latency_per_token_s"), ("throughput", "throughput_tokens_s")):
        opt = run_strategy(problem, "edgeshard", objective).cost
        base = run_strategy(problem, "memory-proportional", objective).cost
        ratio = getattr(base, field) / getattr(opt, field) if objective == "latency" else getattr(opt, field) / getattr(base, field)
        out[f"paper15_70b_{objective}_gain_vs_memory_proportional"] = round(ratio, 3)
    # the cost model as the plan editor's live preview calls it: a 64-stage plan
    big = legacy_paper_problem("llama-2-70b", devices=paper_devices(agx=50, nx=10, servers=4, calibrated=False))
    plan = even_split(big)
    evaluate(big, plan)
    t = time.perf_counter()
    for _ in range(20):
        evaluate(big, plan)
    out["evaluate_64_stage_plan_ms"] = round((time.perf_counter() - t) / 20 * 1e3, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

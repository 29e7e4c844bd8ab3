"""The strategies EdgeShard is compared with, each a function returning a plan.

Baselines do not check memory: a plan that does not fit is returned as is and
``core.planning.cost.evaluate`` reports the violation (``edgeshard compare`` shows OOM).
Cloud-Edge-Opt is an optimum, so it raises ``ModelDoesNotFit`` when nothing fits.
"""

from __future__ import annotations

import msgspec

from core.planning.cost import evaluate
from core.errors import PlanInvalid
from core.planning.plan import ShardPlan, plan_from_boundaries
from core.planning.problem import PlanningProblem
from core.planning.solvers.arrays import usable_devices


def _plan(problem: PlanningProblem, devices: list[str], boundaries: list[int], strategy: str, objective: str) -> ShardPlan:
    wl = problem.workload
    return plan_from_boundaries(
        problem.profile.model.name, problem.profile.model.num_units, devices, boundaries,
        strategy=strategy, objective=objective, micro_batch_size=wl.batch_size, micro_batches=1,
    )


def strongest_device(problem: PlanningProblem) -> str:
    """The usable non-source device with the least decode time for the whole model (ties: more memory)."""
    cands = [d for d in usable_devices(problem) if d != problem.source]
    if not cands:
        raise PlanInvalid([f"no device besides the source {problem.source!r} is usable"])
    n = problem.profile.model.num_units
    b = problem.workload.batch_size

    def key(d: str):
        t = problem.profile.times_of(d)
        return (sum(t.decode_time(u, b) for u in range(n)), -problem.profile.cluster.device(d).memory_bytes, d)

    return min(cands, key=key)


def edge_solo(problem: PlanningProblem, objective: str = "latency") -> ShardPlan:
    """The whole model on the source device."""
    return _plan(problem, [problem.source], [], "edge-solo", objective)


def even_split(problem: PlanningProblem, devices: list[str] | None = None, objective: str = "latency",
               strategy: str = "even") -> ShardPlan:
    """Units divided as evenly as possible over ``devices`` (default: every usable device), in order."""
    devices = list(devices or usable_devices(problem))
    n = problem.profile.model.num_units
    devices = devices[:n]
    k = len(devices)
    bounds = [round(n * j / k) for j in range(1, k)]
    return _plan(problem, devices, bounds, strategy, objective)


def cloud_edge_even(problem: PlanningProblem, objective: str = "latency") -> ShardPlan:
    """Half the units on the source, half on the strongest device."""
    return even_split(problem, [problem.source, strongest_device(problem)], objective, "cloud-edge-even")


def memory_proportional(problem: PlanningProblem, devices: list[str] | None = None, objective: str = "latency") -> ShardPlan:
    """Units divided in proportion to each device's memory budget (as exo and llama.cpp RPC do).

    Every device gets at least one unit; devices beyond the number of units are left out.
    """
    devices = list(devices or usable_devices(problem))
    n = problem.profile.model.num_units
    devices = devices[:n]
    mem = [problem.profile.cluster.device(d).memory_bytes for d in devices]
    total = sum(mem)
    bounds, acc = [], 0.0
    for j, mb in enumerate(mem[:-1]):
        acc += mb
        b = round(n * acc / total)
        lo = (bounds[-1] if bounds else 0) + 1
        hi = n - (len(devices) - 1 - j)
        bounds.append(min(max(b, lo), hi))
    return _plan(problem, devices, bounds, "memory-proportional", objective)


def cloud_edge_opt(problem: PlanningProblem, objective: str = "latency", **solver_kw) -> ShardPlan:
    """The exact optimum restricted to the source and the strongest device."""
    from core.planning.solvers.exact import solve_max_throughput, solve_min_latency

    keep = {problem.source, strongest_device(problem)}
    others = tuple(d for d in problem.profile.cluster.device_ids() if d not in keep)
    restricted = msgspec.structs.replace(problem, excluded_devices=tuple(sorted(set(problem.excluded_devices) | set(others))))
    solve = solve_min_latency if objective == "latency" else solve_max_throughput
    plan = solve(restricted, **solver_kw).plan
    return msgspec.structs.replace(plan, strategy="cloud-edge-opt")


def best_micro_batching(problem: PlanningProblem, plan: ShardPlan) -> ShardPlan:
    """The same stages with the (m, K) that gives the most tokens/s within memory (for fair comparisons)."""
    from core.planning.solvers.exact import micro_batch_choices

    best, best_t = None, -1.0
    for m, k in micro_batch_choices(problem):
        cand = msgspec.structs.replace(plan, micro_batch_size=m, micro_batches=k, objective="throughput")
        cost = evaluate(problem, cand)
        t = cost.throughput_tokens_s if cost.feasible else -0.5
        if t > best_t:
            best, best_t = cand, t
    assert best is not None
    return best

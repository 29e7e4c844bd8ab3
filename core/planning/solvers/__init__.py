"""Solvers: exact minimum-latency / maximum-throughput plans and the baselines.

Every strategy in ``STRATEGIES`` maps (problem, objective) to a plan; the exact ones
come with proofs in ``solve_min_latency`` / ``solve_max_throughput`` (``SolveResult``).
"""

from __future__ import annotations

from collections.abc import Callable

from core.planning.plan import ShardPlan
from core.planning.problem import PlanningProblem
from core.planning.solvers.baselines import (
    best_micro_batching,
    cloud_edge_even,
    cloud_edge_opt,
    edge_solo,
    even_split,
    memory_proportional,
    strongest_device,
)
from core.planning.solvers.exact import (
    SolveResult, micro_batch_choices, replan_after_failure, solve_max_throughput, solve_min_latency,
)


def edgeshard_optimal(problem: PlanningProblem, objective: str = "latency") -> ShardPlan:
    solve = solve_min_latency if objective == "latency" else solve_max_throughput
    return solve(problem).plan


def _for_objective(fn: Callable[..., ShardPlan]) -> Callable[[PlanningProblem, str], ShardPlan]:
    """Baselines fix the stages; for throughput they get their best (m, K) too."""

    def strategy(problem: PlanningProblem, objective: str = "latency") -> ShardPlan:
        plan = fn(problem, objective=objective)
        return plan if objective == "latency" else best_micro_batching(problem, plan)

    strategy.__doc__ = fn.__doc__
    return strategy


STRATEGIES: dict[str, Callable[[PlanningProblem, str], ShardPlan]] = {
    "edgeshard": edgeshard_optimal,
    "edge-solo": _for_objective(edge_solo),
    "cloud-edge-even": _for_objective(cloud_edge_even),
    "cloud-edge-opt": cloud_edge_opt,
    "even": _for_objective(even_split),
    "memory-proportional": _for_objective(memory_proportional),
}

__all__ = [
    "STRATEGIES", "SolveResult", "solve_min_latency", "solve_max_throughput", "edge_solo", "cloud_edge_even",
    "cloud_edge_opt", "even_split", "memory_proportional", "best_micro_batching", "strongest_device",
    "micro_batch_choices", "edgeshard_optimal", "replan_after_failure",
]

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
from core.planning.solvers.paper_dp import paper_dp_latency, paper_dp_throughput


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


_paper_dp_throughput_cache: tuple = (None, None)


def _paper_dp_throughput(problem: PlanningProblem, objective: str = "throughput") -> ShardPlan:
    """Algorithm 2's stages; for latency served as one micro-batch of the whole batch."""
    import msgspec

    global _paper_dp_throughput_cache
    cached = _paper_dp_throughput_cache
    if cached[0] is not problem:  # both objectives of one comparison share the (slow) subset DP
        cached = _paper_dp_throughput_cache = (problem, paper_dp_throughput(problem))
    plan = cached[1]
    if objective == "latency":
        return msgspec.structs.replace(plan, objective="latency", micro_batch_size=problem.workload.batch_size,
                                       micro_batches=1)
    return best_micro_batching(problem, plan)


STRATEGIES: dict[str, Callable[[PlanningProblem, str], ShardPlan]] = {
    "edgeshard": edgeshard_optimal,
    "edge-solo": _for_objective(edge_solo),
    "cloud-edge-even": _for_objective(cloud_edge_even),
    "cloud-edge-opt": cloud_edge_opt,
    "even": _for_objective(even_split),
    "memory-proportional": _for_objective(memory_proportional),
    "paper-dp-latency": _for_objective(paper_dp_latency),
    "paper-dp-throughput": _paper_dp_throughput,
}
PAPER_STRATEGIES = ("paper-dp-latency", "paper-dp-throughput")
"""The paper's published Algorithms 1 and 2 (core.planning.solvers.paper_dp)."""

__all__ = [
    "STRATEGIES", "SolveResult", "solve_min_latency", "solve_max_throughput", "edge_solo", "cloud_edge_even",
    "cloud_edge_opt", "even_split", "memory_proportional", "best_micro_batching", "strongest_device",
    "micro_batch_choices", "edgeshard_optimal", "replan_after_failure", "paper_dp_latency", "paper_dp_throughput",
    "PAPER_STRATEGIES",
]

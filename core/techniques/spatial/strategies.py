"""Spatial partitioning's strategies and their outcome (the shared Compare's row)."""

from __future__ import annotations

import time

from core.errors import EdgeShardError
from core.techniques.outcomes import StrategyOutcome
from core.techniques.spatial.cost import SpatialCost, evaluate
from core.techniques.spatial.partition import fused_plan, per_layer_plan, with_best_device_count
from core.techniques.spatial.problem import SpatialPlan, SpatialProblem

ORDER = ("fused", "bodp", "cbps", "even")
"""How Compare lists them: the planner's pick first."""


class SpatialOutcome(StrategyOutcome, frozen=True, kw_only=True):
    plan: SpatialPlan | None = None
    cost: SpatialCost | None = None

    @property
    def latency_s(self) -> float | None:
        return self.cost.latency_s if self.cost else None

    @property
    def tokens_per_s(self) -> float | None:
        """Images per second (one image is this technique's 'token')."""
        return self.cost.images_per_s if self.cost else None


def _fused(problem: SpatialProblem) -> SpatialPlan:
    return with_best_device_count(problem, lambda p, devs: fused_plan(p, devs))


STRATEGIES = {
    "fused": _fused,
    "cbps": lambda p: per_layer_plan(p, "cbps"),
    "bodp": lambda p: per_layer_plan(p, "bodp"),
    "even": lambda p: per_layer_plan(p, "even"),
}


def run_strategy(problem: SpatialProblem, name: str, objective: str = "latency", time_limit_s: float = 30.0, *,
                 reporter=None) -> SpatialOutcome:
    """One partitioner; ``ok`` or ``oom`` (none is proven optimal: CBPS is a heuristic and the
    fused DP is exact only over tile boundaries for CBPS widths). Operator errors become ``failed``."""
    t0 = time.perf_counter()
    try:
        plan = STRATEGIES[name](problem)
        cost = evaluate(problem, plan)
    except EdgeShardError as err:
        return SpatialOutcome.failed(name, objective, str(err), started=t0)
    return SpatialOutcome(strategy=name, objective=objective, status="ok" if cost.fits else "oom", plan=plan,
                          cost=cost, elapsed_s=time.perf_counter() - t0)


def compare(problem: SpatialProblem) -> list[SpatialOutcome]:
    return [run_strategy(problem, name) for name in ORDER]

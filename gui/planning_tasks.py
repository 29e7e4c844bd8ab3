"""Solver calls shaped as long work (``fn(reporter, ...)``) for the plan editor's worker.

No Qt here: these only call ``core.solvers`` and ``core.cost.evaluate`` so the numbers
the editor shows for a strategy are the same ones ``edgeshard plan`` prints.
"""

from __future__ import annotations

from typing import Any

import msgspec

from core.cost import PlanCost, evaluate
from core.errors import EdgeShardError
from core.plan import ShardPlan
from core.problem import PlanningProblem
from core.reporting import Cancelled, Reporter


class StrategyResult(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    plan: ShardPlan | None
    cost: PlanCost | None
    optimal: bool = False
    note: str = ""
    """Why a strategy has no plan, or what it assumed."""

    @property
    def feasible(self) -> bool:
        return self.cost is not None and self.cost.feasible

    def summary(self) -> str:
        if self.cost is None:
            return f"{self.name}: {self.note or 'no plan'}"
        proven = ", proven optimal" if self.optimal else ""
        return (
            f"{self.name}: {len(self.plan.stages)} stage(s), {self.cost.latency_per_token_s * 1e3:.1f} ms/token, "
            f"{self.cost.throughput_tokens_s:.1f} tokens/s{proven}"
        )


def _result(name: str, problem: PlanningProblem, out: Any) -> StrategyResult:
    """Normalise a solver's return value (a result struct, or a bare plan) to a StrategyResult."""
    plan = out if isinstance(out, ShardPlan) else getattr(out, "plan", None)
    cost = getattr(out, "cost", None) or (evaluate(problem, plan) if plan is not None else None)
    optimal = bool(getattr(out, "optimal", False) or getattr(out, "proven_optimal", False))
    return StrategyResult(name=name, plan=plan, cost=cost, optimal=optimal, note=str(getattr(out, "note", "") or ""))


def solve(reporter: Reporter, problem: PlanningProblem, objective: str) -> StrategyResult:
    """The exact solver for ``objective`` ("latency" or "throughput")."""
    from core import solvers

    reporter.status(f"Solving for minimum latency…" if objective == "latency" else "Solving for maximum throughput…")
    fn = solvers.solve_min_latency if objective == "latency" else solvers.solve_max_throughput
    name = "EdgeShard-latency" if objective == "latency" else "EdgeShard-throughput"
    return _result(name, problem, fn(problem))


def compare_strategies(reporter: Reporter, problem: PlanningProblem, objective: str = "latency") -> list[StrategyResult]:
    """Run every strategy of ``core.solvers.STRATEGIES`` for ``objective``.

    The exact solver goes through ``solve`` so its optimality proof is kept; a strategy
    that cannot place the model is listed with its reason rather than dropped.
    """
    from core import solvers

    items = sorted(solvers.STRATEGIES.items(), key=lambda kv: (kv[0] != "edgeshard", kv[0]))
    results = []
    for i, (name, fn) in enumerate(items):
        if reporter.cancel_requested():
            raise Cancelled()
        reporter.status(f"{name}…")
        reporter.progress(i, len(items))
        try:
            if name == "edgeshard":
                results.append(msgspec.structs.replace(solve(reporter, problem, objective), name=name))
            else:
                results.append(_result(name, problem, fn(problem, objective)))
        except EdgeShardError as err:
            results.append(StrategyResult(name=name, plan=None, cost=None, note=str(err)))
    reporter.progress(len(items), len(items))
    return results

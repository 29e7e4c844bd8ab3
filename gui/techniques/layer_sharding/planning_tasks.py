"""Solver calls shaped as long work (``fn(reporter, ...)``) for the plan editor's worker.

No Qt here and no solving logic either: each strategy goes through
``core.planning.solvers.comparison.run_strategy``, the function ``edgeshard plan`` and
``edgeshard compare`` use, so the editor shows the same plans, figures and statuses
(proven optimal, gap left, OOM, invalid, no plan) as the CLI.
"""

from __future__ import annotations

from core.errors import EdgeShardError
from core.planning.problem import PlanningProblem
from core.reporting import Cancelled, Reporter
from core.planning.solvers import STRATEGIES
from core.planning.solvers.comparison import StrategyOutcome, run_strategy, status_text

EXACT = "edgeshard"


def summary(out: StrategyOutcome) -> str:
    """One line for the status bar of the editor: stages, figures and status."""
    if out.plan is None or out.cost is None:
        return f"{out.strategy}: {status_text(out)}"
    return (f"{out.strategy}: {len(out.plan.stages)} stage(s), {out.cost.latency_per_token_s * 1e3:.1f} ms/token, "
            f"{out.cost.throughput_tokens_s:.1f} tokens/s, {status_text(out)}")


def solve(reporter: Reporter, problem: PlanningProblem, objective: str) -> StrategyOutcome:
    """The exact solver for ``objective`` ("latency" or "throughput"); no plan is an error."""
    reporter.status("Solving for minimum latency…" if objective == "latency" else "Solving for maximum throughput…")
    out = run_strategy(problem, EXACT, objective, reporter=reporter)
    if reporter.cancel_requested():
        raise Cancelled()
    if out.plan is None:
        raise EdgeShardError(out.error or "the solver found no plan")
    return out


def compare_strategies(reporter: Reporter, problem: PlanningProblem, objective: str = "latency") -> list[StrategyOutcome]:
    """Every strategy of ``core.planning.solvers.STRATEGIES`` for ``objective``, the exact one first;
    a strategy that cannot place the model is listed with its reason rather than dropped."""
    names = sorted(STRATEGIES, key=lambda n: (n != EXACT, n))
    results = []
    for i, name in enumerate(names):
        if reporter.cancel_requested():
            raise Cancelled()
        reporter.status(f"{name}…")
        reporter.progress(i, len(names))
        results.append(run_strategy(problem, name, objective, reporter=reporter if name == EXACT else None))
    reporter.progress(len(names), len(names))
    return results

"""Every strategy side by side on one problem: what ``edgeshard compare`` prints."""

from __future__ import annotations

from typing import Literal

import msgspec

from core.planning.cost import PlanCost, evaluate, format_bytes, structural_violations
from core.errors import EdgeShardError
from core.planning.plan import ShardPlan
from core.planning.problem import PlanningProblem
from core.reporting import Reporter
from core.planning.solvers import (
    STRATEGIES, best_micro_batching, even_split, memory_proportional, on_every_gpu, solve_placed,
)


class StrategyOutcome(msgspec.Struct, frozen=True, kw_only=True):
    strategy: str
    objective: Literal["latency", "throughput"]
    status: Literal["optimal", "ok", "oom", "invalid", "failed"]
    """optimal: proven optimum; ok: a valid plan; oom: a device's memory overflows;
    invalid: breaks another rule; failed: the strategy produced no plan (``error`` says why)."""
    plan: ShardPlan | None = None
    cost: PlanCost | None = None
    error: str = ""
    gap: float = 0.0
    """For the exact strategy cut short: the proven relative gap."""
    bound: float | None = None
    """For the exact strategy: the proven best possible value (latency lower / throughput upper bound)."""
    elapsed_s: float = 0.0

    @property
    def latency_s(self) -> float | None:
        """Per generated token; what every technique's outcome says (``core.techniques``)."""
        return self.cost.latency_per_token_s if self.cost is not None else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.cost.throughput_tokens_s if self.cost is not None else None


FP_ONLY = "edgeshard-fp"
"""The exact optimum with every stage at fp, beside the precision-aware one when a problem has a
quality bound: what the bound buys (Compare shows both)."""


def run_strategy(problem: PlanningProblem, name: str, objective: str, time_limit_s: float = 30.0,
                 devices: list[str] | None = None, reporter: Reporter | None = None) -> StrategyOutcome:
    """One strategy's plan and cost; errors a user can cause become a ``failed`` outcome.

    ``devices``: the device set of the even / memory-proportional splits (default: all usable).
    ``reporter``: the exact solver's progress and cancellation (the studio's worker).
    """
    try:
        if name in ("edgeshard", FP_ONLY):
            own = problem if name == "edgeshard" else msgspec.structs.replace(problem, max_perplexity_increase=None)
            res = solve_placed(own, objective, time_limit_s=time_limit_s, reporter=reporter)  # GPUs where profiled
            return StrategyOutcome(strategy=name, objective=objective, plan=res.plan, cost=res.cost,
                                   status="optimal" if res.proven_optimal else "ok", gap=res.gap,
                                   bound=res.bound, elapsed_s=res.elapsed_s)
        if devices is not None and name in ("even", "memory-proportional"):
            split = even_split if name == "even" else memory_proportional

            def on_devices(p: PlanningProblem, objective: str) -> ShardPlan:
                plan = split(p, devices, objective=objective)
                return plan if objective == "latency" else best_micro_batching(p, plan)

            plan = on_every_gpu(problem, on_devices, objective)
        else:
            plan = STRATEGIES[name](problem, objective)
    except EdgeShardError as err:
        return StrategyOutcome(strategy=name, objective=objective, status="failed", error=str(err))
    cost = evaluate(problem, plan)
    if cost.feasible:
        status = "ok"
    elif cost.memory and not all(m.fits for m in cost.memory) and not structural_violations(problem, plan):
        status = "oom"
    else:
        status = "invalid"
    return StrategyOutcome(strategy=name, objective=objective, plan=plan, cost=cost, status=status,
                           error="; ".join(cost.violations))


def compare_names(problem: PlanningProblem) -> list[str]:
    """The strategies Compare runs, the exact one first (under a quality bound, then the exact
    fp-only one: what the bound buys), then the baselines by name."""
    names = sorted(STRATEGIES, key=lambda n: (n != "edgeshard", n))
    if problem.max_perplexity_increase is not None:
        names.insert(1, FP_ONLY)
    return names


def compare(problem: PlanningProblem, objective: str, time_limit_s: float = 30.0) -> list[StrategyOutcome]:
    """Every strategy of ``compare_names`` for one objective."""
    return [run_strategy(problem, n, objective, time_limit_s) for n in compare_names(problem)]



def shortfall_text(out: StrategyOutcome, optimum: StrategyOutcome | None) -> str:
    """How far a valid plan is from the exact solver's plan of the same objective ('' if unknown);
    against a plan not proven optimal (search cut short) it says so."""
    if optimum is None or optimum.status not in ("optimal", "ok") or out.status not in ("ok", "optimal") or out.cost is None:
        return ""
    ref = "the optimum" if optimum.status == "optimal" else "the exact solver's best (not proven optimal)"
    if out.objective == "latency":
        worse = out.cost.latency_per_token_s / optimum.cost.latency_per_token_s - 1.0
        if worse < -1e-9:
            return f"{-worse * 100:.1f} % faster than {ref}"
        return f"= {ref}" if worse <= 1e-9 else f"{worse * 100:.1f} % slower than {ref}"
    worse = 1.0 - out.cost.throughput_tokens_s / optimum.cost.throughput_tokens_s
    if worse < -1e-9:
        return f"{-worse * 100:.1f} % more tokens/s than {ref}"
    return f"= {ref}" if worse <= 1e-9 else f"{worse * 100:.1f} % fewer tokens/s than {ref}"


def status_text(out: StrategyOutcome) -> str:
    """One outcome's status in plain words: proven optimal, the gap left, OOM by how much, why no plan."""
    if out.status == "optimal":
        return f"proven optimal ({out.elapsed_s:.2f} s)" if out.elapsed_s else "proven optimal"
    if out.status == "ok":
        if out.strategy != "edgeshard" or out.bound is None:
            return "ok"
        unit = "ms/token" if out.objective == "latency" else "tokens/s"
        bound = out.bound * 1e3 if out.objective == "latency" else out.bound
        return f"search budget ran out: gap ≤ {out.gap * 100:.2f} % (best possible {bound:.2f} {unit})"
    if out.status == "oom":
        over = [m for m in out.cost.memory if not m.fits]
        return "OOM: " + ", ".join(f"{m.device} +{format_bytes(m.total_bytes - m.budget_bytes)}" for m in over)
    if out.status == "failed":
        return "no plan: " + out.error.splitlines()[0]
    return "invalid: " + out.error

"""EdgeMoE's planner (exhaustive over bit options × preload depth × policy, the buffer filling
the budget: exact for the cost model) and the paper's baselines at the same memory footprint."""

from __future__ import annotations

import time

from core.errors import EdgeShardError
from core.techniques.expert_offload.cost import OffloadCost, evaluate
from core.techniques.expert_offload.problem import FULL_PRECISION, BitOption, OffloadPlan, OffloadProblem
from core.techniques.outcomes import PerTokenOutcome

MAX_PRELOAD = 3


class OffloadOutcome(PerTokenOutcome, frozen=True, kw_only=True):
    plan: OffloadPlan | None = None
    cost: OffloadCost | None = None


def slots_that_fit(problem: OffloadProblem, bits: BitOption) -> int:
    """The most experts a buffer of these bits can hold beside the resident weights (>= 1, or an error)."""
    m = problem.model
    free = problem.memory_budget_bytes - m.resident_bytes
    per = m.expert_bytes * bits.avg_bits / 32.0
    slots = min(int(free // per), m.layers * m.experts) if free > 0 else 0
    if slots < 1:
        raise EdgeShardError(
            f"the non-expert weights ({m.resident_bytes} B) and one {bits.name} expert ({int(per)} B) do not fit "
            f"in {problem.memory_budget_bytes} B: give the device more memory or use lower expert bit widths")
    return slots


def _edgemoe(problem: OffloadProblem) -> OffloadPlan:
    options = [b for b in (FULL_PRECISION, *problem.bit_options) if b.accuracy_loss <= problem.accuracy_bound]
    plans = []
    for bits in dict.fromkeys(options):
        try:
            slots = slots_that_fit(problem, bits)
        except EdgeShardError:
            continue
        for preload in range(MAX_PRELOAD + 1):
            plans.append(OffloadPlan(device=problem.device, slots=slots, bits=bits, policy="edgemoe", preload=preload))
    if not plans:
        raise EdgeShardError("no expert bit width within the accuracy bound fits the memory budget: give the device "
                             "more memory, or loosen the accuracy bound to allow lower bit widths")
    return min(plans, key=lambda p: (evaluate(problem, p).latency_per_token_s, p.preload))


def _io_free(problem: OffloadProblem) -> OffloadPlan:
    m = problem.model
    return OffloadPlan(device=problem.device, slots=m.layers * m.experts, policy="lru")


def _io_exp(problem: OffloadProblem) -> OffloadPlan:
    return OffloadPlan(device=problem.device, slots=slots_that_fit(problem, FULL_PRECISION), policy="lru")


def _io_qexp(problem: OffloadProblem) -> OffloadPlan:
    int4 = next((b for b in problem.bit_options if b.avg_bits == 4), None)
    if int4 is None:
        raise EdgeShardError("IO-QEXP needs a uniform INT4 bit option in the problem (avg_bits 4)")
    return OffloadPlan(device=problem.device, slots=slots_that_fit(problem, int4), bits=int4, policy="lru")


def _sti(problem: OffloadProblem) -> OffloadPlan:
    m = problem.model
    slots = slots_that_fit(problem, FULL_PRECISION)
    if slots < m.experts:
        raise EdgeShardError(f"STI streams whole layers: its buffer needs {m.experts} experts, {slots} fit")
    return OffloadPlan(device=problem.device, slots=slots, policy="lru", whole_layers=True)


STRATEGIES = {"edgemoe": _edgemoe, "io-free": _io_free, "io-exp": _io_exp, "io-qexp": _io_qexp, "sti": _sti}


def run_strategy(problem: OffloadProblem, name: str, objective: str = "latency", time_limit_s: float = 30.0, *,
                 reporter=None) -> OffloadOutcome:
    started = time.perf_counter()
    if name not in STRATEGIES:
        return OffloadOutcome.failed(name, objective, f"unknown strategy {name!r}; use one of {', '.join(STRATEGIES)}")
    try:
        plan = STRATEGIES[name](problem)
    except EdgeShardError as err:
        return OffloadOutcome.failed(name, objective, str(err), started=started)
    cost = evaluate(problem, plan)
    status = ("optimal" if name == "edgemoe" else "ok") if cost.fits else "oom"
    return OffloadOutcome(strategy=name, objective=objective, status=status, plan=plan, cost=cost,
                          elapsed_s=time.perf_counter() - started)

"""Solvers: exact minimum-latency / maximum-throughput plans and the baselines.

Every strategy in ``STRATEGIES`` maps (problem, objective) to a plan; the exact ones
come with proofs in ``solve_min_latency`` / ``solve_max_throughput`` (``SolveResult``).
"""

from __future__ import annotations

from collections.abc import Callable

from core.planning.placement import every_gpu, gpu_choices, on_gpus, placed_problem
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
    """The exact plan; where devices have a GPU in the profile, over every CPU/GPU choice of them."""
    return solve_placed(problem, objective).plan


def solve_placed(problem: PlanningProblem, objective: str = "latency", **solver_kw) -> SolveResult:
    """The exact solver's answer over every choice of the CPU or one of its GPUs for each device with one
    (``Profile.accelerator_times``; prod(1 + GPUs) exact solves: a handful at the edge), the best
    by ``objective``, its GPU stages naming their ``torch_device``; proven optimal when every solve was.
    The choice and the layer ranges interact (a GPU is faster but holds less), so each choice is solved
    whole rather than the GPU picked first. A CPU-only profile: the exact solver's answer itself."""
    import itertools

    import msgspec

    from core.errors import ModelDoesNotFit
    from core.planning.cost import evaluate
    solve = solve_min_latency if objective == "latency" else solve_max_throughput
    gpus = gpu_choices(problem)
    if not gpus:
        return solve(problem, **solver_kw)
    best, best_key, refusal, proven, bound = None, None, None, True, None
    for choice in itertools.product(*(("cpu", *names) for names in gpus.values())):
        on_gpu = {d: g for d, g in zip(gpus, choice) if g != "cpu"}
        try:
            res = solve(placed_problem(problem, on_gpu), **solver_kw)
        except ModelDoesNotFit as err:
            refusal = refusal or err
            continue
        if any(s.weights == "int4" and s.device in on_gpu for s in res.plan.stages):
            proven = False  # a GPU stage refuses int4 (agents.shard): this choice's optimum cannot load
            continue
        proven = proven and res.proven_optimal
        bound = res.bound if bound is None else (min if objective == "latency" else max)(bound, res.bound)
        key = res.value if objective == "latency" else -res.value
        if best_key is None or key < best_key:
            plan = on_gpus(res.plan, on_gpu)
            best, best_key = msgspec.structs.replace(res, plan=plan, cost=evaluate(problem, plan)), key
    if best is None:
        raise refusal
    gap = 0.0 if proven else abs(best.value - bound) / max(abs(best.value), 1e-30)
    return msgspec.structs.replace(best, bound=bound, proven_optimal=proven, gap=gap)


_placed_last: tuple = (None, None)


def on_every_gpu(problem: PlanningProblem, baseline: Callable[[PlanningProblem, str], ShardPlan],
                 objective: str = "latency") -> ShardPlan:
    """``baseline``'s plan the way peers deploy (exo, llama.cpp RPC: the accelerator wherever there is
    one): every device with a GPU in the profile computes there, the baseline's rule reading that GPU's
    times and memory (a memory-proportional split, the paper's DP, the strongest device), so Compare
    sets the exact solver's CPU/GPU choice against baselines that use the GPUs too; a CPU-only profile:
    the baseline as it was."""
    global _placed_last
    gpus = every_gpu(problem)
    if not gpus:
        return baseline(problem, objective)
    cached = _placed_last  # read once: a studio worker may compare another problem meanwhile
    if cached[0] is not problem:  # one placed problem per comparison: the paper DP caches by it
        cached = _placed_last = (problem, placed_problem(problem, gpus))
    return on_gpus(baseline(cached[1], objective), gpus)


def _for_objective(fn: Callable[..., ShardPlan]) -> Callable[[PlanningProblem, str], ShardPlan]:
    """Baselines fix the stages; for throughput they get their best (m, K) too; on every profiled GPU."""

    def on_its_devices(problem: PlanningProblem, objective: str) -> ShardPlan:
        plan = fn(problem, objective=objective)
        return plan if objective == "latency" else best_micro_batching(problem, plan)

    def strategy(problem: PlanningProblem, objective: str = "latency") -> ShardPlan:
        return on_every_gpu(problem, on_its_devices, objective)

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
    "cloud-edge-opt": lambda problem, objective="latency": on_every_gpu(problem, cloud_edge_opt, objective),
    "even": _for_objective(even_split),
    "memory-proportional": _for_objective(memory_proportional),
    "paper-dp-latency": _for_objective(paper_dp_latency),
    "paper-dp-throughput": lambda problem, objective="throughput": on_every_gpu(problem, _paper_dp_throughput,
                                                                                objective),
}
PAPER_STRATEGIES = ("paper-dp-latency", "paper-dp-throughput")
"""The paper's published Algorithms 1 and 2 (core.planning.solvers.paper_dp)."""

__all__ = [
    "STRATEGIES", "SolveResult", "solve_placed", "solve_min_latency", "solve_max_throughput", "edge_solo", "cloud_edge_even",
    "cloud_edge_opt", "even_split", "memory_proportional", "best_micro_batching", "strongest_device",
    "micro_batch_choices", "edgeshard_optimal", "replan_after_failure", "paper_dp_latency", "paper_dp_throughput",
    "PAPER_STRATEGIES", "on_every_gpu",
]

"""Exact minimum-latency and maximum-throughput plans (with honest bounds when cut short).

Latency is additive over stages, so ``branch_and_bound`` minimises it directly.

Throughput for K micro-batches of m sequences is K·m / φ with
φ = max(K · B, L): B the bottleneck stage period, L the per-token cycle (core.cost).
For a threshold β let L(β) be the least latency over plans whose every stage period is
≤ β (a filtered branch and bound). Then φ* = min over candidate β of max(K·β, L(β)),
where the candidates are the values a stage period can take (stage compute sums and
link occupancies). ``pred(β)``: "some plan has B ≤ β and L ≤ K·β" is monotone in β, so
a binary search finds the least true β*; the optimum is then either K·β* or L(β′) for
the candidate β′ just below β*, which one more exact search settles. Proof of the
last step: a plan with B ≥ β* has φ ≥ K·β*; a plan with B ≤ β′ has φ ≥ L ≥ L(β′).
The micro-batch size and count are chosen over every (m, K) with m·K ≤ batch (or as
the workload fixes them), best upper bound first, stopping when no pair can win.
"""

from __future__ import annotations

import math
import time
from typing import Literal

import msgspec
import numpy as np

from core.cost import PlanCost, evaluate
from core.errors import ModelDoesNotFit
from core.plan import ShardPlan, Stage
from core.problem import PlanningProblem
from core.reporting import NullReporter, Reporter
from core.solvers.arrays import CostArrays, build_arrays, stage_memory_matrix, usable_devices
from core.solvers.search import SearchBudget, SearchSpace, branch_and_bound

INF = math.inf
EXACT_STRATEGY = "edgeshard-exact"


class SolveResult(msgspec.Struct, frozen=True, kw_only=True):
    """A solver's answer: the plan, its cost (core.cost.evaluate) and how good it is known to be."""

    plan: ShardPlan
    cost: PlanCost
    objective: Literal["latency", "throughput"]
    value: float
    """Latency per token (s) or throughput (tokens/s) of the plan."""
    bound: float
    """Proven best possible value: a latency lower bound or a throughput upper bound."""
    proven_optimal: bool
    gap: float
    """Relative distance between value and bound (0 when proven optimal)."""
    nodes: int = 0
    elapsed_s: float = 0.0

    @property
    def lower_bound(self) -> float:
        """Lower bound on the minimised quantity: seconds per token step (latency) or per token (throughput)."""
        if self.objective == "latency":
            return self.bound
        return 1.0 / self.bound if self.bound > 0 else INF


def plan_from_sequence(problem: PlanningProblem, arr: CostArrays, seq, ends, strategy: str, objective: str) -> ShardPlan:
    stages, start = [], 0
    for d, e in zip(seq, ends):
        stages.append(Stage(device=arr.devices[d], start=start, end=int(e)))
        start = int(e)
    return ShardPlan(
        model=problem.profile.model.name, num_units=arr.n, stages=tuple(stages), strategy=strategy,
        objective=objective, micro_batch_size=arr.m, micro_batches=arr.k,
    )


def sequence_terms(arr: CostArrays, seq, ends) -> tuple[float, float]:
    """(latency L, bottleneck period B) of a device sequence with stage ends, from the arrays."""
    lat, bott, start = 0.0, 0.0, 0
    for j, (d, e) in enumerate(zip(seq, ends)):
        c = arr.stage_time(d, start, e)
        if j + 1 < len(seq):
            t, o = arr.transfer[d, seq[j + 1], e], arr.occupancy[d, seq[j + 1], e]
        else:
            t, o = arr.ret[d], arr.ret_occupancy[d]
        lat += c + t
        bott = max(bott, c, o)
        start = e
    return lat, bott


def does_not_fit(problem: PlanningProblem, arr: CostArrays) -> ModelDoesNotFit:
    """The error for a model no plan can hold, with how much memory is missing."""
    whole = int(stage_memory_matrix(problem, arr.m * arr.k, arr.m)[0, arr.n])
    total = int(arr.budgets.sum())
    gib = 2**30
    if not arr.devices or problem.source not in arr.devices:
        return ModelDoesNotFit(f"the source device {problem.source!r} is not usable (unknown, unprofiled or excluded)", whole)
    if whole > total:
        missing = whole - total
        return ModelDoesNotFit(
            f"{problem.profile.model.name} does not fit: it needs {whole / gib:.2f} GiB (weights, KV cache for "
            f"{arr.m * arr.k} sequences, workspace) but the {len(arr.devices)} usable devices offer "
            f"{total / gib:.2f} GiB; {missing / gib:.2f} GiB missing",
            missing,
        )
    # Enough in total, but not as contiguous stages on distinct linked devices.
    biggest = int(max(arr.stage_bytes[u, u + 1] for u in range(arr.n)))
    missing = max(0, biggest - int(arr.budgets.max()))
    return ModelDoesNotFit(
        f"{problem.profile.model.name} does not fit: the devices offer {total / gib:.2f} GiB for "
        f"{whole / gib:.2f} GiB needed, but no split into contiguous stages on distinct linked devices fits "
        f"(largest single unit needs {biggest / gib:.2f} GiB, largest budget {int(arr.budgets.max()) / gib:.2f} GiB)",
        missing,
    )


def solve_min_latency(
    problem: PlanningProblem, *, time_limit_s: float = 30.0, max_nodes: int = 2_000_000,
    reporter: Reporter | None = None,
) -> SolveResult:
    """The plan with the least per-token latency for the whole batch (m = batch, K = 1)."""
    t0 = time.monotonic()
    reporter = reporter or NullReporter()
    reporter.status("searching the minimum-latency plan")
    arr = build_arrays(problem, problem.workload.batch_size, 1)
    if not arr.devices or arr.devices[arr.src] != problem.source:
        raise does_not_fit(problem, arr)
    space = SearchSpace(arr)
    budget = SearchBudget(max_nodes=max_nodes, max_seconds=time_limit_s)
    res = branch_and_bound(space, budget=budget)
    if not res.sequence:
        if res.complete or res.lower_bound == INF:
            raise does_not_fit(problem, arr)
        raise ModelDoesNotFit("no plan found within the search budget; raise the time limit", 0)
    plan = plan_from_sequence(problem, arr, res.sequence, res.boundaries, EXACT_STRATEGY, "latency")
    cost = evaluate(problem, plan)
    value = cost.latency_per_token_s
    bound = value if res.complete else min(res.lower_bound, value)
    reporter.progress(1, 1)
    return SolveResult(
        plan=plan, cost=cost, objective="latency", value=value, bound=bound, proven_optimal=res.complete,
        gap=0.0 if res.complete else (value - bound) / value, nodes=res.nodes, elapsed_s=time.monotonic() - t0,
    )


def micro_batch_choices(problem: PlanningProblem) -> list[tuple[int, int]]:
    """Every (m, K) the throughput solver may use: fixed by the workload or m·K ≤ batch."""
    wl = problem.workload
    b = wl.batch_size
    if wl.micro_batch_size and wl.micro_batches:
        return [(wl.micro_batch_size, wl.micro_batches)]
    if wl.micro_batch_size:
        return [(wl.micro_batch_size, k) for k in range(1, b // wl.micro_batch_size + 1)] or [(wl.micro_batch_size, 1)]
    if wl.micro_batches:
        return [(m, wl.micro_batches) for m in range(1, b // wl.micro_batches + 1)] or [(1, wl.micro_batches)]
    return [(m, k) for m in range(1, b + 1) for k in range(1, b // m + 1)]


class _ComboOutcome(msgspec.Struct):
    phi: float  # best cycle time found (inf: none)
    seq: tuple = ()
    ends: tuple = ()
    phi_bound: float = 0.0  # proven lower bound of phi
    proven: bool = False
    nodes: int = 0


def _solve_combo(arr: CostArrays, deadline: float, max_nodes: int) -> _ComboOutcome:
    """Least φ = max(K·B, L) for fixed (m, K) (see the module docstring)."""
    k = arr.k
    nodes = 0

    def budget() -> SearchBudget:
        return SearchBudget(max_nodes=max_nodes, max_seconds=max(0.0, deadline - time.monotonic()))

    base = SearchSpace(arr)
    lat = branch_and_bound(base, budget=budget())
    nodes += lat.nodes
    if not lat.sequence:
        return _ComboOutcome(phi=INF, phi_bound=lat.lower_bound, proven=lat.complete, nodes=nodes)
    l_star, b_lat = sequence_terms(arr, lat.sequence, lat.boundaries)
    best = _ComboOutcome(phi=max(k * b_lat, l_star), seq=lat.sequence, ends=lat.boundaries)
    l_low = lat.lower_bound if not lat.complete else l_star
    phi_bound = l_low
    if k == 1 or l_star >= k * b_lat:
        best.phi_bound, best.proven, best.nodes = max(phi_bound, 0.0), lat.complete, nodes
        if lat.complete:
            best.phi_bound = best.phi
        return best
    # Candidate bottleneck values: every stage compute and link occupancy that can occur.
    dn, n = len(arr.devices), arr.n
    vals = [arr.ret_occupancy]
    a_idx, e_idx = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    for d in range(dn):
        ok = (e_idx > a_idx) & (e_idx <= arr.emax[d][:, None])
        vals.append((arr.prefix[d][None, :] - arr.prefix[d][:, None])[ok])
    occ = arr.occupancy[np.isfinite(arr.occupancy)]
    vals.append(occ)
    cands = np.unique(np.concatenate([np.ravel(v) for v in vals]))
    cands = cands[np.isfinite(cands)]
    hi_val = best.phi / k
    lo = int(np.searchsorted(cands, l_low / k * (1 - 1e-12), side="left"))
    hi = int(np.searchsorted(cands, hi_val * (1 + 1e-12), side="right")) - 1
    all_proven = lat.complete
    found: dict[int, tuple] = {}
    false_max = -1
    # invariant: pred(cands[hi]) is true (the latency plan, or a plan found below)
    while lo < hi:
        mid = (lo + hi) // 2
        beta = float(cands[mid])
        space = SearchSpace(arr, beta)
        limit = k * beta * (1 + 1e-12)
        if space.root_bound() > limit:
            lo = mid + 1
            false_max = max(false_max, mid)
            continue
        res = branch_and_bound(space, incumbent=limit, budget=budget(), stop_below=limit)
        nodes += res.nodes
        if res.sequence:
            found[mid] = (res.sequence, res.boundaries)
            hi = mid
        else:
            if res.complete:
                false_max = max(false_max, mid)
            else:
                all_proven = False
            lo = mid + 1
    star = hi
    options = [(best.seq, best.ends)]
    if star in found:
        options.append(found[star])
    # The last contender: least latency with every period <= the candidate just below beta*.
    if star - 1 >= 0:
        beta_prev = float(cands[star - 1])
        space = SearchSpace(arr, beta_prev)
        res = branch_and_bound(space, incumbent=k * float(cands[star]) * (1 + 1e-12), budget=budget())
        nodes += res.nodes
        if res.sequence:
            options.append((res.sequence, res.boundaries))
        if not res.complete:
            all_proven = False
    for seq, ends in options:
        lv, bv = sequence_terms(arr, seq, ends)
        phi = max(k * bv, lv)
        if phi < best.phi:
            best.phi, best.seq, best.ends = phi, seq, ends
    if all_proven:
        best.phi_bound, best.proven = best.phi, True
    else:
        # proven: every plan has L >= l_low, and phi > K·cands[false_max] (pred false there)
        bound = l_low
        if false_max >= 0:
            bound = max(bound, k * float(cands[false_max]))
        best.phi_bound = min(bound, best.phi)
    best.nodes = nodes
    return best


def _relaxed_phi_bound(arr: CostArrays, space: SearchSpace) -> float:
    """A cheap lower bound of φ for (m, K): the relaxed latency and a bottleneck bound from it."""
    l_lo = space.root_bound()
    if l_lo == INF:
        return INF
    lat = arr.transfer[np.isfinite(arr.transfer)]
    max_lat = float(lat.max()) if lat.size else 0.0
    dn = len(arr.devices)
    b_lo = max(0.0, (l_lo - dn * max_lat) / dn)
    return max(l_lo, arr.k * b_lo)


def solve_max_throughput(
    problem: PlanningProblem, *, time_limit_s: float = 60.0, max_nodes: int = 2_000_000,
    reporter: Reporter | None = None,
) -> SolveResult:
    """The plan and micro-batching (m, K) with the most tokens/s within memory."""
    t0 = time.monotonic()
    deadline = t0 + time_limit_s
    reporter = reporter or NullReporter()
    reporter.status("searching the maximum-throughput plan")
    combos = []
    prefix_cache: dict[int, np.ndarray] = {}
    for m, k in micro_batch_choices(problem):
        arr = build_arrays(problem, m, k)
        if not arr.devices or arr.devices[arr.src] != problem.source:
            raise does_not_fit(problem, arr)
        prefix_cache.setdefault(m, arr.prefix)
        space = SearchSpace(arr)
        lo = _relaxed_phi_bound(arr, space)
        ub = 0.0 if lo == INF else k * m / lo
        combos.append((ub, m, k, arr))
    combos.sort(key=lambda c: (-c[0], -c[1] * c[2]))
    best_tput, best = 0.0, None
    proven = True
    tput_bound = 0.0
    nodes = 0
    for i, (ub, m, k, arr) in enumerate(combos):
        reporter.progress(i, len(combos))
        if ub <= best_tput * (1 + 1e-12):
            break
        if time.monotonic() >= deadline:
            proven = False
            tput_bound = max(tput_bound, ub)
            continue
        out = _solve_combo(arr, deadline, max_nodes)
        nodes += out.nodes
        if out.seq:
            tput = k * m / out.phi
            if tput > best_tput * (1 + 1e-12):
                best_tput, best = tput, (arr, out)
        if not out.proven:
            proven = False
            tput_bound = max(tput_bound, k * m / out.phi_bound if out.phi_bound > 0 else INF)
    if best is None:
        if proven:
            raise does_not_fit(problem, combos[-1][3] if combos else build_arrays(problem, 1, 1))
        raise ModelDoesNotFit("no plan found within the search budget; raise the time limit", 0)
    arr, out = best
    plan = plan_from_sequence(problem, arr, out.seq, out.ends, EXACT_STRATEGY, "throughput")
    cost = evaluate(problem, plan)
    value = cost.throughput_tokens_s
    bound = value if proven else max(value, tput_bound)
    reporter.progress(len(combos), len(combos))
    return SolveResult(
        plan=plan, cost=cost, objective="throughput", value=value, bound=bound, proven_optimal=proven,
        gap=0.0 if proven else (bound - value) / bound, nodes=nodes, elapsed_s=time.monotonic() - t0,
    )

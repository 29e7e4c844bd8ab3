"""Exact minimum-latency and maximum-throughput plans (with honest bounds when cut short).

Latency is additive over stages, so ``branch_and_bound`` minimises it directly.

Throughput for K micro-batches of m sequences is K·m / φ with
φ = max(K · B, L): B the bottleneck stage period, L the per-token cycle (core.planning.cost).
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
import msgspec.structs
import numpy as np

from core.planning.cost import PlanCost, evaluate
from core.errors import ModelDoesNotFit, PlanInvalid
from core.planning.plan import ShardPlan, Stage
from core.planning.problem import PlanningProblem, check_problem
from core.reporting import Cancelled, NullReporter, Reporter
from core.planning.solvers.arrays import CostArrays, build_arrays
from core.planning.solvers.search import SearchBudget, SearchSpace, branch_and_bound, reconstruct

INF = math.inf
EXACT_STRATEGY = "edgeshard-exact"
SAFETY = 0.95
"""Share of the time limit given to the searches (the rest: setup and evaluation)."""
FIRST_PROBE_GAP = 0.01
"""The throughput search's first period probe per (m, K): a plan this much better than the
incumbent, so a search cut short early has proven the incumbent within this gap."""


class SolveResult(msgspec.Struct, frozen=True, kw_only=True):
    """A solver's answer: the plan, its cost (core.planning.cost.evaluate) and how good it is known to be."""

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
        stages.append(Stage(device=arr.devices[d], start=start, end=int(e), weights=arr.weights[d] if arr.weights else "fp"))
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
    whole = int(arr.stage_bytes[0, arr.n])  # at the most compact precision allowed
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


def warm_sequence(space: SearchSpace, plan: ShardPlan | None) -> tuple[tuple, tuple, float] | None:
    """The cheapest repair of ``plan`` under ``space``: its devices still usable, in its order,
    with at most one unused device put where a lost one was (or anywhere after the source),
    each with the best stage ends. None when there is no plan or no repair holds the model.

    A re-plan starts from it: the search then only looks for something strictly better.
    """
    arr = space.arr
    if plan is None or arr.group is not None:  # under a quality bound: solved cold
        return None
    index = {dev: i for i, dev in enumerate(arr.devices)}
    kept = tuple(index[s.device] for s in plan.stages if s.device in index)
    if not kept or kept[0] != arr.src:
        return None
    lost = [i for i, s in enumerate(plan.stages) if s.device not in index]
    slots = sorted({min(i, len(kept)) for i in lost} or set(range(1, len(kept) + 1)))
    spare = np.setdiff1d(np.arange(len(arr.devices)), np.array(kept))
    # The kept devices alone, then each spare at each slot (all spares of a slot at once).
    prefixes = [space.root()]
    for d, d2 in zip(kept, kept[1:]):
        prefixes.append(space.extend(prefixes[-1], d, d2))
    tries: list[tuple] = [kept]
    costs = [float(prefixes[-1][arr.n] + space.ret[kept[-1]])]
    for i in slots if spare.size else ():
        rows = space.extend_all(prefixes[i - 1], kept[i - 1], spare)
        prev = spare
        for d2 in kept[i:]:
            rows = space.extend_rows(rows, prev, d2)
            prev = np.full(spare.size, d2)
        costs.extend((rows[:, arr.n] + space.ret[prev]).tolist())
        tries.extend(kept[:i] + (int(c),) + kept[i:] for c in spare)
    finite = [j for j, c in enumerate(costs) if math.isfinite(c)]
    if not finite:
        return None
    j = min(finite, key=lambda j: (costs[j], j))  # the first of the cheapest, in the order above
    return tries[j], reconstruct(space, tries[j]), costs[j]


def solve_min_latency(
    problem: PlanningProblem, *, time_limit_s: float = 30.0, max_nodes: int = 2_000_000,
    reporter: Reporter | None = None, warm_start: ShardPlan | None = None,
) -> SolveResult:
    """The plan with the least per-token latency for the whole batch (m = batch, K = 1).

    ``warm_start``: a previous plan whose usable devices (in its order) give the first
    incumbent, so a re-plan after a device fails prunes from the start.
    """
    t0 = time.monotonic()
    reporter = reporter or NullReporter()
    reporter.status("searching the minimum-latency plan")
    check_problem(problem)
    arr = build_arrays(problem, problem.workload.batch_size, 1)
    if not arr.devices or arr.devices[arr.src] != problem.source:
        raise does_not_fit(problem, arr)
    space = SearchSpace(arr)
    budget = SearchBudget(max_nodes=max_nodes, max_seconds=max(0.0, time_limit_s * SAFETY - (time.monotonic() - t0)),
                          cancel_requested=reporter.cancel_requested)

    def report(seq, ends, _cost):
        reporter.partial_result(plan_from_sequence(problem, arr, seq, ends, EXACT_STRATEGY, "latency"))

    warm = warm_sequence(space, warm_start)
    res = branch_and_bound(space, incumbent=warm[2] if warm else INF, budget=budget, on_incumbent=report)
    if not res.sequence and warm is not None:
        # nothing strictly better than the warm plan was found (proven so if complete)
        res.sequence, res.boundaries, res.cost = warm
        res.lower_bound = min(res.lower_bound, warm[2])
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
    phi_bound: float = 0.0  # proven: no plan of this (m, K) has a smaller phi
    proven: bool = False
    nodes: int = 0


def _latency_first(space: SearchSpace, deadline: float, max_nodes: int, cancel=None, below: float = INF):
    """The least-latency plan of this (m, K): a quick incumbent and the bound L ≥ L*.

    ``below``: only plans with L < below matter (φ ≥ L, so none at or above the incumbent's
    φ can win): the search prunes from the start, and finding none proves the pair cannot win.
    """
    budget = SearchBudget(max_nodes=max_nodes, max_seconds=max(0.0, deadline - time.monotonic()), cancel_requested=cancel)
    return branch_and_bound(space, incumbent=below, budget=budget)


def _candidate_periods(arr: CostArrays, lo: float = -INF, hi: float = INF) -> np.ndarray:
    """The values a stage period can take (stage compute sums and link occupancies), sorted:
    every one in [lo, hi), and beyond that only the largest below ``lo`` and the smallest at or
    above ``hi`` (a search between lo and hi needs no others; sorting them all is most of the cost)."""
    n = arr.n
    a_idx, e_idx = np.arange(n + 1)[None, :, None], np.arange(n + 1)[None, None, :]
    ok = (e_idx > a_idx) & (e_idx <= arr.emax[:, :, None])
    o = np.zeros(len(arr.devices)) if arr.overhead is None else arr.overhead
    held = (a_idx < n - 1) & (e_idx > 1)  # a stage holding a block pays the device's overhead
    stages = arr.prefix[:, None, :] - arr.prefix[:, :, None] + np.where(held, o[:, None, None], 0.0)
    vals = np.concatenate([np.ravel(arr.ret_occupancy), stages[ok], arr.occupancy[np.isfinite(arr.occupancy)]])
    vals = vals[np.isfinite(vals)]
    inside = (vals >= lo) & (vals < hi)
    parts = [vals[inside]]
    below, above = vals[vals < lo], vals[vals >= hi]
    if below.size:
        parts.append(below.max(keepdims=True))
    if above.size:
        parts.append(above.min(keepdims=True))
    return np.unique(np.concatenate(parts))


def _solve_combo(arr: CostArrays, lat, deadline: float, max_nodes: int, phi_target: float, cancel=None) -> _ComboOutcome:
    """Least φ = max(K·B, L) for fixed (m, K), caring only about φ < ``phi_target``."""
    k = arr.k
    nodes = 0
    l_star, b_lat = sequence_terms(arr, lat.sequence, lat.boundaries)
    best = _ComboOutcome(phi=max(k * b_lat, l_star), seq=lat.sequence, ends=lat.boundaries)
    l_low = l_star if lat.complete else lat.lower_bound
    if k == 1 or l_star >= k * b_lat:
        # φ ≥ L ≥ L* for every plan, and this plan reaches it.
        best.proven, best.phi_bound = lat.complete, best.phi if lat.complete else l_low
        return best
    target = min(best.phi, phi_target)
    lo_period, hi_period = l_low / k * (1 - 1e-12), target / k * (1 - 1e-12)
    cands = _candidate_periods(arr, lo_period, hi_period)
    lo = int(np.searchsorted(cands, lo_period, side="left"))
    # hi is a sentinel "true": at a period of cands[hi] or more, φ ≥ K·cands[hi] ≥ target.
    hi = int(np.searchsorted(cands, hi_period, side="left"))
    all_proven = lat.complete
    found: dict[int, tuple] = {}
    false_max = -1

    def slice_budget(share: float) -> SearchBudget:
        left = max(0.0, deadline - time.monotonic())
        return SearchBudget(max_nodes=max_nodes, max_seconds=min(left, max(0.25, left * share)), cancel_requested=cancel)

    # The first probe asks for a plan FIRST_PROBE_GAP better than the target: when there is
    # none, this pair is already proven within that gap (a re-plan under a deadline needs
    # that first); then bisection as usual.
    first = int(np.searchsorted(cands, hi_period / (1 + FIRST_PROBE_GAP), side="left"))
    while lo < hi:
        if time.monotonic() >= deadline:  # a probe's space costs ms before its search looks at the clock
            all_proven = False
            break
        mid = first if lo <= first < hi else (lo + hi) // 2
        first = -1
        beta = float(cands[mid])
        space = SearchSpace(arr, beta)
        limit = k * beta * (1 + 1e-12)
        if space.root_bound() > limit:
            lo, false_max = mid + 1, max(false_max, mid)
            continue
        res = branch_and_bound(space, incumbent=limit, budget=slice_budget(0.25), stop_below=limit)
        nodes += res.nodes
        if res.sequence:
            # so do the candidates within the searches' tolerance below beta
            hi = max(lo, min(mid, int(np.searchsorted(cands, beta * (1 - 1e-12), side="left"))))
            found[hi] = (res.sequence, res.boundaries)
        else:
            # candidates within the searches' tolerance of beta have the same answer
            same = min(hi, max(mid + 1, int(np.searchsorted(cands, beta * (1 + 1e-12), side="right"))))
            if res.complete:
                false_max = max(false_max, same - 1)
            else:
                all_proven = False  # unknown: treated as false, so the bound does not use it
            lo = same
    star = hi
    upper = k * float(cands[star]) if star in found else target
    options = [found[star]] if star in found else []
    if star - 1 >= 0 and time.monotonic() >= deadline:
        all_proven = False
    elif star - 1 >= 0:
        # The last contender: least latency with every period ≤ the candidate just below.
        res = branch_and_bound(SearchSpace(arr, float(cands[star - 1])), incumbent=upper * (1 + 1e-12),
                               budget=slice_budget(1.0))
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
    best.nodes = nodes
    if all_proven:
        # nothing below min(best, target) exists for this (m, K)
        best.proven, best.phi_bound = True, min(best.phi, target)
    else:
        bound = l_low
        if false_max >= 0:
            bound = max(bound, k * float(cands[false_max]))
        best.phi_bound = min(bound, best.phi)
    return best


def _relaxed_phi_bound(arr: CostArrays, l_lo: float) -> float:
    """A cheap lower bound of φ = max(K·B, L) for (m, K), from a lower bound ``l_lo`` of L.

    B ≥ the least time any device takes for the slowest unit (some stage holds it), and
    B ≥ (L − k·max link latency) / 2k for k ≤ D stages, since every stage's compute and
    outgoing occupancy are both ≤ B.
    """
    if l_lo == INF:
        return INF
    max_lat = arr.max_latency
    dn = len(arr.devices)
    unit_min = np.diff(arr.prefix, axis=1).min(axis=0)
    b_lo = max(float(unit_min.max()), (l_lo - dn * max_lat) / (2 * dn), 0.0)
    return max(l_lo, arr.k * b_lo)


def _costs_at_least(base: CostArrays, arr: CostArrays) -> bool:
    """Whether every stage, transfer and return under ``arr`` costs at least what it does under
    ``base`` and no stage fits under ``arr`` that does not under ``base``: then every plan's
    latency, and the relaxed bound, is at least ``base``'s. Transfers and returns carry m
    sequences' bytes over the same links, so m ≥ base's m orders them; unit times are checked,
    not assumed (a measured profile need not grow with the batch)."""
    return bool(arr.m >= base.m and arr.devices == base.devices and np.array_equal(arr.overhead, base.overhead)
                and (arr.emax <= base.emax).all()
                and (np.diff(arr.prefix, axis=1) >= np.diff(base.prefix, axis=1)).all())


def solve_max_throughput(
    problem: PlanningProblem, *, time_limit_s: float = 60.0, max_nodes: int = 2_000_000,
    reporter: Reporter | None = None, warm_start: ShardPlan | None = None,
) -> SolveResult:
    """The plan and micro-batching (m, K) with the most tokens/s within memory.

    First every (m, K)'s least-latency plan (fast) gives an incumbent; then the pairs
    whose upper bound beats it are solved exactly, best bound first, each only for
    plans that would beat the incumbent. ``warm_start``: a previous plan whose usable
    devices, under every (m, K), give the first incumbent (a re-plan after a failure).
    """
    t0 = time.monotonic()
    deadline = t0 + time_limit_s * SAFETY
    reporter = reporter or NullReporter()
    reporter.status("searching the maximum-throughput plan")
    check_problem(problem)
    arrays = []
    prefix_cache: dict = {}
    for m, k in micro_batch_choices(problem):
        arr = build_arrays(problem, m, k, prefix_cache)
        if not arr.devices or arr.devices[arr.src] != problem.source:
            raise does_not_fit(problem, arr)
        arrays.append(arr)
    # The relaxed latency bound of the loosest (m, K) bounds every pair that costs at least as
    # much, so a pair's own search space (a few ms at 64 devices) is built only when its bound
    # can beat the incumbent.
    base = min(arrays, key=lambda a: (a.m * a.k, a.m))
    spaces: dict[tuple[int, int], SearchSpace] = {}

    def space_of(arr: CostArrays) -> SearchSpace:
        """The pair's search space; pairs of one m whose memory limits agree share one (a space
        reads the stage times, links and limits, which K changes only through the limits)."""
        if (arr.m, arr.k) not in spaces:
            twin = next((sp for (m, _), sp in spaces.items() if m == arr.m and np.array_equal(sp.arr.emax, arr.emax)),
                        None)
            spaces[(arr.m, arr.k)] = twin or SearchSpace(arr)
        return spaces[(arr.m, arr.k)]

    base_lo = space_of(base).root_bound()
    combos = []
    for arr in arrays:
        own = arr is base or not _costs_at_least(base, arr)
        lo = _relaxed_phi_bound(arr, space_of(arr).root_bound() if own else base_lo)
        combos.append([0.0 if lo == INF else arr.k * arr.m / lo, arr.m, arr.k, arr, own])
    combos.sort(key=lambda c: (-c[0], -c[1] * c[2]))

    best_tput, best = 0.0, None

    def try_warm(arr: CostArrays) -> None:
        nonlocal best_tput, best
        warm = warm_sequence(space_of(arr), warm_start)
        if warm is not None:
            lv, bv = sequence_terms(arr, warm[0], warm[1])
            if arr.k * arr.m / max(arr.k * bv, lv) > best_tput * (1 + 1e-12):
                best_tput, best = arr.k * arr.m / max(arr.k * bv, lv), (arr, warm[0], warm[1])

    if warm_start is not None:
        # the previous plan's own (m, K) first: its repair is the likeliest good incumbent; the
        # other pairs' repairs are tried as their turn comes (if their bound can still win)
        for c in combos:
            if (c[1], c[2]) == (warm_start.micro_batch_size, warm_start.micro_batches):
                try_warm(c[3])
    proven = True
    tput_bound = 0.0
    nodes = 0
    lats: list = [None] * len(combos)
    # Each pair: (1) its least-latency plan, a quick incumbent and L*; (2) its exact φ. Cold, every
    # pair's (1) comes first, for an incumbent from each; warm-started (the repair is the
    # incumbent), each pair is settled before the next, so the best bound's pair tightens first.
    steps = [(s, i) for i in range(len(combos)) for s in (1, 2)] if warm_start is not None else \
        [(s, i) for s in (1, 2) for i in range(len(combos))]
    for step, i in steps:
        c = combos[i]
        ub, m, k, arr, own = c
        if step == 1:
            if ub > best_tput * (1 + 1e-12) and not own:
                # the shared bound could not rule this pair out: its own, tighter one
                lo = _relaxed_phi_bound(arr, space_of(arr).root_bound())
                c[0] = ub = 0.0 if lo == INF else k * m / lo
            if ub <= 0 or ub <= best_tput * (1 + 1e-12):
                continue
            if warm_start is not None:
                try_warm(arr)
            lat = lats[i] = _latency_first(space_of(arr), deadline, max_nodes, reporter.cancel_requested,
                                           below=k * m / best_tput * (1 + 1e-12) if best_tput > 0 else INF)
            nodes += lat.nodes
            if lat.sequence:
                lv, bv = sequence_terms(arr, lat.sequence, lat.boundaries)
                tput = k * m / max(k * bv, lv)
                if tput > best_tput * (1 + 1e-12):
                    best_tput, best = tput, (arr, lat.sequence, lat.boundaries)
                    reporter.partial_result(plan_from_sequence(problem, arr, lat.sequence, lat.boundaries, EXACT_STRATEGY, "throughput"))
            elif not lat.complete:
                # nothing below the cut found yet: φ ≥ L ≥ the search's bound
                proven = False
                tput_bound = max(tput_bound, min(ub, k * m / lat.lower_bound if lat.lower_bound > 0 else ub))
            continue
        lat = lats[i]
        reporter.progress(i, len(combos))
        if lat is None or not lat.sequence or ub <= best_tput * (1 + 1e-12):
            continue
        if time.monotonic() >= deadline:
            proven = False  # φ ≥ L ≥ what the latency search proved
            l_low = sequence_terms(arr, lat.sequence, lat.boundaries)[0] if lat.complete else lat.lower_bound
            tput_bound = max(tput_bound, min(ub, k * m / l_low if l_low > 0 else ub))
            continue
        if reporter.cancel_requested():
            raise Cancelled()
        out = _solve_combo(arr, lat, deadline, max_nodes, k * m / best_tput if best_tput > 0 else INF,
                           reporter.cancel_requested)
        nodes += out.nodes
        if out.seq:
            tput = k * m / out.phi
            if tput > best_tput * (1 + 1e-12):
                best_tput, best = tput, (arr, out.seq, out.ends)
                reporter.partial_result(plan_from_sequence(problem, arr, out.seq, out.ends, EXACT_STRATEGY, "throughput"))
        if not out.proven:
            proven = False
            tput_bound = max(tput_bound, k * m / out.phi_bound if out.phi_bound > 0 else ub)
    if best is None:
        if proven:
            raise does_not_fit(problem, combos[-1][3] if combos else build_arrays(problem, 1, 1))
        raise ModelDoesNotFit("no plan found within the search budget; raise the time limit", 0)
    arr, seq, ends = best
    plan = plan_from_sequence(problem, arr, seq, ends, EXACT_STRATEGY, "throughput")
    cost = evaluate(problem, plan)
    value = cost.throughput_tokens_s
    bound = value if proven else max(value, tput_bound)
    reporter.progress(len(combos), len(combos))
    return SolveResult(
        plan=plan, cost=cost, objective="throughput", value=value, bound=bound, proven_optimal=proven,
        gap=0.0 if proven else (bound - value) / bound, nodes=nodes, elapsed_s=time.monotonic() - t0,
    )


def replan_after_failure(
    problem: PlanningProblem, previous: ShardPlan, failed: str, *, time_limit_s: float = 5.0,
    reporter: Reporter | None = None,
) -> SolveResult:
    """The best plan for ``previous``'s objective without the ``failed`` device, warm-started
    from ``previous`` (its other devices, in order), so the recovery of a run is fast.

    The source cannot fail over: it holds the prompt and stage 0, so losing it is a
    ``PlanInvalid`` that tells the operator to choose another source and solve again.
    """
    if failed == problem.source:
        raise PlanInvalid([f"the source device {failed!r} failed: it holds the prompt and stage 0; choose another "
                           "source (plan editor or --source) and solve again"])
    if failed not in problem.profile.cluster.device_ids():
        raise PlanInvalid([f"{failed!r} is not a device of the cluster; nothing to re-plan around"])
    excluded = problem.excluded_devices if failed in problem.excluded_devices else (*problem.excluded_devices, failed)
    # Only the exclusions change, to a device of the cluster: the solver's own check suffices
    # (with_changes would validate the whole profile a second time on the recovery path).
    reduced = msgspec.structs.replace(problem, excluded_devices=excluded)
    solve = solve_max_throughput if previous.objective == "throughput" else solve_min_latency
    return solve(reduced, time_limit_s=time_limit_s, reporter=reporter, warm_start=previous)

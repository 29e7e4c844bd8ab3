"""Exhaustive enumeration of every plan: the reference the exact solvers are tested against.

Deliberately naive and independent of core.planning.solvers: it walks every device sequence
(source first, distinct devices) and every set of stage boundaries, computing costs with
core.planning.cost's documented per-term functions and plain Python loops. Branches whose stage
does not fit in memory are skipped (every plan through them is infeasible anyway).
"""

from __future__ import annotations

import math

from core.planning.cost import evaluate
from core.planning.plan import plan_from_boundaries
from core.planning.problem import PlanningProblem
from core.planning.solvers.exact import micro_batch_choices


def _tables(problem: PlanningProblem, m: int, k: int):
    model = problem.profile.model
    wl = problem.workload
    devices = [d for d in problem.profile.cluster.device_ids() if d not in problem.excluded_devices]
    times = {d: [problem.profile.times_of(d).decode_time(u, m) for u in range(model.num_units)] for d in devices}
    budget = {d: int(problem.profile.cluster.device(d).memory_bytes * (1 - problem.memory_headroom)) for d in devices}
    links = problem.profile.cluster.link_index()

    def mem(a: int, e: int) -> int:
        us = model.units[a:e]
        return (sum(u.param_bytes for u in us) + sum(u.kv_bytes_per_token for u in us) * m * k * wl.context_tokens
                + max(u.workspace_bytes_per_token for u in us) * m * wl.prompt_tokens)

    def xfer(a: str, b: str, nbytes: float) -> tuple[float, float]:
        if a == b:
            return 0.0, 0.0
        link = links.get((a, b))
        if link is None:
            return math.inf, math.inf
        occ = nbytes * 8 / (link.bandwidth_mbit_s * 1e6)
        return occ + link.latency_ms / 1e3, occ

    return devices, times, budget, mem, xfer


def enumerate_plans(problem: PlanningProblem, m: int, k: int):
    """Yield (device sequence, stage ends, latency L, bottleneck B) of every plan that fits."""
    devices, times, budget, mem, xfer = _tables(problem, m, k)
    model = problem.profile.model
    n = model.num_units
    src = problem.source
    if src not in devices:
        return

    def rec(seq, ends, start, lat, bott):
        d = seq[-1]
        for e in range(start + 1, n + 1):
            if mem(start, e) > budget[d]:
                break
            c = sum(times[d][start:e]) + problem.profile.times_of(d).stage_overhead_time("decode", start, e)
            out = model.units[e - 1].activation_bytes_per_token * m
            if e == n:
                t, o = xfer(d, src, out)
                if t < math.inf:
                    yield seq, ends + [e], lat + c + t, max(bott, c, o)
                continue
            for d2 in devices:
                if d2 in seq:
                    continue
                t, o = xfer(d, d2, out)
                if t == math.inf:
                    continue
                yield from rec(seq + [d2], ends + [e], e, lat + c + t, max(bott, c, o))

    yield from rec([src], [], 0, 0.0, 0.0)


def exhaustive_optimum(problem: PlanningProblem, objective: str):
    """(best value, best plan) by enumeration; value inf (latency) / 0 (throughput) when nothing fits."""
    best, arg = (math.inf, None) if objective == "latency" else (0.0, None)
    combos = [(problem.workload.batch_size, 1)] if objective == "latency" else micro_batch_choices(problem)
    for m, k in combos:
        for seq, ends, lat, bott in enumerate_plans(problem, m, k):
            if objective == "latency":
                if lat < best:
                    best, arg = lat, (list(seq), list(ends), m, k)
            else:
                tput = k * m / max(k * bott, lat)
                if tput > best:
                    best, arg = tput, (list(seq), list(ends), m, k)
    if arg is None:
        return best, None
    seq, ends, m, k = arg
    plan = plan_from_boundaries(problem.profile.model.name, problem.profile.model.num_units, seq, ends[:-1],
                                micro_batch_size=m, micro_batches=k)
    cost = evaluate(problem, plan)
    assert cost.feasible, cost.violations
    return best, plan

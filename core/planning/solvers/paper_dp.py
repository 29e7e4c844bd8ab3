"""The EdgeShard paper's own dynamic programs (Algorithms 1 and 2), as published.

They sit beside the exact solvers (``core.planning.solvers.exact``) so a comparison can say
where the published algorithms differ from the optimum of the same cost model:

- **Algorithm 1** (latency): ``D[i][j]`` = least latency of units 0..i with unit i on
  device j, ``D[i][j] = min_k D[i−1][k] + t_comp(i, j) + t_comm(i−1, k→j)``, unit 0 on the
  source, plus the token's way back to the source. Memory, as we read the paper, is
  checked along the path kept for ``D[i−1][k]``: unit i may go on j if what that path
  already put on j plus unit i fits j's budget. Two consequences the exact solver does
  not have: a state keeps one path (the fastest), so a slower path that would leave
  room for later units is lost (suboptimal, or no plan where one exists); and a path may
  leave a device and come back to it (k → j → k), which our plans forbid (one stage per
  device) — such a plan is returned as is and ``evaluate`` reports it invalid.
- **Algorithm 2** (throughput): ``g(i, S, k)`` = least pipeline bottleneck (the largest
  stage compute or link time) for units 0..i−1 on the device set S, the last stage on k;
  ``g(i, S ∪ {k'}, k') = min_j max(g(j, S, k), t_comm(j, k→k'), t_comp([j, i), k'))`` over
  stages that fit k'. It minimises the bottleneck only: the per-token cycle (a micro-batch
  waits for its own token) and the micro-batch size and count are outside it, so its plan
  is given its best micro-batching afterwards (as the baselines are) and may fall short of
  the exact throughput. It enumerates device subsets: 2^(devices − 1) of them.

Both work on the arrays of ``core.planning.solvers.arrays`` (the one cost model), one node per
device with its weights at fp (``PUBLISHED_PRECISIONS``): the paper chooses no weight precision. Under a
quality bound the arrays would make each (device, precision) pair a node, which Algorithm 2's device set
counts as two devices (a plan with a device twice, costed at times its fp stages do not have).
"""

from __future__ import annotations

import time

import numpy as np

from core.errors import EdgeShardError, ModelDoesNotFit
from core.planning.plan import ShardPlan, Stage
from core.planning.problem import PlanningProblem, check_problem
from core.planning.solvers.arrays import build_arrays

INF = float("inf")
PUBLISHED_PRECISIONS = ("fp",)
"""The paper places layers on devices at the model's own weights; fp meets every quality bound."""


class PaperAlgorithmTimeout(EdgeShardError):
    """Algorithm 2 enumerates device subsets; on many devices it can outlast its budget."""


def _stages_from_units(devices: list[str], per_unit: list[int]) -> tuple[Stage, ...]:
    """Consecutive units on the same device form one stage (a device may recur: k → j → k)."""
    stages, start = [], 0
    for u in range(1, len(per_unit) + 1):
        if u == len(per_unit) or per_unit[u] != per_unit[start]:
            stages.append(Stage(device=devices[per_unit[start]], start=start, end=u))
            start = u
    return tuple(stages)


def _fill_subset_dp(g: np.ndarray, stage: np.ndarray, occupancy: np.ndarray, others: list[int], bit: dict[int, int],
                    n: int, deadline: float, time_limit_s: float, chunk_bytes: int = 16 << 20) -> None:
    """Fill ``g(i, S, k')`` for every non-empty S in place, in float32, subsets of one size at a time.

    The recurrence as written, per (S, k, k'), is ~20× slower in numpy (53 s of the suite); this
    computes the very same numbers. The state (S ∪ {k'}, k') has one predecessor set S, so a
    layer of equal-sized sets is *pulled* at once. Because ``max(·, c)`` is monotone,
    ``min_k max(g, link, stage) = max(min_k max(g(j, S, k), link(k→k', j)), stage)``: the last
    device k is folded out before the stage term. ``min``/``max`` never round, and rounding to
    float32 is monotone, so doing it all in float32 gives the bits the float64 recurrence stored.
    """
    n_others = len(others)
    counts = np.array([bin(m).count("1") for m in range(1 << n_others)])
    occ = occupancy[:, :, :n].astype(np.float32)  # (D, D', N): link k→k' busy with the output after unit j
    stage32 = stage[:, :n, :].astype(np.float32)  # (D', N, N+1): stage [j, i) on k'
    for size in range(1, n_others + 1):
        layer = np.nonzero(counts == size)[0]
        for k2 in others:
            targets = layer[(layer & bit[k2]) != 0]
            rows = max(1, chunk_bytes // (4 * n * (n + 1)))
            for at in range(0, targets.size, rows):
                if time.monotonic() > deadline:
                    raise PaperAlgorithmTimeout(
                        f"the paper's Algorithm 2 enumerates {1 << n_others} device subsets and ran past "
                        f"{time_limit_s:g} s at subsets of {size}; exclude devices or use --strategy edgeshard")
                to = targets[at:at + rows]
                # h[s, j] = min over the last device k of max(g(j, S, k), link k→k2 after unit j)
                h = np.maximum(g[to ^ bit[k2], :, :n], occ[None, :, k2, :]).min(axis=1)
                g[to, k2] = np.maximum(h[:, :, None], stage32[k2][None]).min(axis=1)


def paper_dp_latency(problem: PlanningProblem, objective: str = "latency") -> ShardPlan:
    """Algorithm 1: the published latency DP over (unit, device), memory checked along the kept path.

    Raises ``ModelDoesNotFit`` when the DP finds no path (which can happen where a plan exists).
    """
    check_problem(problem)
    m = problem.workload.batch_size
    arr = build_arrays(problem, m, 1, precisions=PUBLISHED_PRECISIONS)
    n, dn = arr.n, len(arr.devices)
    unit_t = np.diff(arr.prefix, axis=1)  # (D, N): each unit's decode time on each device
    unit_mem = np.array([arr.stage_bytes[u, u + 1] for u in range(n)], dtype=np.int64)
    dist = np.full(dn, INF)
    used = np.zeros((dn, dn), dtype=np.int64)  # used[j] = memory per device along the path of state j
    parents: list[np.ndarray] = []
    if unit_mem[0] <= arr.budgets[arr.src]:
        dist[arr.src] = unit_t[arr.src, 0]
        used[arr.src, arr.src] = unit_mem[0]
    for u in range(1, n):
        new_dist = np.full(dn, INF)
        new_used = np.zeros((dn, dn), dtype=np.int64)
        parent = np.full(dn, -1)
        for j in range(dn):
            for k in range(dn):
                if dist[k] == INF or used[k, j] + unit_mem[u] > arr.budgets[j]:
                    continue
                comm = 0.0 if k == j else arr.transfer[k, j, u]
                cand = dist[k] + unit_t[j, u] + comm
                if cand < new_dist[j]:
                    new_dist[j], parent[j] = cand, k
                    new_used[j] = used[k]
                    new_used[j, j] += unit_mem[u]
        dist, used = new_dist, new_used
        parents.append(parent)
    total = dist + arr.ret
    if not np.isfinite(total).any():
        raise ModelDoesNotFit(
            "the paper's Algorithm 1 found no placement within memory (its per-path memory check "
            "keeps only the fastest path to each device; try --strategy edgeshard)", 0)
    j = int(np.argmin(total))
    per_unit = [j]
    for parent in reversed(parents):
        j = int(parent[j])
        per_unit.append(j)
    per_unit.reverse()
    return ShardPlan(model=problem.profile.model.name, num_units=n,
                     stages=_stages_from_units(list(arr.devices), per_unit), strategy="paper-dp-latency",
                     objective="latency", micro_batch_size=m, micro_batches=1)


def paper_dp_throughput(problem: PlanningProblem, objective: str = "throughput", time_limit_s: float = 60.0) -> ShardPlan:
    """Algorithm 2: the published bottleneck DP over (units, device set, last device).

    Computed at micro-batches of one sequence with the whole batch resident (memory as the
    pipeline needs it); the caller gives the stages their best micro-batching. Raises
    ``ModelDoesNotFit`` without a plan, ``PaperAlgorithmTimeout`` past ``time_limit_s``.
    """
    check_problem(problem)
    b = problem.workload.batch_size
    arr = build_arrays(problem, 1, b, precisions=PUBLISHED_PRECISIONS)
    n, dn, src = arr.n, len(arr.devices), arr.src
    others = [d for d in range(dn) if d != src]
    bit = {d: 1 << i for i, d in enumerate(others)}
    ends = np.arange(n + 1)
    # stage[d, a, e]: compute of [a, e) on d, inf where empty or over memory
    stage = arr.prefix[:, None, :] - arr.prefix[:, :, None]
    valid = (ends[None, None, :] > ends[None, :, None]) & (ends[None, None, :] <= arr.emax[:, :, None])
    stage = np.where(valid, stage, INF)
    g = np.full((1 << len(others), dn, n + 1), INF, dtype=np.float32)  # 2^14 × 15 × 84 × 4 B = 82 MB for 70B
    g[0, src, :] = stage[src, 0, :]
    bits = np.array([0 if d == src else 1 << others.index(d) for d in range(dn)], dtype=np.int64)
    _fill_subset_dp(g, stage, arr.occupancy, others, bit, n, time.monotonic() + time_limit_s, time_limit_s)
    final = np.maximum(g[:, :, n], arr.ret_occupancy[None, :])
    if not np.isfinite(final).any():
        raise ModelDoesNotFit("the paper's Algorithm 2 found no placement within memory", 0)
    mask, k = (int(x) for x in np.unravel_index(int(np.argmin(final)), final.shape))
    stages, i = [], n
    while mask:  # walk back: the predecessor state whose value the DP took (recomputed, not stored)
        target, pm = g[mask, k, i], mask & ~int(bits[k])
        prev = [(kp, j) for kp in [src] + [d for d in others if pm & bits[d]] for j in range(i)
                if np.isfinite(g[pm, kp, j])
                and np.float32(max(g[pm, kp, j], arr.occupancy[kp, k, j], stage[k, j, i])) <= target]
        kp, j = prev[0]
        stages.append(Stage(device=arr.devices[k], start=j, end=i))
        mask, k, i = pm, kp, j
    stages.append(Stage(device=arr.devices[k], start=0, end=i))
    return ShardPlan(model=problem.profile.model.name, num_units=n, stages=tuple(reversed(stages)),
                     strategy="paper-dp-throughput", objective="throughput", micro_batch_size=1, micro_batches=b)

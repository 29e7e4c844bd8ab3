"""The cost model of ``core.planning.cost`` as numpy arrays, for one micro-batch size and count.

The solvers search over these; the plan they return is always re-evaluated by
``core.planning.cost.evaluate``, so the arrays only have to agree with it (tests check that).
Indices: d = device (the problem's usable devices in cluster order), u = unit,
e = a boundary (stage ends before unit e, 0..N).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from core.planning.precision import allowed_precisions, unit_time_factors, unit_weight_bytes
from core.planning.problem import PlanningProblem, usable_memory_bytes

INF = math.inf


@dataclass(frozen=True)
class CostArrays:
    devices: tuple[str, ...]
    src: int
    n: int
    m: int
    k: int
    prefix: np.ndarray
    """(D, N+1): prefix[d, e] = decode time of units [0, e) on d at batch m."""
    emax: np.ndarray
    """(D, N+1) int: a stage on d starting at unit a fits in memory up to end emax[d, a] (a if none)."""
    link_arrays: Callable[[], tuple]
    """Makes (transfer, occupancy, ret, ret_occupancy) on first use (the properties
    below): (D, D, N+1) arrays that a pair ruled out by a bound never needs."""
    stage_bytes: np.ndarray
    """(N+1, N+1) int64: memory of a stage [a, e) at this (m, K) (−1 where e ≤ a)."""
    budgets: np.ndarray
    """(D,) int64: memory each device may fill."""
    max_latency: float = 0.0
    """The largest one-way link latency between usable devices, s."""
    weights_prefix: np.ndarray | None = None
    """(N+1,) parameter bytes of units [0, e)."""
    overhead: np.ndarray | None = None
    """(D,): once-per-stage decode overhead of each device (``DeviceTimes.stage_decode_overhead_s``),
    charged to a stage that holds a decoder block, i.e. [a, e) with a < N−1 and e > 1."""
    weights: tuple[str, ...] = ()
    """Under a quality bound, d is a (device, weight precision) pair: ``devices[d]`` names the
    device (repeated once per precision), ``weights[d]`` the precision; empty: every d at fp."""
    group: np.ndarray | None = None
    """(D,) int: the device each d is (its first index); pairs of one device are used together or
    not at all, and never follow each other. None: every d its own device."""

    @cached_property
    def _links(self) -> tuple:
        return self.link_arrays()

    transfer = property(lambda self: self._links[0], doc="""(D, D, N+1): seconds to send the output of a
        stage ending at e from d to d' (inf: no link / same).""")
    occupancy = property(lambda self: self._links[1], doc="(D, D, N+1): seconds the d→d' link is busy with it (no latency).")
    ret = property(lambda self: self._links[2], doc="""(D,): seconds for the head's output (token ids) from d
        back to the source (0 on the source).""")
    ret_occupancy = property(lambda self: self._links[3], doc="(D,): seconds the return link is busy with it.")

    @cached_property
    def symmetry_classes(self) -> np.ndarray:
        """cls[d]: the lowest index of a device interchangeable with d (d itself if none)."""
        return symmetry_classes(self)

    def stage_time(self, d: int, a: int, e: int) -> float:
        return float(self.prefix[d, e] - self.prefix[d, a]) + self.stage_overhead(d, a, e)

    def stage_overhead(self, d: int, a: int, e: int) -> float:
        """As ``DeviceTimes.stage_overhead_time``: paid once by a stage holding a decoder block."""
        if self.overhead is None or not (a < self.n - 1 and e > 1):
            return 0.0
        return float(self.overhead[d])

    def overhead_matrix(self, d: int) -> np.ndarray:
        """(N+1, N+1): the overhead of every stage [a, e) on d (0 where it holds no block)."""
        a_idx, e_idx = np.arange(self.n + 1)[:, None], np.arange(self.n + 1)[None, :]
        o = 0.0 if self.overhead is None else float(self.overhead[d])
        return np.where((a_idx < self.n - 1) & (e_idx > 1), o, 0.0)


def usable_devices(problem: PlanningProblem) -> tuple[str, ...]:
    """Devices a plan may use: known, profiled and not excluded (source first)."""
    timed = {t.device for t in problem.profile.times}
    ids = [d for d in problem.profile.cluster.device_ids() if d in timed and d not in problem.excluded_devices]
    if problem.source in ids:
        ids.remove(problem.source)
        ids.insert(0, problem.source)
    return tuple(ids)


def stage_memory_matrix(problem: PlanningProblem, sequences: int, pass_sequences: int, weights: str = "fp") -> np.ndarray:
    """Bytes of every stage [a, e): weights at ``weights`` precision + KV for ``sequences`` + workspace
    of one pass (as core.planning.cost.memory_of)."""
    model = problem.profile.model
    units = model.units
    n = len(units)
    ctx = problem.workload.context_tokens
    pass_tokens = pass_sequences * problem.workload.prompt_tokens
    w = np.array([unit_weight_bytes(u, weights, model.dtype) for u in units], dtype=np.int64)
    kv = np.array([u.kv_bytes_per_token for u in units], dtype=np.int64)
    ws = np.array([u.workspace_bytes_per_token for u in units], dtype=np.int64)
    wp = np.concatenate([[0], np.cumsum(w)])
    kp = np.concatenate([[0], np.cumsum(kv)])
    # run[a, j] = max(ws[a..j]): one running maximum over rows with the units before a masked out
    a_idx, j_idx = np.arange(n)[:, None], np.arange(n)[None, :]
    run = np.maximum.accumulate(np.where(j_idx >= a_idx, ws[None, :], np.iinfo(np.int64).min), axis=1)
    out = np.full((n + 1, n + 1), -1, dtype=np.int64)
    e_idx = np.arange(n + 1)[None, :]
    body = (wp[None, 1:] - wp[:n, None]) + (kp[None, 1:] - kp[:n, None]) * sequences * ctx + run * pass_tokens
    out[:n, 1:] = np.where(e_idx[:, 1:] > a_idx, body, -1)
    return out


def decode_times(times, batch: int, n: int) -> np.ndarray:
    """(n,) ``times.decode_time(u, batch)`` of units 0..n-1 at once: the same interpolation rule
    (core.devices.profile.interpolate) and the same floating-point operations, on every unit."""
    xs = times.decode_batch_sizes
    try:
        ys = np.array(times.decode_s[:n], dtype=float)
    except ValueError:  # ragged rows
        ys = None
    if not xs or ys is None or ys.shape != (n, len(xs)):
        return np.array([times.decode_time(u, batch) for u in range(n)])  # the scalar rule says what is wrong
    if batch <= xs[0]:
        return ys[:, 0] * batch / xs[0]
    if batch >= xs[-1]:
        return ys[:, -1] * batch / xs[-1]
    i = bisect_left(xs, batch)
    if xs[i] == batch:
        return ys[:, i].copy()
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[:, i - 1], ys[:, i]
    return y0 + (y1 - y0) * (batch - x0) / (x1 - x0)


def build_arrays(problem: PlanningProblem, m: int, k: int, prefix_cache: dict | None = None,
                 precisions: tuple[str, ...] | None = None) -> CostArrays:
    """Arrays for K = k micro-batches of m sequences (a latency plan: m = batch, k = 1).

    ``prefix_cache`` (m → decode prefix sums, and the link arrays per m) saves re-reading the
    profile and rebuilding the (D, D, N+1) link arrays for each K; the link arrays are made
    when first read. ``precisions``: the weight precisions a device may take (default: the
    problem's ``allowed_precisions``); more than fp makes each device one d per precision.
    """
    physical = usable_devices(problem)
    precisions = allowed_precisions(problem) if precisions is None else precisions
    pairs = [(i, w) for i in range(len(physical)) for w in precisions]
    devices = tuple(physical[i] for i, _ in pairs)
    group = np.array([i * len(precisions) for i, _ in pairs]) if len(precisions) > 1 else None
    model = problem.profile.model
    n = model.num_units
    dn = len(devices)
    prefix = None if prefix_cache is None else prefix_cache.get(m)
    if prefix is None:
        prefix = np.zeros((dn, n + 1))
        by_id = {t.device: t for t in problem.profile.times}
        for i, (dev, w) in enumerate(zip(devices, (w for _, w in pairs))):  # a device's own ratio where profiled
            factors = np.array(unit_time_factors(problem.profile, w, "decode", dev))
            prefix[i, 1:] = np.cumsum(decode_times(by_id[dev], m, n) * factors)
        if prefix_cache is not None:
            prefix_cache[m] = prefix
    times_by_id = {t.device: t for t in problem.profile.times}
    overhead = np.array([times_by_id[d].stage_decode_overhead_s for d in devices], dtype=float)
    mems = {w: stage_memory_matrix(problem, m * k, m, w) for w in precisions}
    cluster = problem.profile.cluster
    mem_of = {d.id: d.memory_bytes for d in cluster.devices}
    budgets = np.array([usable_memory_bytes(problem, mem_of[d]) for d in devices], dtype=np.int64)
    # Monotone in e (memory only grows with the range), so the count of fitting ends is the last one.
    emax = np.tile(np.arange(n + 1), (dn, 1))
    at = np.array([w for _, w in pairs])
    for w, mem in mems.items():
        rows = np.flatnonzero(at == w)
        for a in range(n):
            emax[rows, a] += np.searchsorted(mem[a, a + 1:], budgets[rows], side="right")

    def links() -> tuple:
        per_m = None if prefix_cache is None else prefix_cache.get(("links", m))
        if per_m is None:
            per_m = _link_arrays(problem, physical, group, m, prefix_cache)
            if prefix_cache is not None:
                prefix_cache[("links", m)] = per_m
        return per_m

    lat = _link_matrices(problem, physical, prefix_cache)[1]
    return CostArrays(
        devices=devices, src=0, n=n, m=m, k=k, prefix=prefix, emax=emax, link_arrays=links,
        stage_bytes=mems[precisions[-1]], budgets=budgets, max_latency=float(lat[np.isfinite(lat)].max(initial=0.0)),
        weights_prefix=np.concatenate([[0], np.cumsum([u.param_bytes for u in model.units])]).astype(float),
        overhead=overhead, weights=tuple(w for _, w in pairs) if group is not None else (), group=group,
    )


def _link_matrices(problem: PlanningProblem, devices: tuple[str, ...], prefix_cache: dict | None):
    """(bandwidth bit/s, latency s) between the usable devices, (D, D) each (0 / inf: no link)."""
    cached = None if prefix_cache is None else prefix_cache.get("links")
    if cached is not None:
        return cached
    dn = len(devices)
    bw = np.full((dn, dn), 0.0)
    lat = np.full((dn, dn), INF)
    pos = {dev: i for i, dev in enumerate(devices)}
    for link in problem.profile.cluster.links:
        i, j = pos.get(link.src), pos.get(link.dst)
        if i is not None and j is not None and i != j and link.bandwidth_mbit_s > 0:
            bw[i, j] = link.bandwidth_mbit_s * 1e6
            lat[i, j] = link.latency_ms / 1e3
    if prefix_cache is not None:
        prefix_cache["links"] = (bw, lat)
    return bw, lat


def _link_arrays(problem: PlanningProblem, devices: tuple[str, ...], group: np.ndarray | None, m: int,
                 prefix_cache: dict | None):
    """(transfer, occupancy, ret, ret_occupancy) for micro-batches of m sequences: the same for
    every K, so a cache shares them (nothing writes into them). ``group``: the (device, precision)
    pairs' devices (``CostArrays.group``); a device has no link to itself, so its pairs none either."""
    model = problem.profile.model
    n = model.num_units
    act = np.array([u.activation_bytes_per_token for u in model.units], dtype=float)
    out_bytes = np.zeros(n + 1)
    out_bytes[1:] = act * m
    bw, lat = _link_matrices(problem, devices, prefix_cache)
    if group is not None:
        of = np.searchsorted(np.unique(group), group)
        bw, lat = bw[np.ix_(of, of)], lat[np.ix_(of, of)]
    with np.errstate(divide="ignore"):
        inv = np.where(bw > 0, 8.0 / np.where(bw > 0, bw, 1.0), INF)
    out_bytes[0] = 1.0  # boundary 0 is never a stage end; avoids inf · 0 below
    occupancy = inv[:, :, None] * out_bytes[None, None, :]
    transfer = occupancy + lat[:, :, None]
    transfer[:, :, 0] = INF
    occupancy[:, :, 0] = INF
    src = 0
    ret = transfer[:, src, n].copy()
    ret_occ = occupancy[:, src, n].copy()
    home = src if group is None else group == group[src]
    ret[home] = 0.0
    ret_occ[home] = 0.0
    return transfer, occupancy, ret, ret_occ


def symmetry_classes(arr: CostArrays) -> np.ndarray:
    """cls[d]: the lowest index of a device interchangeable with d (d itself if none).

    Swapping two interchangeable devices maps every plan to one of equal cost, so the
    search uses the members of a class in index order only.
    """
    dn = len(arr.devices)
    cls = np.arange(dn)
    groups: dict[bytes, list[int]] = {}
    for d in range(dn):
        if d == arr.src:
            continue
        over = b"" if arr.overhead is None else arr.overhead[d:d + 1].tobytes()
        sig = over + arr.prefix[d].tobytes() + arr.emax[d].tobytes() + arr.ret[d:d + 1].tobytes() + arr.ret_occupancy[d:d + 1].tobytes()
        reps = groups.setdefault(sig, [])
        for r in reps:
            if _interchangeable(arr, r, d):
                cls[d] = r
                break
        else:
            reps.append(d)
    return cls


def _interchangeable(arr: CostArrays, i: int, j: int) -> bool:
    """Same times, memory and return link are checked by the caller's signature."""
    others = [k for k in range(len(arr.devices)) if k not in (i, j)]
    for t in (arr.transfer, arr.occupancy):
        if not (np.array_equal(t[i, others], t[j, others]) and np.array_equal(t[others, i], t[others, j])
                and np.array_equal(t[i, j], t[j, i])):
            return False
    return True

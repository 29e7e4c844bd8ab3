"""Exact search for the cheapest plan under the plan rules, by branch and bound.

A plan is a sequence of distinct devices (the source first) plus the boundaries between
their stages. The search branches on the device sequence; for a sequence prefix it keeps
a vector ``F[e]``: the least cost of running units [0, e) with the prefix's last stage
ending at e. Extending the prefix by a device is an O(N²) min-plus step in numpy.

Pruning, all exact:
- *bound*: ``G[d, e]``, the cheapest completion after a stage on d ended at e when
  devices may be reused (the paper's per-layer DP, Algorithm 1, with per-stage memory):
  a relaxation, so ``min_e F[e] + G[d, e]`` is a lower bound of every completion;
- *dominance*: two prefixes with the same device set and last device have the same
  completions, so one whose ``F`` is nowhere below what was already seen is dropped;
- *symmetry*: devices that are interchangeable (same times, memory, links) are used in
  index order only;
- *bytes*: the units left cost at least their bytes at the unused devices' best per-byte
  rates, filled fractionally (at most a device's largest stage each), plus either the
  hand-overs the fewest such stages need (``stage_count_bound``) or, stronger when the
  fast devices are small, the same filling with each byte also paying its share of the
  hand-over into its stage (``amortized``: rate + cheapest transfer / stage capacity).
  Counting a transfer per stage is what makes a re-plan that must replace one large stage
  by several small ones provable: at 64 all-different devices it takes 98 nodes, not 1,644.

Under a quality bound a device is one d per weight precision (``CostArrays.group``): choosing
one marks all of that device's pairs used (in the dominance key too), so each device holds at
most one stage, at one precision; the search starts once from each pair of the source. The
bounds stay valid: a device's unused pairs only add capacity to relaxations.

The cost searched is additive: Σ stage compute + Σ transfers (+ the token ids back to
the source), i.e. the per-token latency; a *filter* ``beta`` (for throughput) forbids
stages whose compute or outgoing link occupancy exceeds it.
When the budget (nodes or seconds) runs out, the result carries the best plan found
and a proven lower bound: the least bound over the prefixes not yet explored.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from core.reporting import Cancelled
from core.planning.solvers.arrays import CostArrays

INF = math.inf


@dataclass
class SearchBudget:
    max_nodes: int = 2_000_000
    max_seconds: float = 30.0
    nodes: int = 0
    started: float = field(default_factory=time.monotonic)
    cancel_requested: Callable[[], bool] | None = None
    """Polled with the clock; when it returns True the search raises ``Cancelled``."""

    def out_of_time(self) -> bool:
        if self.cancel_requested is not None and self.cancel_requested():
            raise Cancelled()
        return time.monotonic() - self.started >= self.max_seconds


@dataclass
class SearchResult:
    cost: float
    """Least cost found (inf: no plan found)."""
    sequence: tuple[int, ...]
    boundaries: tuple[int, ...]
    """Stage ends, one per device of ``sequence`` (the last is N)."""
    lower_bound: float
    complete: bool
    """True when the search space was exhausted: ``cost`` is optimal (or no plan exists)."""
    nodes: int


class SearchSpace:
    """The arrays under an optional bottleneck filter, with the relaxed completion bound."""

    def __init__(self, arr: CostArrays, beta: float = INF):
        self.arr = arr
        self.beta = beta
        n, dn = arr.n, len(arr.devices)
        emax = arr.emax.copy()
        # off[d, a]: the overhead a stage on d starting at a >= 1 pays (it holds a block iff a < N-1).
        # A stage starting at 0 (the source's) pays it only when it reaches past the embedding.
        o = np.zeros(dn) if arr.overhead is None else arr.overhead
        starts = np.arange(n + 1)
        off = np.where((starts >= 1) & (starts < n - 1), o[:, None], 0.0)
        self.overhead = o
        if beta < INF:
            # largest e with prefix[d, e] - prefix[d, a] + overhead <= beta (prefix is nondecreasing)
            tol = beta * (1 + 1e-12)
            for d in range(dn):
                p = arr.prefix[d]
                lim = np.searchsorted(p, p + tol - off[d], side="right") - 1
                lim0 = np.searchsorted(p, p[0] + tol - o[d], side="right") - 1
                lim[0] = max(lim0, 1) if n >= 1 and p[1] - p[0] <= tol else lim0
                emax[d] = np.minimum(emax[d], lim)
        emax = np.maximum(emax, np.arange(n + 1)[None, :])
        self.emax = emax
        a_idx = np.arange(n + 1)[:, None]
        e_idx = np.arange(n + 1)[None, :]
        self.valid = (e_idx > a_idx)[None, :, :] & (e_idx <= emax[:, :, None])
        # The overhead of the stage a transfer feeds is folded into that transfer, so a
        # path's sum of transfers and prefix differences is the plan's latency.
        tr = arr.transfer + off[None, :, :]
        ret = arr.ret.copy()
        if beta < INF:
            tr[arr.occupancy > beta * (1 + 1e-12)] = INF
            ret[arr.ret_occupancy > beta * (1 + 1e-12)] = INF
        # (device, precision) pairs of one device are used together or not at all (CostArrays.group).
        of = np.arange(dn) if arr.group is None else arr.group
        self.members = [np.flatnonzero(of == of[d]) for d in range(dn)]
        self.sources = self.members[arr.src]
        """The source device's pairs: the search starts from each (stage 0 at each precision)."""
        # No stage may go to the source (it holds stage 0) or back to the same device.
        tr[:, self.sources, :] = INF
        tr[np.arange(dn), np.arange(dn), :] = INF
        self.tr = tr
        self.ret = ret
        self.classes = arr.symmetry_classes
        # cap[d, e]: the most units one stage on d can hold starting at or after unit e.
        # Units [e, N) need distinct unused devices, so Σ_unused cap[d, e] ≥ N − e.
        span = (self.emax - np.arange(n + 1)[None, :]).astype(float)
        self.cap = np.maximum.accumulate(span[:, ::-1], axis=1)[:, ::-1]
        # Byte-rate bound: t(d, u) ≥ w_u · rate[d] (w = parameter bytes), and a stage on d
        # holds at most capb[d] bytes, so the units [e, N) cost at least the cheapest
        # fractional filling of their bytes into the unused devices (a convex piecewise
        # linear function of the bytes left: np.interp over the devices sorted by rate).
        wp = arr.weights_prefix
        w = np.diff(wp)
        unit_t = np.diff(arr.prefix, axis=1)
        pos = w > 0
        self.rate = (unit_t[:, pos] / w[pos]).min(axis=1) if pos.any() else np.zeros(dn)
        self.capb = (wp[self.emax] - wp[None, :]).max(axis=1)
        self.rate_order = np.argsort(self.rate, kind="stable")
        self.wsuf = wp[n] - wp
        out = self.tr.min(axis=1)
        out[:, n] = self.ret
        self.outmin = out
        # Stage-count bound: units [e, N) on distinct unused devices need at least k(e) stages
        # (the fewest devices whose largest stages hold their bytes), so k(e) - 1 hand-overs
        # between them, each at least the cheapest transfer at an inner boundary, and a return.
        inner = tr[:, :, 1:n] if n > 1 else np.full(1, INF)
        self.tmin = float(inner.min()) if inner.size else INF  # inf only when no inner transfer is finite
        t = self.tmin if self.tmin < INF else 0.0
        with np.errstate(divide="ignore"):
            self.amortized_rate = np.where(self.capb > 0, self.rate + t / np.maximum(self.capb, 1e-300), INF)
        self.amortized_order = np.argsort(self.amortized_rate, kind="stable")
        self.capb_cost = np.where(self.capb > 0, self.capb * self.rate + t, 0.0)
        """What a full stage on d costs at least: its bytes' compute and the hand-over into it."""

    def byte_bound(self, unused: np.ndarray) -> np.ndarray:
        """Least compute for units [e, N) on the devices marked ``unused`` (inf: not enough room)."""
        return self.byte_bounds_without(unused, np.array([-1]))[0]

    def byte_bounds_without(self, unused: np.ndarray, drop: np.ndarray, amortized: bool = False) -> np.ndarray:
        """``byte_bound`` of ``unused`` less one device ``drop[i]`` for each row i (-1: none).

        ``amortized``: each byte also pays its share of the hand-over into its stage (a stage
        on d holds at most capb[d] bytes and is entered by a transfer of at least ``tmin``, so
        rate[d] + tmin / capb[d] per byte): the least compute plus hand-overs, one per stage.

        One sort, one cumulative sum and one interpolation for all rows: without a device of
        capacity c and rate r at sorted place p, the bound for W bytes is the full one where
        W ≤ xs[p] (the devices before it fill W) and full(W + c) − c·r beyond (the breakpoints
        after it move down by c and c·r).
        """
        rate, order = (self.amortized_rate, self.amortized_order) if amortized else (self.rate, self.rate_order)
        sel = order[unused[order]]
        caps = self.capb[sel]
        xs = np.concatenate(([0.0], np.cumsum(caps)))
        ys = np.concatenate(([0.0], np.cumsum(self.capb_cost[sel] if amortized else caps * rate[sel])))
        where = np.full(len(rate), -1)
        where[sel] = np.arange(len(sel))
        p = np.where(drop >= 0, where[drop], -1)
        c = np.where(p >= 0, self.capb[drop], 0.0)[:, None]
        at = np.where(p >= 0, xs[np.maximum(p, 0)], INF)[:, None]
        w = self.wsuf[None, :]
        before = w <= at
        lb = np.interp(np.where(before, w, w + c), xs, ys)
        lb -= np.where(before, 0.0, (ys[np.minimum(p + 1, len(sel))] - ys[np.maximum(p, 0)])[:, None])
        lb[w > (xs[-1] - c) * (1 + 1e-12)] = INF
        return lb

    def stage_count_bound(self, unused: np.ndarray) -> np.ndarray:
        """Least hand-over and return time after a stage ending at e when units [e, N) run on
        stages of the devices marked ``unused`` (0 at N; inf: they cannot hold the bytes)."""
        caps = np.sort(self.capb[unused])[::-1]
        cum = np.cumsum(caps)
        if not cum.size:
            return np.where(self.wsuf > 0, INF, 0.0)
        stages = np.searchsorted(cum, self.wsuf * (1 - 1e-12), side="left") + 1
        hand_overs = np.where(stages > 1, (stages - 1) * self.tmin, 0.0) if self.tmin < INF else \
            np.where(stages > 1, INF, 0.0)
        out = hand_overs + float(self.ret[unused].min())
        out[stages > cum.size] = INF
        out[self.wsuf <= 0] = 0.0
        return out

    @property
    def g(self) -> np.ndarray:
        """G[d, e]: cheapest finish after a stage on d ended at e, devices reusable.

        Computed on first use (a few ms at 64 devices): repairing a plan (``extend``,
        ``reconstruct``) does not need it."""
        return self._relaxed_completion[0]

    @property
    def h(self) -> np.ndarray:
        """H[d, a]: cheapest finish from a stage on d starting at a, devices reusable."""
        return self._relaxed_completion[1]

    @cached_property
    def _relaxed_completion(self) -> tuple[np.ndarray, np.ndarray]:
        arr, n = self.arr, self.arr.n
        dn = len(arr.devices)
        g = np.full((dn, n + 1), INF)
        h = np.full((dn, n + 1), INF)
        g[:, n] = self.ret
        p = arr.prefix
        for a in range(n - 1, -1, -1):
            cand = p[:, a + 1:] - p[:, a:a + 1] + g[:, a + 1:]
            cand = np.where(self.valid[:, a, a + 1:], cand, INF)
            h[:, a] = cand.min(axis=1)
            if a >= 1:
                g[:, a] = (self.tr[:, :, a] + h[None, :, a]).min(axis=1)
        return g, h

    def root(self, src: int | None = None) -> np.ndarray:
        """F of stage 0 alone on ``src`` (default: the source; under a quality bound, one of its pairs)."""
        arr = self.arr
        src = arr.src if src is None else src
        stage0 = arr.prefix[src] - arr.prefix[src, 0]
        stage0 = stage0 + np.where(np.arange(arr.n + 1) > 1, self.overhead[src], 0.0)
        f = np.where(self.valid[src, 0], stage0, INF)
        return f

    def root_bound(self) -> float:
        return float(self.h[self.sources, 0].min())

    def amortized_rest(self, unused: np.ndarray) -> np.ndarray:
        """What the amortized byte bound adds: a return to the source, less the first stage's
        hand-over (``outmin`` counts that one); 0 at N."""
        t = self.tmin if self.tmin < INF else 0.0
        out = np.full(self.wsuf.size, float(self.ret[unused].min()) - t if unused.any() else INF)
        out[self.wsuf <= 0] = 0.0
        return out

    def extend_rows(self, fs: np.ndarray, prev: np.ndarray, d2: int) -> np.ndarray:
        """``extend`` of each row fs[i] (a prefix ending on device prev[i]) by a stage on d2."""
        a_vals = fs + self.tr[prev, d2]
        idx = np.flatnonzero(np.isfinite(a_vals).any(axis=0))
        if idx.size == 0:
            return np.full(fs.shape, INF)
        p = self.arr.prefix[d2]
        z = (a_vals[:, idx] - p[idx])[:, :, None]
        return np.where(self.valid[d2][idx][None, :, :], z, INF).min(axis=1) + p

    def extend_all(self, f: np.ndarray, d: int, targets: np.ndarray) -> np.ndarray:
        """``extend`` to every device in ``targets`` at once: shape (len(targets), N+1)."""
        a_vals = f[None, :] + self.tr[d, targets]
        idx = np.flatnonzero(np.isfinite(a_vals).any(axis=0))
        if idx.size == 0:
            return np.full((len(targets), f.size), INF)
        p = self.arr.prefix[targets]
        z = (a_vals[:, idx] - p[:, idx])[:, :, None]
        cand = np.where(self.valid[targets][:, idx, :], z, INF).min(axis=1)
        return cand + p

    def extend(self, f: np.ndarray, d: int, d2: int) -> np.ndarray:
        """F of the prefix extended by a stage on d2 (min-plus over the previous stage's end)."""
        a_vals = f + self.tr[d, d2]
        idx = np.flatnonzero(a_vals < INF)
        if idx.size == 0:
            return np.full_like(f, INF)
        p = self.arr.prefix[d2]
        z = (a_vals[idx] - p[idx])[:, None]
        cand = np.where(self.valid[d2, idx], z, INF).min(axis=0)
        return cand + p


def branch_and_bound(space: SearchSpace, incumbent: float = INF, budget: SearchBudget | None = None,
                     stop_below: float = -INF, on_incumbent: Callable[[tuple, tuple, float], None] | None = None) -> SearchResult:
    """Least-cost device sequence and boundaries; prunes anything not below ``incumbent``.

    ``stop_below``: return as soon as a plan cheaper than this is found (a feasibility
    question; the result is then not proven optimal unless its cost equals the bound).
    ``on_incumbent(sequence, stage_ends, cost)`` is called for each better plan found.
    """
    arr = space.arr
    n, dn, src = arr.n, len(arr.devices), arr.src
    budget = budget or SearchBudget()
    g = space.g
    cls = space.classes
    best = {"cost": incumbent, "seq": ()}
    envelopes: dict[tuple[int, int], np.ndarray] = {}
    pending: list[float] = []
    state = {"stopped": False, "found_early": False}
    eps = 1e-12

    need = float(n) - np.arange(n + 1)
    all_caps = space.cap.sum(axis=0)
    has_classes = bool((cls != np.arange(dn)).any())
    unused = np.ones(dn, dtype=bool)
    unused[space.sources] = False
    members = space.members
    masks = [sum(1 << int(x) for x in members[d]) for d in range(dn)]
    caps_of = space.cap if arr.group is None else np.array([space.cap[members[d]].sum(axis=0) for d in range(dn)])

    def explore(used: int, d: int, f: np.ndarray, seq: tuple[int, ...], caps_left: np.ndarray) -> None:
        budget.nodes += 1
        if f[n] < INF:
            c = f[n] + space.ret[d]
            if c < best["cost"] * (1 - eps):
                best["cost"], best["seq"] = c, seq
                if on_incumbent is not None:
                    on_incumbent(seq, reconstruct(space, seq), c)
                if c < stop_below:
                    state["found_early"] = True
                    state["stopped"] = True
                    return
        # The node budget applies once a plan is in hand; the time limit always.
        if (budget.nodes >= budget.max_nodes and best["seq"]) or (budget.nodes % 16 == 0 and budget.out_of_time()):
            state["stopped"] = True
            pending.append(float(np.min(f[1:n] + g[d, 1:n], initial=INF)))
            return
        free = np.flatnonzero(unused)
        if has_classes:
            # interchangeable devices are taken in index order: only a class's first unused member
            _, first = np.unique(cls[free], return_index=True)
            free = np.sort(free[first])
        children = []
        cut = best["cost"] * (1 - eps)
        if free.size:
            # A child's cost is at least min_a F[a] + transfer + H[d2, a] (its relaxed finish):
            # devices that cannot beat the incumbent skip the O(N²) extension.
            free = free[(f[None, :] + space.tr[d, free] + space.h[free]).min(axis=1) < cut]
        if free.size:
            f2s = space.extend_all(f, d, free)
            tots = f2s + g[free]
            keeps = tots < cut
            short = (caps_left[None, :] - space.cap[free]) < need[None, :]
            short[:, n] = False
            keeps &= ~short
            live = np.flatnonzero(keeps.any(axis=1))
            if live.size:
                d2s = free[live]
                bb = np.maximum(space.byte_bounds_without(unused, d2s) + space.stage_count_bound(unused)[None, :],
                                space.byte_bounds_without(unused, d2s, amortized=True) + space.amortized_rest(unused))
                tot = np.maximum(tots[live], f2s[live] + bb + space.outmin[d2s])
                keep_rows = keeps[live] & (tot < cut)
                lbs = np.where(keep_rows, tot, INF).min(axis=1)
                f2_rows = np.where(keep_rows, f2s[live], INF)
                for j in np.flatnonzero(lbs < INF):
                    d2 = int(d2s[j])
                    f2 = f2_rows[j]
                    key = (used | masks[d2], d2)
                    env = envelopes.get(key)
                    if env is not None:
                        if np.all(f2 >= env):
                            continue
                        envelopes[key] = np.minimum(env, f2)
                    else:
                        envelopes[key] = f2
                    children.append((float(lbs[j]), d2, f2))
        children.sort(key=lambda c: c[0])
        for i, (lb, d2, f2) in enumerate(children):
            if lb >= best["cost"] * (1 - eps):
                break
            if state["stopped"]:
                if not state["found_early"]:
                    pending.extend(c[0] for c in children[i:])
                return
            unused[members[d2]] = False
            explore(used | masks[d2], d2, f2, seq + (d2,), caps_left - caps_of[d2])
            unused[members[d2]] = True

    for v in space.sources[np.argsort(space.h[space.sources, 0], kind="stable")]:
        if state["stopped"]:
            if not state["found_early"]:
                pending.append(float(space.h[v, 0]))
            continue
        explore(masks[src], int(v), space.root(int(v)), (int(v),), all_caps - caps_of[src])
    complete = not state["stopped"]
    if complete:
        lower = best["cost"]
    elif state["found_early"]:
        lower = space.root_bound()
    else:
        lower = min([best["cost"], *pending])
        lower = max(lower, space.root_bound()) if lower < INF else lower
    seq = best["seq"]
    bounds = reconstruct(space, seq) if seq else ()
    return SearchResult(cost=best["cost"] if seq else INF, sequence=seq, boundaries=bounds,
                        lower_bound=lower, complete=complete, nodes=budget.nodes)


def reconstruct(space: SearchSpace, seq: tuple[int, ...]) -> tuple[int, ...]:
    """The optimal stage ends for a fixed device sequence (DP with back-pointers)."""
    arr = space.arr
    n = arr.n
    fs = [space.root(seq[0])]
    for d, d2 in zip(seq, seq[1:]):
        fs.append(space.extend(fs[-1], d, d2))
    ends = [n]
    e = n
    for j in range(len(seq) - 1, 0, -1):
        d_prev, d = seq[j - 1], seq[j]
        # find the previous end a with fs[j-1][a] + tr + stage(d, a, e) == fs[j][e]
        prev = fs[j - 1] + space.tr[d_prev, d] + arr.prefix[d, e] - arr.prefix[d]
        prev = np.where(space.valid[d, :, e], prev, INF)
        a = int(np.argmin(prev))
        ends.append(a)
        e = a
    return tuple(reversed(ends))

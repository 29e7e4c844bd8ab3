"""The branch and bound's completion bounds and batched extensions (core.planning.solvers.search)."""

import random

import msgspec
import numpy as np
import pytest

from core.errors import ModelDoesNotFit
from core.planning.problem import with_changes
from core.planning.scenarios import random_problem
from core.planning.solvers.arrays import build_arrays
from core.planning.solvers.search import SearchSpace
from tests.core.exhaustive import exhaustive_optimum


def _spaces(count: int):
    for seed in range(count):
        r = random.Random(seed)
        problem = random_problem(seed, r.randint(3, 6), r.randint(3, 10), tightness=r.uniform(1.0, 2.0),
                                 batch=r.choice([1, 2, 4]))
        arr = build_arrays(problem, problem.workload.batch_size, 1)
        if arr.devices and arr.devices[arr.src] == problem.source:
            yield problem, SearchSpace(arr)


@pytest.mark.parametrize("amortized", [False, True])
def test_a_byte_bound_without_one_device_equals_the_bound_computed_without_it(amortized):
    checked = 0
    for _, space in _spaces(40):
        dn = len(space.arr.devices)
        unused = np.ones(dn, dtype=bool)
        unused[space.arr.src] = False
        drops = np.flatnonzero(unused)
        rows = space.byte_bounds_without(unused, np.concatenate(([-1], drops)), amortized=amortized)
        assert np.array_equal(rows[0], space.byte_bounds_without(unused, np.array([-1]), amortized=amortized)[0])
        for row, d in zip(rows[1:], drops):
            without = unused.copy()
            without[d] = False
            direct = space.byte_bounds_without(without, np.array([-1]), amortized=amortized)[0]
            assert np.allclose(row, direct, rtol=1e-9, atol=1e-15) and np.array_equal(np.isinf(row), np.isinf(direct))
            checked += 1
    assert checked >= 60


def test_the_completion_bounds_at_the_root_never_exceed_the_optimum():
    """Stage-count and amortized byte bounds (compute + one hand-over per stage) are lower bounds."""
    checked = tight = 0
    for problem, space in _spaces(60):
        best, plan = exhaustive_optimum(problem, "latency")
        if plan is None:
            continue
        n, src = space.arr.n, space.arr.src
        unused = np.ones(len(space.arr.devices), dtype=bool)
        unused[src] = False
        f = space.root()
        first = f + space.outmin[src]
        counted = first + space.byte_bound(unused) + space.stage_count_bound(unused)
        amortized = first + space.byte_bounds_without(unused, np.array([-1]), amortized=True)[0] \
            + space.amortized_rest(unused)
        for bound in (counted, amortized):
            assert float(np.min(bound[1:n])) <= best * (1 + 1e-9)
        tight += float(np.min(amortized[1:n])) > float(np.min((first + space.byte_bound(unused))[1:n])) * (1 + 1e-9)
        checked += 1
    assert checked >= 20 and tight >= 5  # the amortized bound is often stronger, never wrong


def test_extending_rows_equals_extending_each_prefix_alone():
    for _, space in _spaces(30):
        arr = space.arr
        others = [d for d in range(len(arr.devices)) if d != arr.src]
        if len(others) < 2:
            continue
        root = space.root()
        first = others[0]
        rest = np.array(others[1:])
        fs = space.extend_all(root, arr.src, rest)
        for d2 in others[1:]:
            batched = space.extend_rows(fs, rest, d2)
            for row, prev, f in zip(batched, rest, fs):
                assert np.array_equal(row, space.extend(f, int(prev), d2))
        assert np.array_equal(space.extend_rows(root[None, :], np.array([arr.src]), first)[0],
                              space.extend(root, arr.src, first))


def test_a_replan_warm_start_is_the_cheapest_repair_of_the_previous_plan():
    from core.planning.solvers import solve_min_latency
    from core.planning.solvers.exact import warm_sequence
    from core.planning.solvers.search import reconstruct

    checked = 0
    for problem, _ in _spaces(40):
        try:
            previous = solve_min_latency(problem).plan
        except ModelDoesNotFit:
            continue
        failed = previous.stages[-1].device
        if failed == problem.source:
            continue
        reduced = with_changes(problem, excluded_devices=(failed,))
        arr = build_arrays(reduced, reduced.workload.batch_size, 1)
        space = SearchSpace(arr)
        warm = warm_sequence(space, previous)
        if warm is None:
            continue
        seq, ends, cost = warm
        # every repair the warm start considers, costed one by one
        index = {d: i for i, d in enumerate(arr.devices)}
        kept = tuple(index[s.device] for s in previous.stages if s.device in index)
        spare = [d for d in range(len(arr.devices)) if d not in kept]
        tries = [kept] + [kept[:len(kept)] + (c,) for c in spare]
        costs = []
        for t in tries:
            f = space.root()
            for d, d2 in zip(t, t[1:]):
                f = space.extend(f, d, d2)
            costs.append(float(f[arr.n] + space.ret[t[-1]]))
        assert cost == min(costs) and seq == tries[costs.index(cost)]
        assert ends == reconstruct(space, seq)
        checked += 1
    assert checked >= 5


def test_a_clean_profile_is_remembered_and_a_broken_one_still_reported():
    from core.devices.profile import profile_errors

    problem = random_problem(1, 3, 4)
    assert profile_errors(problem.profile) == [] and profile_errors(problem.profile) == []
    units = list(problem.profile.model.units)
    units[0] = msgspec.structs.replace(units[0], index=7)
    broken = msgspec.structs.replace(problem.profile,
                                     model=msgspec.structs.replace(problem.profile.model, units=tuple(units)))
    assert profile_errors(broken) and profile_errors(broken)

import math
import random

import msgspec
import pytest

from core.planning.cost import evaluate, validate
from core.errors import ModelDoesNotFit
from core.models.units import model_spec_from_config
from core.planning.problem import Workload
from core.reporting import RecordingReporter
from core.planning.scenarios import DeviceSpec, legacy_paper_problem, random_problem, synthetic_problem
from core.planning.solvers import (
    STRATEGIES,
    cloud_edge_even,
    edge_solo,
    even_split,
    memory_proportional,
    micro_batch_choices,
    solve_max_throughput,
    solve_min_latency,
)
from tests.core.exhaustive import exhaustive_optimum

SOLVERS = {"latency": solve_min_latency, "throughput": solve_max_throughput}


def _instance(seed: int):
    r = random.Random(seed)
    return random_problem(
        seed, r.randint(2, 6), r.randint(3, 12), tightness=r.uniform(1.0, 2.5), batch=r.choice([1, 2, 3, 4]),
        latency=r.random() < 0.7, kv=r.random() < 0.8,
    )


def _solve_or_none(problem, objective):
    try:
        return SOLVERS[objective](problem)
    except ModelDoesNotFit:
        return None


def _assert_matches_enumeration(problem, objective):
    best, best_plan = exhaustive_optimum(problem, objective)
    res = _solve_or_none(problem, objective)
    if best_plan is None:
        assert res is None, f"solver found {res.plan} where nothing fits"
        return None
    assert res is not None, f"solver says nothing fits, enumeration found {best_plan}"
    assert res.proven_optimal and res.gap == 0.0
    assert validate(problem, res.plan) == []
    assert res.value == pytest.approx(best, rel=1e-9)
    return res


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_exact_solver_equals_exhaustive_enumeration_on_random_small_instances(objective):
    feasible = 0
    for seed in range(90):
        if _assert_matches_enumeration(_instance(seed), objective) is not None:
            feasible += 1
    assert feasible >= 50  # the set is not dominated by infeasible instances


def _paper_algorithm_1(problem):
    """The paper's per-layer DP over (layer, device), latency objective.

    Memory is tracked along the chosen predecessor's current run on a device only, so
    non-adjacent runs may reuse a device and their memory is never added up.
    Returns the per-unit device assignment.
    """
    model = problem.profile.model
    devs = [d for d in problem.profile.cluster.device_ids() if d not in problem.excluded_devices]
    links = problem.profile.cluster.link_index()
    m = problem.workload.batch_size
    n = model.num_units
    budget = {d: problem.profile.cluster.device(d).memory_bytes for d in devs}

    def unit_mem(u):
        unit = model.units[u]
        return unit.param_bytes + unit.kv_bytes_per_token * m * problem.workload.context_tokens

    def comm(a, b, u):
        if a == b:
            return 0.0
        link = links.get((a, b))
        return math.inf if link is None else link.transfer_s(model.units[u].activation_bytes_per_token * m)

    dp = [{d: (math.inf, None, 0) for d in devs} for _ in range(n)]
    dp[0][problem.source] = (problem.profile.times_of(problem.source).decode_time(0, m), None, unit_mem(0))
    for u in range(1, n):
        for d in devs:
            best = (math.inf, None, 0)
            for k in devs:
                cost, _, used = dp[u - 1][k]
                run = (used if k == d else 0) + unit_mem(u)
                if run > budget[d]:
                    continue
                c = cost + comm(k, d, u - 1) + problem.profile.times_of(d).decode_time(u, m)
                if c < best[0]:
                    best = (c, k, run)
            dp[u][d] = best
    end = min(devs, key=lambda d: dp[n - 1][d][0] + comm(d, problem.source, n - 1))
    if dp[n - 1][end][0] == math.inf:
        return None
    assign = [end]
    for u in range(n - 1, 0, -1):
        assign.append(dp[u][assign[-1]][1])
    return assign[::-1]


def test_instances_include_ones_where_the_per_layer_dp_breaks_the_rules_and_the_solver_stays_exact():
    reused = overfilled = 0
    for seed in range(300, 420):
        problem = _instance(seed)
        assign = _paper_algorithm_1(problem)
        if assign is None:
            continue
        runs = [d for i, d in enumerate(assign) if i == 0 or assign[i - 1] != d]
        if len(runs) == len(set(runs)):
            continue
        reused += 1
        units, wl = problem.profile.model.units, problem.workload
        held: dict[str, int] = {}
        for u, d in enumerate(assign):
            held[d] = held.get(d, 0) + units[u].param_bytes + units[u].kv_bytes_per_token * wl.batch_size * wl.context_tokens
        if any(b > problem.profile.cluster.device(d).memory_bytes for d, b in held.items()):
            overfilled += 1
        _assert_matches_enumeration(problem, "latency")
    assert reused >= 3 and overfilled >= 1


def _tiny_llama(layers=6):
    return model_spec_from_config({
        "model_type": "llama", "hidden_size": 256, "num_hidden_layers": layers, "num_attention_heads": 4,
        "intermediate_size": 512, "vocab_size": 1000,
    }, "fp32", "tiny-llama")


def test_interchangeable_devices_are_searched_once_without_losing_the_optimum():
    model = _tiny_llama()
    mem = model.param_bytes / 2**30 / 2.5
    devices = [DeviceSpec(id=f"same-{i}", tflops=1, memory_bandwidth_gb_s=10, memory_gib=mem) for i in range(5)]
    devices.append(DeviceSpec(id="fast", tflops=4, memory_bandwidth_gb_s=40, memory_gib=mem / 2))
    problem = synthetic_problem(devices, model, bandwidth_mbit_s=20, workload=Workload(prompt_tokens=8, generated_tokens=8, batch_size=2))
    for objective in ("latency", "throughput"):
        assert _assert_matches_enumeration(problem, objective) is not None


def test_excluded_devices_are_never_used():
    problem = legacy_paper_problem("llama-2-70b")
    excluded = ("agx-01", "agx-02", "agx-03")
    restricted = msgspec.structs.replace(problem, excluded_devices=excluded)
    res = solve_min_latency(restricted)
    assert not set(res.plan.devices()) & set(excluded)
    assert res.value >= solve_min_latency(problem).value - 1e-12


def test_a_model_that_fits_nowhere_says_how_much_memory_is_missing():
    problem = legacy_paper_problem("llama-2-70b")
    only_source = msgspec.structs.replace(problem, excluded_devices=tuple(d for d in problem.profile.cluster.device_ids() if d != "agx-00"))
    with pytest.raises(ModelDoesNotFit, match="GiB missing") as info:
        solve_min_latency(only_source)
    needed = sum(u.param_bytes for u in problem.profile.model.units)
    budget = problem.profile.cluster.device("agx-00").memory_bytes * 0.9
    assert info.value.missing_bytes >= needed - budget
    with pytest.raises(ModelDoesNotFit):
        solve_max_throughput(only_source)


def test_a_cut_short_search_returns_a_valid_plan_with_a_proven_bound():
    rng = random.Random(1)
    devs = [DeviceSpec(id=f"dev-{i:02d}", tflops=rng.uniform(5, 60), memory_bandwidth_gb_s=rng.uniform(50, 400),
                       memory_gib=rng.choice([8, 16, 32, 64])) for i in range(15)]
    problem = legacy_paper_problem("llama-2-70b", devices=devs)
    exact = solve_min_latency(problem)
    cut = solve_min_latency(problem, max_nodes=3)
    assert exact.proven_optimal
    assert validate(problem, cut.plan) == []
    assert not cut.proven_optimal
    assert cut.bound <= exact.value + 1e-12 <= cut.value + 2e-12
    assert cut.gap == pytest.approx((cut.value - cut.bound) / cut.value)


def test_throughput_chooses_micro_batching_within_the_batch_and_memory():
    problem = legacy_paper_problem("llama-2-70b", workload=Workload(prompt_tokens=128, generated_tokens=128, batch_size=8))
    res = solve_max_throughput(problem)
    assert res.proven_optimal
    plan = res.plan
    assert plan.micro_batch_size * plan.micro_batches <= 8
    assert res.cost.feasible
    # every other (m, K) on the same stages is no better
    for m, k in micro_batch_choices(problem):
        other = evaluate(problem, msgspec.structs.replace(plan, micro_batch_size=m, micro_batches=k))
        if other.feasible:
            assert other.throughput_tokens_s <= res.value * (1 + 1e-9)


def test_a_workload_that_fixes_the_micro_batching_is_respected():
    wl = Workload(prompt_tokens=16, generated_tokens=16, batch_size=4, micro_batch_size=1, micro_batches=3)
    problem = msgspec.structs.replace(_instance(7), workload=wl)
    assert micro_batch_choices(problem) == [(1, 3)]
    res = _solve_or_none(problem, "throughput")
    best, plan = exhaustive_optimum(problem, "throughput")
    if plan is None:
        assert res is None
    else:
        assert (res.plan.micro_batch_size, res.plan.micro_batches) == (1, 3)
        assert res.value == pytest.approx(best, rel=1e-9)


def test_solver_reports_progress_and_improving_plans_to_its_reporter():
    rep = RecordingReporter()
    res = solve_min_latency(legacy_paper_problem("llama-2-70b"), reporter=rep)
    assert rep.statuses and rep.progresses[-1] == (1, 1)
    assert rep.partials and rep.partials[-1] == res.plan
    rep = RecordingReporter()
    res = solve_max_throughput(legacy_paper_problem("llama-2-13b"), reporter=rep)
    assert rep.partials[-1] == res.plan


def test_baselines_return_plans_in_their_shape():
    problem = legacy_paper_problem("llama-2-13b")
    n = problem.profile.model.num_units
    assert [(s.device, s.start, s.end) for s in edge_solo(problem).stages] == [("agx-00", 0, n)]
    ce = cloud_edge_even(problem)
    assert ce.devices() == ("agx-00", "server") and ce.stages[0].end == n // 2
    ev = even_split(problem, ["agx-00", "agx-01", "agx-02"])
    assert [s.num_units for s in ev.stages] == [14, 14, 14]
    mp = memory_proportional(problem, ["agx-00", "nx-00"])
    assert mp.stages[0].num_units == round(n * 32 / 48)
    for plan in (ce, ev, mp):
        assert plan.stages[0].device == problem.source


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_the_optimum_is_never_worse_than_any_feasible_baseline(objective):
    for seed in range(20, 40):
        problem = _instance(seed)
        res = _solve_or_none(problem, objective)
        for name, strategy in STRATEGIES.items():
            try:
                plan = strategy(problem, objective)
            except ModelDoesNotFit:
                continue
            cost = evaluate(problem, plan)
            if not cost.feasible:
                continue
            assert res is not None, name
            if objective == "latency":
                assert res.value <= cost.latency_per_token_s * (1 + 1e-9), name
            else:
                assert res.value >= cost.throughput_tokens_s * (1 - 1e-9), name


def _heterogeneous(n=15, seed=1):
    rng = random.Random(seed)
    return [DeviceSpec(id=f"dev-{i:02d}", tflops=rng.uniform(5, 60), memory_bandwidth_gb_s=rng.uniform(50, 400),
                       memory_gib=rng.choice([8, 16, 32, 64])) for i in range(n)]


def test_a_cut_short_throughput_search_keeps_a_valid_plan_and_an_upper_bound():
    problem = legacy_paper_problem("llama-2-70b", devices=_heterogeneous())
    exact = solve_max_throughput(problem)
    cut = solve_max_throughput(problem, max_nodes=3)
    assert exact.proven_optimal
    assert validate(problem, cut.plan) == []
    assert not cut.proven_optimal
    assert cut.value <= exact.value * (1 + 1e-9) <= cut.bound * (1 + 1e-9)
    assert cut.lower_bound == pytest.approx(1 / cut.bound)


def test_a_solver_stops_when_its_reporter_asks():
    from core.reporting import Cancelled

    rep = RecordingReporter()
    rep.cancel()
    problem = legacy_paper_problem("llama-2-70b", devices=_heterogeneous())
    with pytest.raises(Cancelled):
        solve_min_latency(problem, reporter=rep)
    with pytest.raises(Cancelled):
        solve_max_throughput(problem, reporter=rep)


def _with_clones(problem, rng):
    """Copies of some devices (same times, memory and links both ways): symmetric instances."""
    from core.devices.cluster import Cluster, Device, Link

    cl = problem.profile.cluster
    devs, links, times = list(cl.devices), list(cl.links), list(problem.profile.times)
    others = [d for d in devs if d.id != problem.source]
    for d in rng.sample(others, min(len(others), 2)):
        for c in range(rng.randint(1, 2)):
            nid = f"{d.id}c{c}"
            devs.append(Device(id=nid, memory_bytes=d.memory_bytes))
            times.append(msgspec.structs.replace(problem.profile.times_of(d.id), device=nid))
            links += [msgspec.structs.replace(l, src=nid) for l in cl.links if l.src == d.id]
            links += [msgspec.structs.replace(l, dst=nid) for l in cl.links if l.dst == d.id]
            links += [Link(src=d.id, dst=nid, bandwidth_mbit_s=50, latency_ms=1), Link(src=nid, dst=d.id, bandwidth_mbit_s=50, latency_ms=1)]
    profile = msgspec.structs.replace(problem.profile, cluster=Cluster(devices=tuple(devs), links=tuple(links)), times=tuple(times))
    return msgspec.structs.replace(problem, profile=profile)


def test_exact_solvers_equal_enumeration_on_instances_with_cloned_devices_and_exclusions():
    from core.planning.solvers.arrays import build_arrays

    symmetric = 0
    for seed in range(25):
        rng = random.Random(seed)
        problem = _with_clones(random_problem(seed, rng.randint(2, 4), rng.randint(3, 9), tightness=rng.uniform(1.0, 2.5),
                                              batch=rng.choice([1, 2, 4])), rng)
        if seed % 3 == 0:
            problem = msgspec.structs.replace(problem, excluded_devices=(problem.profile.cluster.device_ids()[-1],))
        arr = build_arrays(problem, 1, 1)
        symmetric += bool((arr.symmetry_classes != range(len(arr.devices))).any())
        for objective in ("latency", "throughput"):
            _assert_matches_enumeration(problem, objective)
    assert symmetric >= 15


def _with_stage_overheads(problem, seed: int):
    """Give every device a once-per-stage overhead (as measured profiles carry)."""
    r = random.Random(seed)
    times = tuple(
        msgspec.structs.replace(t, stage_decode_overhead_s=r.choice([0.0, 1e-4, 2e-3, 1e-2]),
                                stage_prefill_overhead_s=r.uniform(0, 1e-2))
        for t in problem.profile.times
    )
    return msgspec.structs.replace(problem, profile=msgspec.structs.replace(problem.profile, times=times))


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_exact_solvers_equal_enumeration_when_devices_have_a_once_per_stage_overhead(objective):
    feasible = 0
    for seed in range(60):
        if _assert_matches_enumeration(_with_stage_overheads(_instance(seed), seed), objective) is not None:
            feasible += 1
    assert feasible >= 30


def _with_batch_discounts(problem, seed: int):
    """Make some units faster per micro-batch at a larger batch than at batch 1 (measured
    profiles are noisy): the pairs' costs no longer grow with m."""
    r = random.Random(seed)
    times = []
    for t in problem.profile.times:
        rows = tuple(tuple(v * (r.choice([0.3, 1.0]) if i else 1.0) for i, v in enumerate(row)) for row in t.decode_s)
        times.append(msgspec.structs.replace(t, decode_s=rows))
    return msgspec.structs.replace(problem, profile=msgspec.structs.replace(problem.profile, times=tuple(times)))


def test_throughput_equals_enumeration_when_a_larger_micro_batch_is_cheaper_per_unit():
    """The shared relaxed bound (the loosest (m, K)'s) is only used for pairs that cost at least as
    much; where a profile says a larger batch is faster, each pair gets its own."""
    from core.planning.solvers.arrays import build_arrays
    from core.planning.solvers.exact import _costs_at_least

    feasible = discounted = 0
    for seed in range(60):
        problem = _with_batch_discounts(_instance(seed), seed)
        arrs = [build_arrays(problem, m, k) for m, k in micro_batch_choices(problem)]
        base = min(arrs, key=lambda a: (a.m * a.k, a.m))
        discounted += any(not _costs_at_least(base, a) for a in arrs if a.m > base.m)
        if _assert_matches_enumeration(problem, "throughput") is not None:
            feasible += 1
    assert feasible >= 30 and discounted >= 10


def test_decode_times_of_all_units_equal_the_profiles_rule_unit_by_unit():
    from core.planning.solvers.arrays import decode_times

    problem = legacy_paper_problem("llama-2-7b")
    n = problem.profile.model.num_units
    for t in problem.profile.times[:3]:
        for batch in (0.5, *t.decode_batch_sizes, 3, 1000):
            assert decode_times(t, batch, n).tolist() == [t.decode_time(u, batch) for u in range(n)]

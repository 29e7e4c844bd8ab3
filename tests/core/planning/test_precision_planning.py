"""The exact solvers' precision dimension: layer ranges and a weight precision per device under a
quality bound, checked against brute force (every device sequence, every split, every precision per
stage, each plan costed by core.planning.cost.evaluate, the documented model)."""

import itertools
import math
import random

import msgspec
import pytest

from core.errors import FormatError, ModelDoesNotFit
from core.models.weight_quality import PrecisionQuality
from core.planning.cost import evaluate
from core.planning.plan import ShardPlan, Stage
from core.planning.precision import allowed_precisions, quality_problems
from core.planning.problem import check_problem, with_changes
from core.planning.scenarios import random_problem
from core.planning.solvers import solve_max_throughput, solve_min_latency
from core.planning.solvers.exact import micro_batch_choices

QUALITY = (PrecisionQuality(weights="fp", perplexity=10.0),
           PrecisionQuality(weights="int8", perplexity=10.1, decode_time_ratio=0.9, prefill_time_ratio=1.1),
           PrecisionQuality(weights="int4", perplexity=10.8, decode_time_ratio=1.6, prefill_time_ratio=1.4))
"""int8 +1 % perplexity and faster decode, int4 +8 % and slower: neither dominates."""


def _quantizable(problem, quality=QUALITY, bound=0.1):
    """``problem`` with blocks whose Linears hold 90 % of their weights, a measured quality per precision
    and a quality bound."""
    model = problem.profile.model
    units = tuple(msgspec.structs.replace(u, linear_params=int(u.param_bytes * 0.45), linear_rows=4096)
                  if u.kind == "decoder_block" else u for u in model.units)
    model = msgspec.structs.replace(model, units=units, hidden_size=4096)
    profile = msgspec.structs.replace(problem.profile, model=model, weight_quality=quality)
    return msgspec.structs.replace(problem, profile=profile, max_perplexity_increase=bound)


def _instance(seed: int):
    r = random.Random(seed)
    p = random_problem(seed, r.randint(2, 3), r.randint(3, 6), tightness=r.uniform(0.6, 1.4),
                       batch=r.choice([1, 2]), latency=r.random() < 0.7)
    return _quantizable(p, bound=r.choice([0.0, 0.02, 0.1]))


def _brute_force(problem, objective):
    """Best value over every plan (devices, split, precision per stage, micro-batching) that evaluate
    finds free of violations: min latency or max throughput; None when none is."""
    ids = [d for d in problem.profile.cluster.device_ids() if d != problem.source]
    n = problem.profile.model.num_units
    combos = [(problem.workload.batch_size, 1)] if objective == "latency" else micro_batch_choices(problem)
    best = None
    for k in range(1, len(ids) + 2):
        for rest in itertools.permutations(ids, k - 1):
            seq = (problem.source, *rest)
            for cut in itertools.combinations(range(1, n), k - 1):
                edges = (0, *cut, n)
                for ws in itertools.product(("fp", "int8", "int4"), repeat=k):
                    stages = tuple(Stage(device=d, start=a, end=e, weights=w)
                                   for d, a, e, w in zip(seq, edges, edges[1:], ws))
                    for m, kk in combos:
                        plan = ShardPlan(model=problem.profile.model.name, num_units=n, stages=stages,
                                         micro_batch_size=m, micro_batches=kk)
                        cost = evaluate(problem, plan)
                        if not cost.feasible:
                            continue
                        v = cost.latency_per_token_s if objective == "latency" else cost.throughput_tokens_s
                        if best is None or (v < best if objective == "latency" else v > best):
                            best = v
    return best


def solved_as_brute_force(problems, objective):
    """The exact solver's answer to each of ``problems`` (None where nothing fits), each held to brute force."""
    solve = solve_min_latency if objective == "latency" else solve_max_throughput
    out = []
    for i, problem in enumerate(problems):
        best = _brute_force(problem, objective)
        try:
            res = solve(problem)
        except ModelDoesNotFit:
            assert best is None, f"instance {i}: the solver found nothing, brute force {best}"
            out.append(None)
            continue
        assert best is not None and res.proven_optimal
        assert evaluate(problem, res.plan).feasible
        assert res.value == pytest.approx(best, rel=1e-9), f"instance {i}"
        out.append(res)
    return out


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_the_exact_solvers_choose_ranges_and_precisions_as_well_as_brute_force(objective):
    found = [r for r in solved_as_brute_force([_instance(seed) for seed in range(20)], objective) if r is not None]
    quantized = sum(any(s.weights != "fp" for s in r.plan.stages) for r in found)
    assert len(found) >= 8 and quantized >= 3  # the instances exercise the precision choice


def test_a_model_that_fits_only_at_four_bits_is_planned_with_a_precision_per_device_within_a_loose_bound():
    problem = _quantizable(random_problem(0, 2, 5, tightness=0.7), bound=0.1)
    with pytest.raises(ModelDoesNotFit):
        solve_min_latency(with_changes(problem, max_perplexity_increase=None))
    plan = solve_min_latency(problem).plan
    assert [s.weights for s in plan.stages] == ["int4", "int8"]  # the faster int8 where it fits
    with pytest.raises(ModelDoesNotFit):  # a bound int4 breaks leaves nothing that fits
        solve_min_latency(with_changes(problem, max_perplexity_increase=0.05))


def test_the_bound_admits_exactly_the_precisions_whose_measured_perplexity_is_within_it():
    problem = _instance(0)
    assert allowed_precisions(with_changes(problem, max_perplexity_increase=None)) == ("fp",)
    assert allowed_precisions(with_changes(problem, max_perplexity_increase=0.0)) == ("fp",)
    assert allowed_precisions(with_changes(problem, max_perplexity_increase=0.01)) == ("fp", "int8")
    assert allowed_precisions(with_changes(problem, max_perplexity_increase=0.08)) == ("fp", "int8", "int4")


def test_a_stage_over_the_bound_is_a_violation_that_names_its_perplexity_rise():
    problem = with_changes(_instance(1), max_perplexity_increase=0.02)
    n = problem.profile.model.num_units
    plan = ShardPlan(model="m", num_units=n, stages=(Stage(device=problem.source, start=0, end=n, weights="int4"),))
    assert quality_problems(problem, plan) == [
        f"stage 0 ({problem.source}) holds int4 weights: it raises perplexity by 8.00 %, over the bound of 2.00 %"]
    assert any("raises perplexity" in v for v in evaluate(problem, plan).violations)


def test_a_quality_bound_without_measured_perplexities_is_refused_by_name():
    problem = _quantizable(random_problem(1, 2, 4), quality=())
    with pytest.raises(FormatError, match="no perplexity per weight precision"):
        check_problem(problem)


def test_quantized_stages_cost_their_measured_time_ratio_on_blocks_only():
    problem = _instance(2)
    n = problem.profile.model.num_units
    times = problem.profile.times_of(problem.source)
    for w, r in (("fp", 1.0), ("int8", 0.9), ("int4", 1.6)):
        plan = ShardPlan(model="m", num_units=n, stages=(Stage(device=problem.source, start=0, end=n, weights=w),))
        blocks = sum(times.decode_time(u, 1) for u in range(1, n - 1))
        ends = times.decode_time(0, 1) + times.decode_time(n - 1, 1)
        want = ends + r * blocks + times.stage_overhead_time("decode", 0, n)
        got = evaluate(with_changes(problem, workload=msgspec.structs.replace(problem.workload, batch_size=1)),
                       plan).stage_compute_s[0]
        assert math.isclose(got, want, rel_tol=1e-12)

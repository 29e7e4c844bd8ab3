"""Re-planning after a device fails: warm-started from the previous plan, same optimum as a cold solve."""

import random

import pytest

from core.errors import ModelDoesNotFit, PlanInvalid
from core.planning.cost import validate
from core.planning.problem import with_changes
from core.planning.scenarios import DeviceSpec, legacy_paper_problem, random_problem
from core.planning.solvers import replan_after_failure, solve_max_throughput, solve_min_latency
from tests.core.exhaustive import exhaustive_optimum

SOLVERS = {"latency": solve_min_latency, "throughput": solve_max_throughput}


def _hetero(n: int, seed: int = 3):
    rng = random.Random(seed)
    return [DeviceSpec(id=f"dev-{i:02d}", tflops=rng.uniform(5, 60), memory_bandwidth_gb_s=rng.uniform(50, 400),
                       memory_gib=rng.choice([8, 16, 32, 64])) for i in range(n)]


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_a_replan_equals_exhaustive_enumeration_without_the_failed_device(objective):
    checked = 0
    for seed in range(60):
        r = random.Random(seed)
        problem = random_problem(seed, r.randint(3, 6), r.randint(3, 10), tightness=r.uniform(1.0, 2.0),
                                 batch=r.choice([1, 2, 4]))
        try:
            previous = SOLVERS[objective](problem).plan
        except ModelDoesNotFit:
            continue
        for stage in previous.stages[1:]:
            reduced = with_changes(problem, excluded_devices=(*problem.excluded_devices, stage.device))
            best, best_plan = exhaustive_optimum(reduced, objective)
            if best_plan is None:
                with pytest.raises(ModelDoesNotFit):
                    replan_after_failure(problem, previous, stage.device)
                continue
            res = replan_after_failure(problem, previous, stage.device)
            assert res.proven_optimal and res.value == pytest.approx(best, rel=1e-9)
            assert stage.device not in {s.device for s in res.plan.stages}
            assert validate(reduced, res.plan) == []
            checked += 1
    assert checked >= 20


def test_a_replan_finds_a_device_to_take_over_a_stage_the_others_cannot_hold():
    problem = legacy_paper_problem("llama-2-70b", devices=_hetero(24))
    previous = solve_min_latency(problem).plan
    failed = max(previous.stages[1:], key=lambda s: s.end - s.start).device
    res = replan_after_failure(problem, previous, failed)
    cold = solve_min_latency(with_changes(problem, excluded_devices=(failed,)))
    assert res.proven_optimal and res.value == pytest.approx(cold.value, rel=1e-9)
    assert failed not in {s.device for s in res.plan.stages}


def test_a_replan_cut_short_still_returns_a_valid_plan_and_a_proven_bound():
    problem = legacy_paper_problem("llama-2-70b", devices=_hetero(40))
    previous = solve_max_throughput(problem, time_limit_s=5).plan
    failed = previous.stages[1].device
    res = replan_after_failure(problem, previous, failed, time_limit_s=0.05)
    assert failed not in {s.device for s in res.plan.stages}
    assert validate(with_changes(problem, excluded_devices=(failed,)), res.plan) == []
    assert res.bound >= res.value and 0.0 <= res.gap < 1.0


def test_losing_the_source_is_a_clear_error_naming_what_to_do():
    problem = legacy_paper_problem("llama-2-7b")
    previous = solve_min_latency(problem).plan
    with pytest.raises(PlanInvalid, match="choose another source"):
        replan_after_failure(problem, previous, problem.source)


def test_a_failed_device_unknown_to_the_cluster_is_a_clear_error():
    problem = legacy_paper_problem("llama-2-7b")
    previous = solve_min_latency(problem).plan
    with pytest.raises(PlanInvalid, match="not a device of the cluster"):
        replan_after_failure(problem, previous, "no-such-device")

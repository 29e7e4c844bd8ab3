"""Compare's baselines on a profile with GPUs compute on every GPU the profile has (as exo and
llama.cpp RPC do), their rules reading the GPU's times and memory: each equals the same baseline on the
problem rebuilt by hand with those GPU figures (test_gpu_placement.by_hand), and the exact solver, which
also chooses CPU or GPU per device, is never worse than any of them."""

from __future__ import annotations

import math

import msgspec
import pytest

from core.planning.cost import evaluate
from core.planning.scenarios import random_problem
from core.planning.solvers import STRATEGIES
from core.planning.solvers.comparison import compare, run_strategy
from tests.core.planning.test_gpu_placement import by_hand, with_gpus

BASELINES = sorted(n for n in STRATEGIES if n != "edgeshard")


@pytest.fixture(scope="module")
def problem():
    """Four devices; three have a GPU 4x their CPU's speed, of unequal memory."""
    base = random_problem(3, devices=4, units=8, tightness=3.0)
    total = base.profile.model.param_bytes
    ids = base.profile.cluster.device_ids()
    return with_gpus(base, {ids[0]: (0.25, total), ids[1]: (0.25, total // 2), ids[2]: (0.25, total // 4)})


@pytest.mark.parametrize("objective", ["latency", "throughput"])
@pytest.mark.parametrize("name", BASELINES)
def test_a_baseline_computes_on_every_profiled_gpu_with_the_gpus_figures(problem, name, objective):
    gpus = {a.device for a in problem.profile.accelerator_times}
    plan = STRATEGIES[name](problem, objective)
    reference = STRATEGIES[name](by_hand(problem, gpus), objective)
    assert [(s.device, s.start, s.end) for s in plan.stages] == [(s.device, s.start, s.end) for s in reference.stages]
    assert [s.torch_device for s in plan.stages] == ["cuda:0" if s.device in gpus else "cpu" for s in plan.stages]
    got, ref = evaluate(problem, plan), evaluate(by_hand(problem, gpus), reference)
    assert math.isclose(got.latency_per_token_s, ref.latency_per_token_s, rel_tol=1e-12)
    assert got.violations == ref.violations


def test_memory_proportional_splits_by_the_gpus_memory(problem):
    ids = problem.profile.cluster.device_ids()
    no_cpu = msgspec.structs.replace(problem, excluded_devices=(ids[3],))
    plan = STRATEGIES["memory-proportional"](no_cpu, "latency")
    sizes = [s.end - s.start for s in plan.stages]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]  # GPU memory 1 : 1/2 : 1/4


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_the_exact_solver_is_never_worse_than_a_gpu_aware_baseline(problem, objective):
    outs = compare(problem, objective, time_limit_s=20)
    best = outs[0]
    assert best.strategy == "edgeshard" and best.status == "optimal"
    for o in outs[1:]:
        if o.status in ("ok", "optimal"):
            if objective == "latency":
                assert best.cost.latency_per_token_s <= o.cost.latency_per_token_s * (1 + 1e-9), o.strategy
            else:
                assert best.cost.throughput_tokens_s >= o.cost.throughput_tokens_s * (1 - 1e-9), o.strategy


def test_compare_with_an_explicit_device_set_puts_its_split_on_the_gpus_too(problem):
    ids = list(problem.profile.cluster.device_ids())
    out = run_strategy(problem, "even", "latency", devices=ids[:2])
    assert [s.torch_device for s in out.plan.stages] == ["cuda:0", "cuda:0"]

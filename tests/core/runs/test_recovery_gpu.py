"""A re-plan after a lost device keeps each surviving GPU stage on its GPU, planned with that GPU's
times and memory (the reference: the exact solver on the problem rebuilt by hand with those devices'
GPU figures, the lost device excluded)."""

from __future__ import annotations

import math

import msgspec
import pytest

from core.planning.cost import evaluate
from core.planning.scenarios import random_problem
from core.planning.solvers import edgeshard_optimal, solve_min_latency
from core.runs.recovery import ExactReplanner
from tests.core.planning.test_gpu_placement import by_hand, with_gpus


@pytest.mark.parametrize("gpu_share", [0.3, 0.6])
def test_a_replanned_run_keeps_its_surviving_gpu_stages_on_their_gpu(gpu_share):
    """GPUs 5x their CPU's speed holding ``gpu_share`` of the model's weights: at 0.3 the plan has two GPU
    stages and a CPU one, at 0.6 three GPU stages; the last stage's device is lost."""
    base = random_problem(3, devices=4, units=8, tightness=3.0)
    memory = int(base.profile.model.param_bytes * gpu_share)
    problem = with_gpus(base, {d: (0.2, memory) for d in base.profile.cluster.device_ids()})
    plan = edgeshard_optimal(problem)
    gpu_stages = [s.device for s in plan.stages if s.torch_device != "cpu"]
    failed = plan.stages[-1].device
    assert len(gpu_stages) >= 2 and len(plan.stages) == 3  # the case this test is about
    replanned = ExactReplanner(problem)(plan, failed, tuple(problem.profile.cluster.device_ids()))
    on_gpu = set(gpu_stages) - {failed}
    assert failed not in replanned.devices()
    assert {s.device for s in replanned.stages if s.torch_device == "cuda:0"} == on_gpu & set(replanned.devices())
    reference = by_hand(msgspec.structs.replace(problem, excluded_devices=(failed,)), on_gpu)
    best = evaluate(reference, solve_min_latency(reference).plan)
    got = evaluate(problem, replanned)
    assert got.feasible
    assert math.isclose(got.latency_per_token_s, best.latency_per_token_s, rel_tol=1e-9)
    assert math.isclose(got.prefill_s, best.prefill_s, rel_tol=1e-9)

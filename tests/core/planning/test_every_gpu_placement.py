"""A device with several GPUs in its profile (one ``AcceleratorTimes`` per ``cuda:N``): the exact planner
chooses its CPU or any one of its GPUs, equal to exhaustive enumeration over every layout and every
such choice (each variant of the problem built here by hand); the plan editor's edit and check of a
stage's GPU are pure functions beside it."""

from __future__ import annotations

import itertools
import random

import msgspec
import pytest

from core.devices.profile import AcceleratorTimes
from core.planning.scenarios import random_problem
from core.planning.solvers import edgeshard_optimal
from tests.core.exhaustive import exhaustive_optimum
from tests.core.planning.test_gpu_placement import planned_as_enumerated, scaled


def with_two_gpus(problem, gpus: dict[str, tuple[tuple[float, int], tuple[float, int]]]):
    """``problem`` whose named devices have ``cuda:0`` and ``cuda:1``: each (time factor vs the CPU, memory)."""
    accs = tuple(AcceleratorTimes(device=d, torch_device=f"cuda:{i}", memory_bytes=mem,
                                  times=scaled(problem.profile.times_of(d), f))
                 for d, pair in gpus.items() for i, (f, mem) in enumerate(pair))
    return msgspec.structs.replace(problem, profile=msgspec.structs.replace(problem.profile, accelerator_times=accs))


def by_hand(problem, on_gpu: dict[str, str]):
    """The problem with each device of ``on_gpu`` given that GPU's times and memory (not core.planning.placement's)."""
    accs = {(a.device, a.torch_device): a for a in problem.profile.accelerator_times}
    p = problem.profile
    times = tuple(accs[(t.device, on_gpu[t.device])].times if t.device in on_gpu else t for t in p.times)
    devices = tuple(msgspec.structs.replace(d, memory_bytes=accs[(d.id, on_gpu[d.id])].memory_bytes)
                    if d.id in on_gpu else d for d in p.cluster.devices)
    profile = msgspec.structs.replace(p, times=times, cluster=msgspec.structs.replace(p.cluster, devices=devices),
                                      accelerator_times=())
    return msgspec.structs.replace(problem, profile=profile)


def brute_force(problem, objective: str) -> float:
    devices = sorted({a.device for a in problem.profile.accelerator_times})
    values = []
    for choice in itertools.product(("cpu", "cuda:0", "cuda:1"), repeat=len(devices)):
        on_gpu = {d: g for d, g in zip(devices, choice) if g != "cpu"}
        values.append(exhaustive_optimum(by_hand(problem, on_gpu), objective)[0])
    return min(values) if objective == "latency" else max(values)


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_the_planned_choice_among_several_gpus_equals_exhaustive_enumeration(objective):
    checked = 0
    for seed in range(8):
        r = random.Random(100 + seed)
        problem = random_problem(seed, r.randint(2, 3), r.randint(3, 6), tightness=r.uniform(1.0, 2.0), batch=1)
        ids = problem.profile.cluster.device_ids()
        budget = max(d.memory_bytes for d in problem.profile.cluster.devices)
        gpus = {d: tuple((r.uniform(0.05, 1.5), int(budget * r.uniform(0.1, 1.2))) for _ in range(2))
                for d in r.sample(ids, min(2, len(ids)))}
        problem = with_two_gpus(problem, gpus)
        checked += planned_as_enumerated(problem, objective, brute_force(problem, objective), seed)
    assert checked >= 4


def test_a_fast_roomy_second_gpu_gets_the_stage_when_the_first_is_small():
    problem = random_problem(4, 3, 6, tightness=1.5, batch=1)
    device = problem.profile.cluster.devices[1].id
    plan = edgeshard_optimal(with_two_gpus(problem, {device: ((0.05, 1), (0.05, 1 << 40))}), "latency")
    assert [s.torch_device for s in plan.stages if s.device == device] == ["cuda:1"]


def test_a_stage_on_a_gpu_its_profile_lacks_is_named_with_the_choices_it_has():
    from core.planning.edits import PlanEditError, set_stage_torch_device
    from core.planning.placement import unprofiled_gpus

    problem = random_problem(4, 3, 6, tightness=1.5, batch=1)
    device = problem.profile.cluster.devices[1].id
    problem = with_two_gpus(problem, {device: ((0.5, 1 << 40), (0.5, 1 << 40))})
    plan = edgeshard_optimal(problem, "latency")
    j = next(i for i, s in enumerate(plan.stages) if s.device == device)
    assert unprofiled_gpus(problem, set_stage_torch_device(plan, j, "cuda")) == []  # cuda is cuda:0
    other = next(i for i, s in enumerate(plan.stages) if s.device != device)
    [line] = unprofiled_gpus(problem, set_stage_torch_device(plan, other, "cuda:1"))
    assert line.startswith(f"stage {other} (") and "no GPU" in line and line.endswith("pick cpu")
    [line] = unprofiled_gpus(problem, set_stage_torch_device(plan, j, "cuda:7"))
    assert line.endswith("pick cpu, cuda:0, cuda:1")
    with pytest.raises(PlanEditError, match="torch_device must be cpu, cuda or cuda:N"):
        set_stage_torch_device(plan, j, "gpu0")


def test_no_plan_puts_int4_weights_on_a_gpu_which_refuses_them():
    from core.devices.profile import DevicePrecisionTimes
    from tests.gui.techniques.layer_sharding.test_precision_view import measured_problem

    problem = measured_problem()  # int4 allowed under the bound below
    d = problem.profile.cluster.device_ids()[0]
    fast_int4 = (DevicePrecisionTimes(device=d, weights="int4", decode_time_ratio=0.1, prefill_time_ratio=0.1),)
    problem = with_two_gpus(problem, {d: ((0.5, 1 << 40), (0.5, 1 << 40))})
    gpus = tuple(msgspec.structs.replace(a, precision_times=fast_int4) for a in problem.profile.accelerator_times)
    problem = msgspec.structs.replace(problem, max_perplexity_increase=0.2, profile=msgspec.structs.replace(
        problem.profile, accelerator_times=gpus))
    plan = edgeshard_optimal(problem, "latency")
    assert not any(s.weights == "int4" and s.torch_device != "cpu" for s in plan.stages)

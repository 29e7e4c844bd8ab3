"""The exact planner with devices that have a GPU (``Profile.accelerator_times``): it solves every
CPU/GPU choice of those devices and keeps the best, so its plan equals exhaustive enumeration over
every layout and every choice (the GPU's variant of the problem built here by hand); a CPU-only profile
plans exactly as before."""

from __future__ import annotations

import itertools
import math
import random

import msgspec
import pytest

from core.devices.profile import AcceleratorTimes
from core.errors import ModelDoesNotFit
from core.planning.cost import evaluate
from core.planning.scenarios import random_problem
from core.planning.solvers import edgeshard_optimal, solve_max_throughput, solve_min_latency
from tests.core.exhaustive import exhaustive_optimum


def scaled(times, factor: float):
    """``times`` with every unit (and stage overhead) ``factor`` times as long."""
    return msgspec.structs.replace(
        times, decode_s=tuple(tuple(v * factor for v in row) for row in times.decode_s),
        prefill_s=tuple(tuple(v * factor for v in row) for row in times.prefill_s),
        stage_decode_overhead_s=times.stage_decode_overhead_s * factor,
        stage_prefill_overhead_s=times.stage_prefill_overhead_s * factor)


def with_gpus(problem, gpus: dict[str, tuple[float, int]]):
    """``problem`` whose named devices have a GPU: (time factor vs their CPU, memory bytes)."""
    accs = tuple(AcceleratorTimes(device=d, memory_bytes=mem, times=scaled(problem.profile.times_of(d), f))
                 for d, (f, mem) in gpus.items())
    return msgspec.structs.replace(problem, profile=msgspec.structs.replace(problem.profile, accelerator_times=accs))


def by_hand(problem, on_gpu: set[str]):
    """The problem with the ``on_gpu`` devices' times and memory replaced by their GPU's (the reference's
    own construction, not core.planning.placement's)."""
    accs = {a.device: a for a in problem.profile.accelerator_times}
    p = problem.profile
    times = tuple(accs[t.device].times if t.device in on_gpu else t for t in p.times)
    devices = tuple(msgspec.structs.replace(d, memory_bytes=accs[d.id].memory_bytes) if d.id in on_gpu else d
                    for d in p.cluster.devices)
    profile = msgspec.structs.replace(p, times=times, cluster=msgspec.structs.replace(p.cluster, devices=devices),
                                      accelerator_times=())
    return msgspec.structs.replace(problem, profile=profile)


def brute_force(problem, objective: str) -> float:
    """The best value over every CPU/GPU choice and every plan, by enumeration."""
    gpus = [a.device for a in problem.profile.accelerator_times]
    values = [exhaustive_optimum(by_hand(problem, {d for d, on in zip(gpus, c) if on}), objective)[0]
              for c in itertools.product((False, True), repeat=len(gpus))]
    return min(values) if objective == "latency" else max(values)


def planned_as_enumerated(problem, objective: str, best: float, seed: int) -> bool:
    """The exact solver's plan is feasible and exactly as good as ``best`` (found by enumeration), or the
    solver refuses where enumeration found nothing that fits; True where a plan was compared."""
    if best in (math.inf, 0.0):
        with pytest.raises(ModelDoesNotFit):
            edgeshard_optimal(problem, objective)
        return False
    cost = evaluate(problem, edgeshard_optimal(problem, objective))
    assert cost.feasible, cost.violations
    got = cost.latency_per_token_s if objective == "latency" else cost.throughput_tokens_s
    assert got == pytest.approx(best, rel=1e-9), seed
    return True


def test_a_fast_gpu_with_room_gets_a_stage_named_for_it(tmp_path):
    problem = random_problem(4, 3, 6, tightness=1.5, batch=1)
    device = problem.profile.cluster.devices[1].id
    plan = edgeshard_optimal(with_gpus(problem, {device: (0.05, 1 << 40)}), "latency")
    [stage] = [s for s in plan.stages if s.device == device]
    assert stage.torch_device == "cuda:0"
    assert all(s.torch_device == "cpu" for s in plan.stages if s.device != device)


def test_a_gpu_too_small_for_any_unit_is_left_unused():
    problem = random_problem(4, 3, 6, tightness=1.5, batch=1)
    device = problem.profile.cluster.devices[1].id
    plan = edgeshard_optimal(with_gpus(problem, {device: (0.05, 1)}), "latency")
    assert all(s.torch_device == "cpu" for s in plan.stages)


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_cpu_only_profiles_plan_exactly_as_the_exact_solver_did(objective):
    solve = solve_min_latency if objective == "latency" else solve_max_throughput
    for seed in range(6):
        problem = random_problem(seed, 4, 8, tightness=1.5, batch=2)
        assert edgeshard_optimal(problem, objective) == solve(problem).plan


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_the_planned_gpu_choice_equals_exhaustive_enumeration(objective):
    checked = 0
    for seed in range(12):
        r = random.Random(seed)
        problem = random_problem(seed, r.randint(2, 4), r.randint(3, 7), tightness=r.uniform(1.0, 2.0),
                                 batch=r.choice([1, 2]))
        ids = problem.profile.cluster.device_ids()
        budget = max(d.memory_bytes for d in problem.profile.cluster.devices)
        gpus = {d: (r.uniform(0.05, 1.5), int(budget * r.uniform(0.1, 1.2))) for d in r.sample(ids, min(2, len(ids)))}
        problem = with_gpus(problem, gpus)
        checked += planned_as_enumerated(problem, objective, brute_force(problem, objective), seed)
    assert checked >= 6


def test_a_gpu_of_an_unknown_device_or_with_a_short_times_table_is_a_profile_error():
    from core.devices.profile import profile_errors

    problem = random_problem(4, 3, 6, tightness=1.5, batch=1)
    times = problem.profile.times[0]
    short = msgspec.structs.replace(times, decode_s=times.decode_s[:-1])
    accs = (AcceleratorTimes(device="nowhere", memory_bytes=1, times=msgspec.structs.replace(times, device="nowhere")),
            AcceleratorTimes(device=times.device, torch_device="gpu", memory_bytes=-1, times=short))
    errors = profile_errors(msgspec.structs.replace(problem.profile, accelerator_times=accs))
    assert any(e.startswith("$.accelerator_times[0].device") for e in errors)
    assert any(e.startswith("$.accelerator_times[1].torch_device") for e in errors)
    assert any(e.startswith("$.accelerator_times[1].memory_bytes") for e in errors)
    assert any(e.startswith("$.accelerator_times[1].times.decode_s") for e in errors)


def test_edgeshard_plan_places_a_stage_on_a_profiled_gpu_and_prints_where(tmp_path, capsys):
    from core.cli import main
    from core.formats import load, save
    from core.planning.plan import ShardPlan

    problem = random_problem(4, 3, 6, tightness=1.5, batch=1)
    device = problem.profile.cluster.devices[1].id
    save(tmp_path / "problem.json", with_gpus(problem, {device: (0.05, 1 << 40)}))
    assert main(["plan", str(tmp_path / "problem.json"), "--out", str(tmp_path / "plan.json")]) == 0
    assert f"{device} (cuda:0)" in capsys.readouterr().out
    assert {s.device: s.torch_device for s in load(tmp_path / "plan.json", ShardPlan).stages}[device] == "cuda:0"

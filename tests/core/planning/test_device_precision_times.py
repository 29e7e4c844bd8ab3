"""A device's own quantized block times (``Profile.precision_times``): the cost model and the exact
solvers cost a device's int8/int4 blocks by its own measured ratio over fp, not by the one ratio
measured with the model's perplexity; devices without one keep that ratio. The solvers are held to brute
force (costed by ``evaluate``) over every device sequence, split, precision per stage and micro-batching."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from core.devices.profile import profile_errors
from core.models.weight_quality import DevicePrecisionTimes
from core.planning.cost import evaluate
from core.planning.plan import ShardPlan, Stage
from core.planning.problem import with_changes
from tests.core.planning.test_precision_planning import _instance, solved_as_brute_force


def with_device_times(problem, seed: int):
    """``problem`` whose devices but the last have their own int8/int4 ratios (0.4x to 2.5x of fp)."""
    r = random.Random(seed)
    ids = problem.profile.cluster.device_ids()
    own = tuple(DevicePrecisionTimes(device=d, weights=w, decode_time_ratio=r.uniform(0.4, 2.5),
                                     prefill_time_ratio=r.uniform(0.4, 2.5))
                for d in ids[:-1] for w in ("int8", "int4"))
    return msgspec.structs.replace(problem, profile=msgspec.structs.replace(problem.profile, precision_times=own))


def test_a_quantized_stage_costs_its_devices_own_ratio_and_a_device_without_one_the_models():
    problem = with_device_times(_instance(2), 0)
    problem = with_changes(problem, workload=msgspec.structs.replace(problem.workload, batch_size=1))
    n = problem.profile.model.num_units
    own = {(t.device, t.weights): t.decode_time_ratio for t in problem.profile.precision_times}
    model = {q.weights: q.decode_time_ratio for q in problem.profile.weight_quality}
    checked = set()
    for d in problem.profile.cluster.device_ids():
        times = problem.profile.times_of(d)
        for w in ("int8", "int4"):
            r = own.get((d, w), model[w])
            plan = ShardPlan(model="m", num_units=n, stages=(Stage(device=d, start=0, end=n, weights=w),))
            blocks = sum(times.decode_time(u, 1) for u in range(1, n - 1))
            want = times.decode_time(0, 1) + times.decode_time(n - 1, 1) + r * blocks + \
                times.stage_overhead_time("decode", 0, n)
            assert math.isclose(evaluate(problem, plan).stage_compute_s[0], want, rel_tol=1e-12)
            checked.add((d, w) in own)
    assert checked == {True, False}


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_the_exact_solvers_choose_by_each_devices_own_ratios_as_well_as_brute_force(objective):
    bases = [_instance(seed) for seed in range(20)]
    own = solved_as_brute_force([with_device_times(b, seed) for seed, b in enumerate(bases)], objective)
    alike = solved_as_brute_force(bases, objective)
    found = [(a, b) for a, b in zip(own, alike) if a is not None]
    differ = sum(b is None or not math.isclose(a.value, b.value, rel_tol=1e-9) for a, b in found)
    assert len(found) >= 6 and differ >= 1  # the devices' own ratios change some optima


def test_a_device_time_entry_for_an_unknown_device_or_precision_is_a_profile_error():
    problem = _instance(1)
    bad = (DevicePrecisionTimes(device="nowhere", weights="int8", decode_time_ratio=1.0, prefill_time_ratio=1.0),
           DevicePrecisionTimes(device=problem.source, weights="fp", decode_time_ratio=0.0, prefill_time_ratio=1.0))
    errors = profile_errors(msgspec.structs.replace(problem.profile, precision_times=bad))
    assert any("unknown device 'nowhere'" in e for e in errors)
    assert any("weights: one of int8, int4, not 'fp'" in e for e in errors)
    assert any("decode_time_ratio: must be finite and positive" in e for e in errors)

"""Health in planning: a plan touching an offline device is flagged naming it, and the solvers
never count on one (the problem they get leaves offline devices out)."""

from __future__ import annotations

import pytest

from core.errors import PlanInvalid
from core.planning.plan import offline_problems, plan_from_boundaries
from core.planning.problem import without_offline
from core.planning.scenarios import DeviceSpec, synthetic_problem
from core.planning.solvers import solve_min_latency


def _problem():
    specs = [DeviceSpec(id="src", tflops=2, memory_bandwidth_gb_s=20, memory_gib=8),
             DeviceSpec(id="fast", tflops=60, memory_bandwidth_gb_s=900, memory_gib=24),
             DeviceSpec(id="mid", tflops=20, memory_bandwidth_gb_s=200, memory_gib=24)]
    return synthetic_problem(specs, "llama-2-7b", bandwidth_mbit_s=1000)


def test_a_plan_on_an_offline_device_is_flagged_naming_the_device_and_its_stage():
    plan = plan_from_boundaries("m", 10, ["src", "fast", "mid"], [3, 6])
    assert offline_problems(plan, ("fast",)) == [
        "stage 1 runs on 'fast', which is offline: bring it back, or auto-solve again (offline devices are left out)"]
    assert offline_problems(plan, ("elsewhere",)) == []


def test_solving_without_offline_devices_never_places_a_stage_on_one():
    problem = _problem()
    assert "fast" in solve_min_latency(problem).plan.devices()
    plan = solve_min_latency(without_offline(problem, ("fast", "not-in-this-cluster"))).plan
    assert "fast" not in plan.devices() and offline_problems(plan, ("fast",)) == []
    assert without_offline(problem, ()) is problem


def test_an_offline_source_cannot_be_left_out_and_says_so():
    with pytest.raises(PlanInvalid, match="source device 'src' is offline"):
        without_offline(_problem(), ("src",))

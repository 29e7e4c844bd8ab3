"""``edgeshard run --on-failure replan --problem`` takes the profile.json a plan was made from (no
command writes an ``edgeshard.problem`` for a user who profiled): the re-planner's problem is that
profile with the plan's first device as the source and this run's workload, and it re-plans without
the lost device. A file holding several problems is refused by name (issue 30 item 5)."""

from __future__ import annotations

import argparse

import pytest

from core import formats
from core.cli.runs import _replanner
from core.errors import FormatError
from core.planning.plan import plan_from_boundaries
from core.planning.scenarios import DeviceSpec, Scenario, synthetic_problem

DEVICES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def problem():
    return synthetic_problem([DeviceSpec(id=d, tflops=1, memory_bandwidth_gb_s=10, memory_gib=16) for d in DEVICES],
                             "llama-2-7b")


def _args(path, on_failure="replan") -> argparse.Namespace:
    return argparse.Namespace(on_failure=on_failure, problem=str(path), max_new_tokens=24, model="llama-2-7b")


def test_a_profile_is_made_into_the_runs_problem_and_re_plans_without_the_lost_device(tmp_path, problem):
    path = tmp_path / "profile.json"
    formats.save(path, problem.profile)
    units = problem.profile.model.num_units
    plan = plan_from_boundaries("llama-2-7b", units, ["b", "a", "c"], [units // 3, 2 * units // 3])
    replanner = _replanner(_args(path), plan, prompts=2)
    made = replanner.problem
    assert (made.source, made.workload.generated_tokens, made.workload.batch_size) == ("b", 24, 2)
    again = replanner(plan, "c", ("a", "b"))
    assert "c" not in again.devices() and again.stages[0].device == "b"


def test_a_scenario_of_several_problems_is_refused_naming_what_to_give(tmp_path, problem):
    path = tmp_path / "scenario.json"
    formats.save(path, Scenario(name="two", problems=(problem, problem)))
    plan = plan_from_boundaries("llama-2-7b", problem.profile.model.num_units, DEVICES, [10, 20])
    with pytest.raises(FormatError, match="holds 2 problems: give the problem or the profile"):
        _replanner(_args(path), plan, prompts=1)

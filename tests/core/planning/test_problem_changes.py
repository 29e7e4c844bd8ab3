"""A planning problem starts from a profile with stated defaults, and a change to it is checked
before it can reach a solver (``core.planning.problem.default_problem`` / ``with_changes``)."""

from __future__ import annotations

import msgspec
import pytest

from core.errors import FormatError
from core.planning.problem import DEFAULT_GENERATED_TOKENS, Workload, default_problem, problem_errors, with_changes
from core.devices.profile import ProfiledWorkload
from tests.core.sessions_problems import make_problem

DEVICES = {"a": 0.010, "b": 0.020, "c": 0.005}


def _profile():
    return make_problem(DEVICES).profile


def test_a_fresh_profile_is_served_from_its_first_device_with_the_profiled_prompt_and_batch():
    profile = msgspec.structs.replace(_profile(), profiled_workload=ProfiledWorkload(prompt_tokens=48, batch_size=2))
    p = default_problem(profile)
    assert p.source == profile.cluster.device_ids()[0]
    assert p.workload == Workload(prompt_tokens=48, generated_tokens=DEFAULT_GENERATED_TOKENS, batch_size=2)
    assert p.name == profile.model.name and problem_errors(p) == []


def test_a_default_problem_with_an_unknown_source_names_the_source_field():
    with pytest.raises(FormatError) as err:
        default_problem(_profile(), source="toaster")
    assert err.value.field == "$.source" and "toaster" in str(err.value)


def test_changes_are_applied_and_the_rest_is_kept():
    p = default_problem(_profile())
    q = with_changes(p, source="b", excluded_devices=["c"], memory_headroom=0.25)
    assert (q.source, q.excluded_devices, q.memory_headroom) == ("b", ("c",), 0.25)
    assert q.workload == p.workload and q.profile is p.profile


@pytest.mark.parametrize(("fields", "field"), [
    ({"memory_headroom": 1.5}, "$.memory_headroom"),
    ({"memory_headroom": "lots"}, "$.memory_headroom"),
    ({"workload": Workload(prompt_tokens=0, generated_tokens=8)}, "$.workload.prompt_tokens"),
    ({"workload": Workload(prompt_tokens=8, generated_tokens=8, batch_size=2, micro_batch_size=4)},
     "$.workload.micro_batch_size"),
    ({"source": "toaster"}, "$.source"),
    ({"excluded_devices": ("a", "ghost")}, "$.excluded_devices"),
    ({"profile": None}, "$.profile"),
])
def test_an_invalid_change_raises_a_format_error_naming_the_field(fields, field):
    p = default_problem(_profile())
    with pytest.raises(FormatError) as err:
        with_changes(p, **fields)
    assert err.value.field == field

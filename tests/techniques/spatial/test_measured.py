"""Spatial partitioning's problem from the connected agents' CNN fits and the measured profile."""

from __future__ import annotations

import pytest

from core.techniques.spatial.measured import DEFAULT_LINK_MBIT, problem_from_fits
from core.techniques.spatial.problem import CnnRef, SpatialInputError, TimeModel, check
from core.techniques.spatial.profiling import DeviceFit, SpatialFits
from core.techniques.spatial.strategies import run_strategy
from tests.gui.problems import make_problem

FITS = SpatialFits(source="measured on 3 agent(s)", devices=tuple(
    DeviceFit(device=d, conv=TimeModel(a=1 / rate, b=1e-4)) for d, rate in
    (("phone", 1e9), ("laptop", 2e9), ("server", 4e9))))
MODEL = CnnRef(network="resnet-style", image=32, width_div=8, classes=10)


def test_the_fits_become_the_devices_with_the_profiles_links_to_the_gateway_and_budgets():
    profile = make_problem().profile
    problem = problem_from_fits(MODEL, FITS, profile=profile, gateway="phone")
    check(problem)
    assert problem.gateway == "phone" and [d.id for d in problem.devices] == ["phone", "laptop", "server"]
    links = {(link.src, link.dst): link for link in profile.cluster.links}
    for d in problem.devices[1:]:
        assert d.bandwidth_Bps == pytest.approx(links[("phone", d.id)].bandwidth_mbit_s * 1e6 / 8)
        assert d.memory_bytes == profile.cluster.device(d.id).memory_bytes
        assert d.time == next(f.conv for f in FITS.devices if f.device == d.id)
    assert run_strategy(problem, "fused").plan is not None


def test_without_a_profile_the_links_are_assumed_and_the_name_says_so():
    problem = problem_from_fits(MODEL, FITS)
    assert problem.gateway == "laptop"  # the first fitted agent by name
    assert all(d.bandwidth_Bps == DEFAULT_LINK_MBIT * 1e6 / 8 for d in problem.devices)
    assert "links assumed" in problem.name


def test_only_connected_agents_are_planned_and_none_connected_says_to_profile_cnn():
    assert [d.id for d in problem_from_fits(MODEL, FITS, agents=("server", "phone")).devices] == ["phone", "server"]
    with pytest.raises(SpatialInputError, match="Profile CNN"):
        problem_from_fits(MODEL, FITS, agents=("elsewhere",))

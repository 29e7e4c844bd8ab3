"""`edgeshard spatial run|calibrate|profile` and `edgeshard run` of a spatial plan check the plan,
the agents' names, the workspace and the output path before they start or connect any agent: one
line, exit 2 (before: an invalid plan was found after two agents were started or connected, 9-12 s,
in a multi-line message; a problem/agents name mismatch after profiling every agent)."""

from __future__ import annotations

import pytest
from msgspec import structs

from core.formats import save
from core.techniques.spatial.partition import per_layer_plan
from tests.entrances import forbid_agents, refused, unreachable_agents_file
from tests.techniques.spatial.conftest import make_problem


@pytest.fixture
def files(tmp_path, monkeypatch):
    """(problem path, path of a plan whose second group does not continue the first); no agent may start."""
    forbid_agents(monkeypatch)
    problem = make_problem((4.0, 2.0))
    plan = per_layer_plan(problem, "even")
    (a, b), *rest = plan.groups
    broken = structs.replace(plan, groups=((a, b), (b + 1, rest[0][1]), *rest[1:]))
    save(tmp_path / "problem.json", problem)
    save(tmp_path / "plan.json", broken)
    return tmp_path / "problem.json", tmp_path / "plan.json"


def test_spatial_run_refuses_an_invalid_plan_before_connecting(files, tmp_path, capsys):
    problem, plan = files
    err = refused(["spatial", "run", problem, "--agents", unreachable_agents_file(tmp_path, ["d0", "d1"]),
                   "--plan", plan, "--images", "1", "--workspace", tmp_path / "ws.sqlite"], capsys)
    assert "spatial plan/problem is invalid: group [" in err and "does not continue at layer" in err


def test_run_of_a_spatial_plan_refuses_an_invalid_plan_before_starting_local_agents(files, capsys):
    problem, plan = files
    err = refused(["run", "--local", "--plan", plan, "--problem", problem, "--images", "1", "--no-record"], capsys)
    assert "spatial plan/problem is invalid" in err


def test_spatial_run_refuses_a_folder_as_workspace_before_connecting(files, tmp_path, capsys):
    problem, _ = files
    err = refused(["spatial", "run", problem, "--agents", unreachable_agents_file(tmp_path, ["d0", "d1"]),
                   "--images", "1", "--workspace", tmp_path], capsys)
    assert "is a directory, expected a workspace file" in err


def test_spatial_calibrate_refuses_devices_without_an_agent_before_connecting(files, tmp_path, capsys):
    problem, _ = files
    agents = unreachable_agents_file(tmp_path, ["local-0", "local-1"])
    err = refused(["spatial", "calibrate", problem, "--agents", agents, "--out", tmp_path / "out.json"], capsys)
    assert "no agent named d0, d1" in err and "local-0, local-1" in err


def test_spatial_profile_refuses_a_problem_named_unlike_the_agents_before_profiling(files, tmp_path, capsys):
    problem, _ = files
    err = refused(["spatial", "profile", "--agents", unreachable_agents_file(tmp_path, ["local-0"]),
                   "--problem", problem, "--out", tmp_path / "out.json"], capsys)
    assert "is named like a device of" in err


def test_spatial_calibrate_refuses_an_output_path_below_a_file(files, tmp_path, capsys):
    problem, _ = files
    err = refused(["spatial", "calibrate", problem, "--agents", unreachable_agents_file(tmp_path, ["d0", "d1"]),
                   "--out", problem / "out.json"], capsys)
    assert "--out" in err and "cannot be written" in err

"""A plan is checked before any agent is touched: before, a plan with an empty stage hung the
run, and overlapping or gapped ranges exited 0 with wrong tokens."""

from __future__ import annotations

import time

import pytest

from core import formats
from core.planning.plan import ShardPlan, Stage, layout_problems
from tests.core.cli.test_cli_run import cli_run_files, run_cli


def _plan(*ranges, num_units=6) -> ShardPlan:
    return ShardPlan(model="tiny-llama", num_units=num_units,
                     stages=tuple(Stage(device=f"local-{i}", start=a, end=b) for i, (a, b) in enumerate(ranges)))


def test_a_plan_covering_all_units_in_order_has_no_problems():
    assert layout_problems(_plan((0, 3), (3, 6)), 6) == []


@pytest.mark.parametrize(
    "ranges,problem",
    [
        (((0, 3), (3, 3), (3, 6)), "stage 1 (local-1) is empty"),
        (((0, 4), (3, 6)), "overlaps the previous stage"),
        (((0, 2), (3, 6)), "leaves units [2, 3) unassigned"),
        (((0, 3), (3, 5)), "stages end at unit 5, the model has 6"),
    ],
    ids=["empty", "overlap", "gap", "short"],
)
def test_a_broken_layout_is_named(ranges, problem):
    assert any(problem in p for p in layout_problems(_plan(*ranges)))


def test_a_device_in_two_stages_is_named():
    plan = ShardPlan(model="m", num_units=6, stages=(Stage(device="a", start=0, end=3), Stage(device="a", start=3, end=6)))
    assert layout_problems(plan) == ["device a appears in more than one stage"]


def test_a_plan_for_another_model_size_is_named():
    assert layout_problems(_plan((0, 4), (4, 8), num_units=8), 6) == [
        "plan is for a model of 8 units, this checkpoint has 6"]


@pytest.mark.parametrize("ranges", [((0, 3), (3, 3), (3, 6)), ((0, 4), (3, 6)), ((0, 2), (3, 6))],
                         ids=["empty", "overlap", "gap"])
def test_edgeshard_run_refuses_a_broken_plan_within_seconds_before_starting_agents(ranges, tmp_path, capsys):
    model, _ = cli_run_files(tmp_path)
    bad = tmp_path / "bad-plan.json"
    formats.save(bad, _plan(*ranges))
    t0 = time.monotonic()
    code, out = run_cli(["run", "--model", model, "--plan", bad, "--local", "--prompt", "x", "--no-record"])
    err = capsys.readouterr().err
    assert code == 2 and "plan is invalid" in err and "Traceback" not in err
    assert "TTFT" not in out
    assert time.monotonic() - t0 < 10

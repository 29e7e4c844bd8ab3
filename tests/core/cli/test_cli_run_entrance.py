"""`edgeshard run`, `cluster local` and `profile` check their input before they start or connect any
agent: an overlapping, gapped, empty-stage or stage-less plan, a plan for another unit count, one
naming a device the agents file lacks, an empty prompt, duplicate agent names, an output path that
is a folder are each one line, exit status 2, and no agent is started (before: a bad plan started
two agents first and took 8-25 s; ``"stages": []`` ended in a ZeroDivisionError traceback while
sizing the local agents' threads; duplicate names a ValueError traceback; a profile was measured,
then could not be written)."""

from __future__ import annotations

import pytest

from core import formats
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import ShardPlan, Stage, plan_from_boundaries
from tests.entrances import forbid_agents, refused, unreachable_agents_file

BAD_PLANS = {
    "overlapping": ((("edge-0", 0, 4), ("edge-1", 3, 6)), 6, "overlaps the previous stage"),
    "gapped": ((("edge-0", 0, 2), ("edge-1", 3, 6)), 6, "leaves units [2, 3) unassigned"),
    "empty-stage": ((("edge-0", 0, 0), ("edge-1", 0, 6)), 6, "stage 0 (edge-0) is empty"),
    "stage-less": ((), 6, "plan has no stages"),
    "other-unit-count": ((("edge-0", 0, 4), ("edge-1", 4, 8)), 8, "this checkpoint has 6"),
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A real generated llama checkpoint of 6 units (embedding, 4 blocks, head)."""
    folder = tmp_path_factory.mktemp("entrance")
    return make_model(ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3),
                      folder / "tiny-llama")


@pytest.fixture
def no_agent_may_start(monkeypatch):
    forbid_agents(monkeypatch)


def _plan_file(folder, stages, num_units):
    path = folder / "plan.json"
    formats.save(path, ShardPlan(model="tiny-llama", num_units=num_units,
                                 stages=tuple(Stage(device=d, start=a, end=b) for d, a, b in stages)))
    return path


def _good_plan(folder, devices=("edge-0", "edge-1")):
    path = folder / "good-plan.json"
    formats.save(path, plan_from_boundaries("tiny-llama", 6, list(devices), [3]))
    return path


@pytest.mark.parametrize("name", sorted(BAD_PLANS))
def test_an_invalid_plan_with_local_agents_is_one_line_exit_2_and_no_agent_starts(
        name, tiny_model, tmp_path, capsys, no_agent_may_start):
    stages, num_units, reason = BAD_PLANS[name]
    err = refused(["run", "--local", "--model", tiny_model, "--plan", _plan_file(tmp_path, stages, num_units),
                   "--prompt", "x", "--no-record"], capsys)
    assert err.startswith("edgeshard: error: plan is invalid: ") and reason in err, err


def test_an_invalid_plan_with_an_agents_file_is_refused_before_connecting(tiny_model, tmp_path, capsys,
                                                                          no_agent_may_start):
    plan = _plan_file(tmp_path, *BAD_PLANS["gapped"][:2])
    err = refused(["run", "--agents", unreachable_agents_file(tmp_path, ["edge-0", "edge-1"]), "--model",
                   tiny_model, "--plan", plan, "--prompt", "x", "--no-record"], capsys)
    assert "leaves units [2, 3) unassigned" in err


def test_a_plan_device_missing_from_the_agents_file_is_named_before_connecting(tiny_model, tmp_path, capsys,
                                                                               no_agent_may_start):
    agents = unreachable_agents_file(tmp_path, ["edge-0", "edge-1"])
    err = refused(["run", "--agents", agents, "--model", tiny_model, "--plan", _good_plan(tmp_path, ["edge-0", "edge-9"]),
                   "--prompt", "x", "--no-record"], capsys)
    assert "edge-9" in err and agents in err and "edge-0, edge-1" in err


def test_a_checkpoint_without_weights_is_refused_before_any_agent_starts(tiny_model, tmp_path, capsys,
                                                                         no_agent_may_start):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny_model / "config.json").read_text())
    err = refused(["run", "--local", "--model", bare, "--plan", _good_plan(tmp_path), "--prompt", "x",
                   "--no-record"], capsys)
    assert "no model.safetensors" in err


def test_an_empty_prompt_is_refused_before_any_agent_starts(tiny_model, tmp_path, capsys, no_agent_may_start):
    err = refused(["run", "--local", "--model", tiny_model, "--plan", _good_plan(tmp_path), "--prompt", "a",
                   "--prompt", "", "--no-record"], capsys)
    assert "--prompt" in err and "prompt 1 is empty" in err


def test_cluster_local_refuses_duplicate_names_before_starting_agents(capsys, no_agent_may_start):
    err = refused(["cluster", "local", "-n", "2", "--names", "a,a"], capsys)
    assert "--names" in err and "'a,a'" in err


def test_cluster_local_refuses_a_file_as_its_folder(tmp_path, capsys, no_agent_may_start):
    file = tmp_path / "not-a-folder"
    file.write_text("x")
    err = refused(["cluster", "local", "-n", "1", "--dir", file], capsys)
    assert "--dir" in err and "is a file" in err


def test_profile_refuses_an_output_folder_before_connecting(tiny_model, tmp_path, capsys, no_agent_may_start):
    err = refused(["profile", "--agents", unreachable_agents_file(tmp_path, ["edge-0"]), "--model", tiny_model,
                   "--out", tmp_path], capsys)
    assert "--out" in err and "is a folder" in err


def test_profile_refuses_an_unsupported_model_before_connecting(tmp_path, capsys, no_agent_may_start):
    (tmp_path / "config.json").write_text('{"model_type": "llava"}')
    err = refused(["profile", "--agents", unreachable_agents_file(tmp_path, ["edge-0"]), "--model", tmp_path,
                   "--out", tmp_path / "p.json"], capsys)
    assert "unsupported model family" in err and "llava" in err


def test_profile_refuses_a_draft_that_is_not_a_checkpoint_before_connecting(tiny_model, tmp_path, capsys,
                                                                           no_agent_may_start):
    err = refused(["profile", "--agents", unreachable_agents_file(tmp_path, ["edge-0"]), "--model", tiny_model,
                   "--out", tmp_path / "p.json", "--draft", tmp_path], capsys)
    assert "--draft" in err and "no config.json" in err


def test_more_micro_batches_than_prompts_are_refused_instead_of_quietly_running_fewer(tiny_model, tmp_path, capsys,
                                                                                     no_agent_may_start):
    err = refused(["run", "--local", "--model", tiny_model, "--plan", _good_plan(tmp_path), "--prompt", "x",
                   "--micro-batches", "2", "--no-record"], capsys)
    assert "--micro-batches" in err and "2 micro-batches for 1 prompt(s)" in err


def test_an_agents_file_listing_a_device_twice_is_one_line_not_a_traceback(tiny_model, tmp_path, capsys,
                                                                           no_agent_may_start):
    import json

    agents = unreachable_agents_file(tmp_path, ["edge-0", "edge-1"])
    data = json.loads(open(agents).read())
    data["agents"][1]["device"] = "edge-0"
    open(agents, "w").write(json.dumps(data))
    err = refused(["run", "--agents", agents, "--model", tiny_model, "--plan", _good_plan(tmp_path), "--prompt", "x",
                   "--no-record"], capsys)
    assert "device edge-0 is listed more than once" in err

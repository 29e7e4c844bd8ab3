"""`edgeshard run` checks the plan against the checkpoint before it starts or connects any agent:
an overlapping, gapped, empty-stage or stage-less plan, a plan for another unit count, or one
naming a device the agents file lacks is one line, exit status 2, and no agent is started
(before: two local agents were started first and the answer took 6 s; ``"stages": []`` ended in
a ZeroDivisionError traceback while sizing the local agents' threads)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from agents.transport import CurveKeys
from core import formats
from core.cli import main as cli_main
from core.devices.local_cluster import AGENTS_FORMAT
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import ShardPlan, Stage, plan_from_boundaries

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
    """Fails the test if a local cluster is built or a coordinator connects to any agent."""
    import core.devices.local_cluster
    import core.runs.coordinator

    def refuse(*_a, **_k):
        pytest.fail("an agent was started or connected before the plan was checked")

    monkeypatch.setattr(core.devices.local_cluster.LocalCluster, "__init__", refuse)
    monkeypatch.setattr(core.runs.coordinator.Coordinator, "__init__", refuse)


def _plan_file(folder, name, stages, num_units):
    path = folder / f"{name}.json"
    formats.save(path, ShardPlan(model="tiny-llama", num_units=num_units,
                                 stages=tuple(Stage(device=d, start=a, end=b) for d, a, b in stages)))
    return path


def _run(argv, capsys) -> tuple[int, str, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main([str(a) for a in argv])
    return code, out.getvalue(), capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(BAD_PLANS))
def test_an_invalid_plan_with_local_agents_is_one_line_exit_2_and_no_agent_starts(
        name, tiny_model, tmp_path, capsys, no_agent_may_start):
    stages, num_units, reason = BAD_PLANS[name]
    plan = _plan_file(tmp_path, name, stages, num_units)
    code, out, err = _run(["run", "--local", "--model", tiny_model, "--plan", plan, "--prompt", "x", "--no-record"],
                          capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("edgeshard: error: plan is invalid: ") and reason in err, err


def test_an_invalid_plan_with_an_agents_file_is_refused_before_connecting(tiny_model, tmp_path, capsys,
                                                                          no_agent_may_start):
    plan = _plan_file(tmp_path, "gapped", *BAD_PLANS["gapped"][:2])
    code, _, err = _run(["run", "--agents", _agents_file(tmp_path, ["edge-0", "edge-1"]), "--model", tiny_model,
                         "--plan", plan, "--prompt", "x", "--no-record"], capsys)
    assert code == 2 and err.count("\n") == 1 and "leaves units [2, 3) unassigned" in err, err


def test_a_plan_device_missing_from_the_agents_file_is_named_before_connecting(tiny_model, tmp_path, capsys,
                                                                               no_agent_may_start):
    plan = tmp_path / "plan.json"
    formats.save(plan, plan_from_boundaries("tiny-llama", 6, ["edge-0", "edge-9"], [3]))
    agents = _agents_file(tmp_path, ["edge-0", "edge-1"])
    code, _, err = _run(["run", "--agents", agents, "--model", tiny_model, "--plan", plan, "--prompt", "x",
                         "--no-record"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "edge-9" in err and str(agents) in err and "edge-0, edge-1" in err


def test_a_checkpoint_without_weights_is_refused_before_any_agent_starts(tiny_model, tmp_path, capsys,
                                                                         no_agent_may_start):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny_model / "config.json").read_text())
    plan = tmp_path / "plan.json"
    formats.save(plan, plan_from_boundaries("tiny-llama", 6, ["edge-0", "edge-1"], [3]))
    code, _, err = _run(["run", "--local", "--model", bare, "--plan", plan, "--prompt", "x", "--no-record"], capsys)
    assert code == 2 and err.count("\n") == 1 and "no model.safetensors" in err, err


def _agents_file(folder, devices):
    """An agents.json listing ``devices`` at addresses where nothing listens (never reached)."""
    key = folder / "coordinator.key"
    CurveKeys.generate().save(key)
    server = CurveKeys.generate()
    path = folder / "agents.json"
    path.write_text(json.dumps({"format": AGENTS_FORMAT, "version": 1, "coordinator_key_file": str(key),
                                  "agents": [{"device": d, "control_address": f"tcp://127.0.0.1:{1 + i}",
                                              "public_key": server.public} for i, d in enumerate(devices)]}))
    return path


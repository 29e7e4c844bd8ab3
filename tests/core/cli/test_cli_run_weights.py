"""`edgeshard run --weights`: every stage of the plan runs at that precision on its agent (the plan
recorded with it), and a model its agents cannot quantize is refused in one line before any agent
is started."""

from __future__ import annotations

import pytest

from core import formats
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import plan_from_boundaries
from core.sessions.store import SessionStore
from tests.core.cli.test_cli_run import cli_run_files, run_cli
from tests.entrances import forbid_agents, refused


def test_a_run_with_int4_weights_runs_every_stage_at_int4_and_records_the_plan_with_it(tmp_path):
    model, plan = cli_run_files(tmp_path)
    workspace = tmp_path / "ws.sqlite"
    code, out = run_cli(["run", "--model", model, "--plan", plan, "--local", "--prompt", "the river",
                         "--max-new-tokens", "3", "--weights", "int4", "--workspace", workspace])
    assert code == 0, out
    with SessionStore(workspace) as store:
        [session] = store.sessions()
        [run] = store.runs(session.id)
        assert [s.weights for s in store.plan(run.plan_id).stages] == ["int4", "int4"]
    assert run.status == "completed" and run.figures["tokens"] == 3


def test_int8_weights_for_a_gpt2_model_are_refused_before_any_agent_starts(tmp_path, monkeypatch, capsys):
    forbid_agents(monkeypatch)
    gpt2 = make_model(ModelRecipe(family="gpt2", layers=2, hidden=64, heads=4, vocab=512, seed=1), tmp_path / "g")
    plan = tmp_path / "plan.json"
    formats.save(plan, plan_from_boundaries("g", 4, ["edge-0", "edge-1"], [2]))
    line = refused(["run", "--model", gpt2, "--plan", plan, "--local", "--prompt", "x", "--weights", "int8"], capsys)
    assert "int8 weights" in line and "gpt2" in line and "use fp" in line


@pytest.mark.parametrize("command", ["run", "serve"])
def test_an_unknown_weight_precision_is_refused_in_one_line_by_the_parser(tmp_path, monkeypatch, capsys, command):
    forbid_agents(monkeypatch)
    model, plan = cli_run_files(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        run_cli([command, "--model", model, "--plan", plan, "--local", "--weights", "int2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--weights" in err and "int4" in err

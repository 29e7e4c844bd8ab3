"""`edgeshard run` records the run in the workspace as the Run screen does (real loopback
agents, a generated checkpoint, a real SQLite workspace); ``--no-record`` records nothing."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from core import formats
from core.cli import main as cli_main
from core.models.checkpoints import ModelRecipe, make_model
from core.planning.plan import plan_from_boundaries
from core.sessions.store import SessionStore

DEVICES = ["edge-0", "edge-1"]


def cli_run_files(folder):
    """A tiny checkpoint and a two-stage plan for it: (model dir, plan path)."""
    model = make_model(ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3),
                       folder / "tiny-llama")
    plan = folder / "plan.json"
    formats.save(plan, plan_from_boundaries("tiny-llama", 6, DEVICES, [3]))
    return model, plan


def run_cli(argv) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main([str(a) for a in argv])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One `edgeshard run --local` recorded in a fresh workspace: (workspace, printed output)."""
    folder = tmp_path_factory.mktemp("cli-run")
    model, plan = cli_run_files(folder)
    workspace = folder / "ws.sqlite"
    code, out = run_cli(["run", "--model", model, "--plan", plan, "--local", "--prompt", "the river",
                         "--max-new-tokens", "4", "--mode", "no-bubbles", "--workspace", workspace])
    assert code == 0, out
    return workspace, out


def test_a_cli_run_is_recorded_completed_with_its_events_tokens_and_settings(recorded):
    workspace, out = recorded
    with SessionStore(workspace) as store:
        [session] = store.sessions()
        [run] = store.runs(session.id)
        items = store.timeline(run.id)
        plan = store.plan(run.plan_id)
    assert f"recorded as run {run.id} (session {session.id})" in out
    assert session.name.startswith("edgeshard run")
    assert (run.kind, run.mode, run.status, run.model) == ("measured", "no-bubbles", "completed", "tiny-llama")
    assert run.settings["prompts"] == ["the river"] and run.settings["lanes"] == DEVICES
    assert list(plan.devices()) == DEVICES
    assert {i.event.device for i in items if i.event is not None} == set(DEVICES)
    generated = "".join(i.tokens.text[0] for i in items if i.tokens is not None)
    assert generated and out.startswith(generated + "\nTTFT ") and run.figures["tokens"] == 4


def test_a_cli_run_records_the_bytes_its_agents_sockets_sent_beside_the_cost_models(recorded):
    workspace, out = recorded
    with SessionStore(workspace) as store:
        [run] = store.runs()
    wire = run.figures["wire"]
    hidden = wire["per_link_and_kind"]["edge-0->edge-1 hidden"]
    assert wire["per_link"]["edge-0->edge-1"] == {"measured": hidden, "predicted": wire["per_link"]["edge-0->edge-1"]["predicted"]}
    # 4 hidden frames (the prefill with its mask, 3 decode steps) and 4 token frames back, headers included
    assert hidden == wire["per_link"]["edge-0->edge-1"]["predicted"] and wire["measured_over_predicted"] == 1.0
    assert wire["per_link"]["edge-1->edge-0"]["measured"] > 0 and wire["control_bytes"] > 0
    assert f"wire: {wire['measured_bytes']} bytes between agents" in out


def test_run_json_shows_the_wire_bytes_beside_the_token_ids(tmp_path):
    model, plan = cli_run_files(tmp_path)
    code, out = run_cli(["run", "--model", model, "--plan", plan, "--local", "--prompt", "the river",
                         "--max-new-tokens", "3", "--no-record", "--json"])
    printed = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and len(printed["tokens"][0]) == 3
    assert printed["wire"]["measured_bytes"] == printed["wire"]["predicted_bytes"] > 0


def test_a_cli_run_is_listed_by_edgeshard_sessions(recorded):
    workspace, _ = recorded
    code, out = run_cli(["sessions", "--workspace", workspace])
    assert code == 0
    assert "edgeshard run" in out and "measured" in out and "no-bubbles" in out and "completed" in out


def test_no_record_leaves_the_workspace_alone(tmp_path, monkeypatch):
    workspace = tmp_path / "ws.sqlite"
    monkeypatch.setenv("EDGESHARD_WORKSPACE", str(workspace))
    model, plan = cli_run_files(tmp_path)
    code, out = run_cli(["run", "--model", model, "--plan", plan, "--local", "--prompt", "x",
                         "--max-new-tokens", "2", "--no-record"])
    assert code == 0 and "TTFT" in out and "recorded" not in out
    assert not workspace.exists()


def test_a_workspace_that_is_a_folder_is_refused_before_any_agent_starts(tmp_path, capsys):
    model, plan = cli_run_files(tmp_path)
    code, out = run_cli(["run", "--model", model, "--plan", plan, "--local", "--prompt", "x",
                         "--workspace", tmp_path])
    err = capsys.readouterr().err
    assert code != 0 and "is a directory, expected a workspace file" in err and "Traceback" not in err
    assert "TTFT" not in out


@pytest.fixture
def two_micro_batch_plan(tmp_path):
    """The tiny checkpoint and a plan made for two micro-batches of one sequence: (model dir, plan path)."""
    model, _ = cli_run_files(tmp_path)
    plan = tmp_path / "plan-2mb.json"
    formats.save(plan, plan_from_boundaries("tiny-llama", 6, DEVICES, [3], micro_batch_size=1, micro_batches=2))
    return model, plan


def test_a_sequential_run_uses_the_plans_micro_batches_and_records_where_they_came_from(two_micro_batch_plan,
                                                                                         tmp_path):
    model, plan = two_micro_batch_plan
    workspace = tmp_path / "ws.sqlite"
    code, out = run_cli(["run", "--model", model, "--plan", plan, "--local", "--prompt", "the cat",
                         "--prompt", "a river", "--max-new-tokens", "2", "--mode", "sequential",
                         "--workspace", workspace])
    assert code == 0, out
    assert "micro-batches 2 (the plan)" in out
    with SessionStore(workspace) as store:
        [session] = store.sessions()
        [run] = store.runs(session.id)
    assert run.settings["micro_batches"] == 2 and run.settings["micro_batches_override"] is None
    assert run.settings["plan_micro_batches"] == 2


def test_a_micro_batch_override_is_recorded_with_the_run(two_micro_batch_plan, tmp_path):
    model, plan = two_micro_batch_plan
    workspace = tmp_path / "ws.sqlite"
    code, out = run_cli(["run", "--model", model, "--plan", plan, "--local", "--prompt", "the cat",
                         "--prompt", "a river", "--max-new-tokens", "2", "--mode", "bubbles",
                         "--micro-batches", "1", "--workspace", workspace])
    assert code == 0, out
    assert "micro-batches 1 (--micro-batches)" in out
    with SessionStore(workspace) as store:
        [session] = store.sessions()
        [run] = store.runs(session.id)
    assert run.settings["micro_batches"] == 1 and run.settings["micro_batches_override"] == 1
    assert run.settings["plan_micro_batches"] == 2


def test_a_micro_batch_override_below_one_is_refused_before_any_agent_starts(two_micro_batch_plan, capsys):
    model, plan = two_micro_batch_plan
    code, out = run_cli(["run", "--model", model, "--plan", plan, "--local", "--prompt", "x",
                         "--micro-batches", "0", "--no-record"])
    err = capsys.readouterr().err
    assert code != 0 and "micro-batches" in err and "plan's 2" in err and "Traceback" not in err
    assert "TTFT" not in out


def test_send_weights_cuts_the_model_into_stage_slices_and_sends_them_before_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EDGESHARD_HOME", str(tmp_path / "home"))
    model, plan = cli_run_files(tmp_path)
    code, out = run_cli(["run", "--model", model, "--plan", plan, "--local", "--prompt", "the river",
                         "--max-new-tokens", "3", "--no-record", "--send-weights"])
    err = capsys.readouterr().err
    assert code == 0 and "TTFT" in out, err
    assert "sending stage weights" in err
    slices = sorted(p.name for p in (tmp_path / "home" / "stage-weights").iterdir())
    assert len(slices) == 2 and slices[0].endswith("-units-0-3") and slices[1].endswith("-units-3-6")


def test_on_failure_replan_without_the_planning_problem_is_refused_before_any_agent_starts(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    formats.save(plan, plan_from_boundaries("tiny-llama", 6, DEVICES, [3]))
    code, out = run_cli(["run", "--model", tmp_path / "nowhere", "--plan", plan, "--local", "--prompt", "x",
                         "--on-failure", "replan", "--no-record"])
    err = capsys.readouterr().err
    assert code == 2 and "--on-failure" in err and "--problem" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "TTFT" not in out


def test_origin_with_no_record_is_refused_before_any_agent_starts(tmp_path, capsys):
    """--origin only records the run's origin: with --no-record it would be ignored unread."""
    plan = tmp_path / "plan.json"
    formats.save(plan, plan_from_boundaries("tiny-llama", 6, DEVICES, [3]))
    code, out = run_cli(["run", "--model", tmp_path / "nowhere", "--plan", plan, "--local", "--prompt", "x",
                         "--origin", tmp_path / "problem.json", plan, "--no-record"])
    err = capsys.readouterr().err
    assert code == 2 and "--origin" in err and "--no-record" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "TTFT" not in out


def test_on_failure_replan_with_a_problem_for_another_model_is_refused(tmp_path, capsys):
    from core.planning.scenarios import DeviceSpec, synthetic_problem

    plan = tmp_path / "plan.json"
    formats.save(plan, plan_from_boundaries("tiny-llama", 6, DEVICES, [3]))
    problem = tmp_path / "problem.json"
    formats.save(problem, synthetic_problem([DeviceSpec(id=d, tflops=1, memory_bandwidth_gb_s=10, memory_gib=8)
                                             for d in DEVICES], "llama-2-7b"))
    code, _ = run_cli(["run", "--model", tmp_path / "nowhere", "--plan", plan, "--local", "--prompt", "x",
                       "--on-failure", "replan", "--problem", problem, "--no-record"])
    err = capsys.readouterr().err
    assert code == 2 and "llama-2-7b" in err and "tiny-llama" in err and "Traceback" not in err

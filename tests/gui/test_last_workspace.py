"""Reopening the studio restores the last workspace (issue item 4): workspace, profile, plan and
Run settings; a missing or damaged part is a status message, the rest is still restored."""

from __future__ import annotations

from core import formats
from core.planning.plan import ShardPlan, Stage
from core.planning.problem import with_changes
from gui import app as studio_app
from gui.last_workspace import PLAN_FILE, PROBLEM_FILE, RUN_SETTINGS_KEY
from gui.main_window import MainWindow
from gui.screens.run import RunSettings
from tests.gui.problems import make_problem


def _open(qtbot) -> MainWindow:
    w = MainWindow()
    qtbot.addWidget(w)
    w.restore_last_workspace()
    return w


def _two_stage_plan(problem) -> ShardPlan:
    n = problem.profile.model.num_units
    return ShardPlan(model=problem.profile.model.name, num_units=n,
                     stages=(Stage(device="phone", start=0, end=4), Stage(device="server", start=4, end=n)))


def test_reopening_restores_the_workspace_profile_plan_and_run_settings(isolated, qtbot, tmp_path):
    first = _open(qtbot)
    workspace = tmp_path / "lab.edgeshard"
    workspace.touch()
    first.open_workspace(str(workspace))
    problem = with_changes(make_problem(), excluded_devices=("laptop",), memory_headroom=0.1)
    first.state.set_profile(problem.profile, source=problem.source, workload=problem.workload)
    first.state.set_problem(problem)
    plan = _two_stage_plan(problem)
    first.state.set_plan(plan)
    settings = RunSettings(model_dir=str(tmp_path), prompts=("one prompt", "another"), max_new_tokens=7,
                           mode="no-bubbles", micro_batches=2, send_weights=True, repetition_penalty=1.25,
                           no_repeat_ngram_size=3)
    first.screens.run.apply_settings(settings)
    first.close()

    second = _open(qtbot)
    assert second.state.workspace == str(workspace.resolve())
    assert second.state.problem == problem
    assert second.state.plan == plan
    assert second.screens.run.settings() == settings
    assert second.screens.plan_editor.source_combo.currentText() == "phone"
    second.close()


def test_a_damaged_plan_file_is_a_status_message_and_the_profile_is_still_restored(isolated, qtbot):
    problem = make_problem()
    isolated.mkdir(parents=True)
    formats.save(isolated / PROBLEM_FILE, problem)
    (isolated / PLAN_FILE).write_text('{"format": "edgeshard.plan", "version": 1, "stages": [')
    window = _open(qtbot)
    assert window.state.problem == problem
    message = window.statusBar().currentMessage()
    assert "last plan was not restored" in message and "not valid JSON" in message
    assert "Auto-solve" in message  # what to do
    window.close()


def test_a_plan_for_another_model_or_unknown_devices_is_not_restored(isolated, qtbot):
    problem = make_problem()
    isolated.mkdir(parents=True)
    formats.save(isolated / PROBLEM_FILE, problem)
    plan = _two_stage_plan(problem)
    formats.save(isolated / PLAN_FILE, ShardPlan(model=plan.model, num_units=plan.num_units,
                                                 stages=(plan.stages[0], Stage(device="gone", start=4, end=plan.num_units))))
    window = _open(qtbot)
    assert window.state.plan is None or "gone" not in window.state.plan.devices()
    assert "devices the profile does not have: gone" in window.statusBar().currentMessage()
    window.close()


def test_a_missing_workspace_and_bad_run_settings_are_said_and_defaults_kept(isolated, qtbot, tmp_path):
    s = studio_app.settings()
    s.setValue("last/workspace", str(tmp_path / "deleted.edgeshard"))
    s.setValue(RUN_SETTINGS_KEY, '{"model_dir": "", "prompts": ["x"], "max_new_tokens": -3, "mode": "sequential"}')
    window = _open(qtbot)
    message = window.statusBar().currentMessage()
    assert "deleted.edgeshard is gone" in message
    assert "max_new_tokens = -3 is not valid" in message
    assert window.state.workspace == ""
    assert window.screens.run.max_tokens_spin.value() == 32  # the default
    window.close()


def test_a_window_that_did_not_restore_keeps_nothing(isolated, qtbot):
    """Tests' windows and the demo's leave the operator's last workspace alone."""
    window = MainWindow()
    qtbot.addWidget(window)
    problem = make_problem()
    window.state.set_profile(problem.profile, source=problem.source, workload=problem.workload)
    window.close()
    assert not (isolated / PROBLEM_FILE).exists()


def test_a_plan_that_no_longer_fits_is_not_restored_and_a_feasible_one_is_solved(isolated, qtbot):
    from core.planning.cost import evaluate
    from tests.gui.problems import MiB

    problem = make_problem(phone_memory=100 * MiB)  # the model does not fit the source alone
    isolated.mkdir(parents=True)
    formats.save(isolated / PROBLEM_FILE, problem)
    n = problem.profile.model.num_units
    formats.save(isolated / PLAN_FILE, ShardPlan(model=problem.profile.model.name, num_units=n,
                                                 stages=(Stage(device="phone", start=0, end=n),)))
    window = _open(qtbot)
    assert "it does not fit the profile" in window.statusBar().currentMessage()
    qtbot.waitUntil(lambda: evaluate(problem, window.state.plan).feasible, timeout=60_000)
    window.close()

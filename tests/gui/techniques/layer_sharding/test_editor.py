"""The plan editor: hand edits re-predict at once, violations say why, undo restores."""

from __future__ import annotations

import json

import msgspec
import pytest
from PySide6.QtCore import QEvent, QPointF, Qt
from PySide6.QtGui import QMouseEvent
from PySide6.QtWidgets import QApplication, QMessageBox

from core import formats
from core.planning.cost import evaluate
from core.planning.plan import plan_from_boundaries
from core.planning.solvers.comparison import run_strategy
from gui.techniques.layer_sharding.editor import PlanEditorPanel
from gui.studio_state import StudioState
from tests.gui.problems import MiB, make_problem


@pytest.fixture
def editor(qtbot):
    state = StudioState()
    panel = PlanEditorPanel(state)
    qtbot.addWidget(panel)
    panel.resize(1200, 800)
    panel.show()
    qtbot.waitExposed(panel)
    yield panel
    panel.shutdown()


def two_stage(problem, boundary=5):
    return plan_from_boundaries(problem.profile.model.name, problem.profile.model.num_units, ["phone", "server"], [boundary])


def drag(widget, start: QPointF, end: QPointF) -> None:
    """A real press–move–release sequence with the left button held during the move."""
    for kind, pos, buttons in (
        (QEvent.MouseButtonPress, start, Qt.LeftButton),
        (QEvent.MouseMove, QPointF((start.x() + end.x()) / 2, end.y()), Qt.LeftButton),
        (QEvent.MouseMove, end, Qt.LeftButton),
        (QEvent.MouseButtonRelease, end, Qt.NoButton),
    ):
        ev = QMouseEvent(kind, pos, widget.mapToGlobal(pos), Qt.LeftButton, buttons, Qt.NoModifier)
        QApplication.sendEvent(widget, ev)


def test_new_problem_starts_with_everything_on_the_source_device(editor):
    problem = make_problem(phone_memory=64 * 2**30)
    editor.state.set_problem(problem)
    assert editor.state.plan.devices() == ("phone",)
    assert editor.cost.feasible
    assert editor.latency_card.text().endswith("ms")


def test_dragging_a_boundary_moves_units_and_changes_predicted_latency(editor, qtbot):
    problem = make_problem()
    editor.state.set_problem(problem)
    editor.push_plan(two_stage(problem, 5), "start")
    before_latency = editor.cost.latency_per_token_s
    strip = editor.strip
    start = strip.boundary_point(1)
    end = QPointF(strip.unit_x(3), start.y())
    drag(strip, start, end)
    plan = editor.state.plan
    assert plan.stages[1].start == 3 and plan.stages[0].end == 3
    # more units on the fast server: lower latency, and the card shows the new figure
    assert editor.cost.latency_per_token_s < before_latency
    assert editor.cost == evaluate(editor.state.problem, plan)
    assert editor.latency_card.text() == f"{editor.cost.latency_per_token_s * 1e3:.1f} ms"


def test_undo_restores_the_plan_before_a_drag_and_redo_reapplies_it(editor):
    problem = make_problem()
    editor.state.set_problem(problem)
    editor.push_plan(two_stage(problem, 5), "start")
    strip = editor.strip
    drag(strip, strip.boundary_point(1), QPointF(strip.unit_x(7), strip.boundary_point(1).y()))
    moved = editor.state.plan
    assert moved.stages[1].start == 7
    editor.undo_button.click()
    assert editor.state.plan == two_stage(problem, 5)
    assert editor.stage_table.item(1, 2).text() == "[5, 10)"
    editor.redo_button.click()
    assert editor.state.plan == moved


def test_over_memory_stage_shows_its_reason_in_red(editor):
    problem = make_problem(phone_memory=300 * MiB)
    editor.state.set_problem(problem)
    editor.push_plan(two_stage(problem, 6), "start")
    cost = editor.cost
    assert not cost.feasible
    text = editor.violations.text()
    assert editor.violations.isVisible()
    assert "phone: needs" in text and "budget" in text
    assert 0 in editor.strip._bad_stages
    assert editor.status_card.text() == "1 violated"
    # moving units off the phone fixes it
    editor._on_strip_boundary_moved(1, 2)
    assert editor.cost.feasible and not editor.violations.isVisible()


def test_choosing_a_device_used_by_another_stage_swaps_them(editor):
    problem = make_problem()
    editor.state.set_problem(problem)
    editor.push_plan(plan_from_boundaries("tiny-llama", 10, ["phone", "laptop", "server"], [2, 6]), "start")
    combo = editor.stage_table.cellWidget(1, 1)
    combo.setCurrentIndex(combo.findData("server"))
    assert editor.state.plan.devices() == ("phone", "server", "laptop")


def test_source_constraint_violation_names_the_source(editor):
    problem = make_problem()
    editor.state.set_problem(problem)
    editor.push_plan(two_stage(problem), "start")
    editor.source_combo.setCurrentIndex(editor.source_combo.findData("laptop"))
    assert editor.state.problem.source == "laptop"
    assert any("source device is 'laptop'" in v for v in editor.cost.violations)


def test_excluding_a_used_device_is_a_violation(editor):
    problem = make_problem()
    editor.state.set_problem(problem)
    editor.push_plan(two_stage(problem), "start")
    item = editor.excluded_list.findItems("server", Qt.MatchExactly)[0]
    item.setCheckState(Qt.Checked)
    assert editor.state.problem.excluded_devices == ("server",)
    assert any("'server' is excluded" in v for v in editor.cost.violations)


def test_add_and_remove_stage_are_undoable(editor):
    problem = make_problem()
    editor.state.set_problem(problem)
    editor.add_button.click()
    assert len(editor.state.plan.stages) == 2
    editor.stage_table.selectRow(1)
    editor.remove_button.click()
    assert len(editor.state.plan.stages) == 1
    editor.undo_stack.undo()
    editor.undo_stack.undo()
    assert editor.state.plan.devices() == ("phone",)


def test_compare_adopts_the_chosen_strategy(editor):
    problem = make_problem()
    editor.state.set_problem(problem)
    plans = [two_stage(problem, 3), plan_from_boundaries("tiny-llama", 10, ["phone", "laptop", "server"], [1, 4])]
    results = [run_strategy(problem, "even", "latency"), run_strategy(problem, "even", "latency")]
    results = [msgspec.structs.replace(r, strategy=f"s{i}", plan=p, cost=evaluate(problem, p))
               for i, (r, p) in enumerate(zip(results, plans))]
    editor.show_comparison(results)
    assert editor.compare_table.rowCount() == 2
    editor.compare_table.cellWidget(1, 3).click()
    assert editor.state.plan == plans[1]
    editor.undo_stack.undo()
    assert editor.state.plan.devices() == ("phone",)


def test_saved_plan_loads_back_and_a_bad_file_is_refused(editor, tmp_path, qtbot):
    problem = make_problem()
    editor.state.set_problem(problem)
    editor.push_plan(two_stage(problem, 4), "start")
    path = tmp_path / "plan.json"
    editor.save_plan_file(str(path))
    assert json.loads(path.read_text())["format"] == "edgeshard.plan"
    editor.undo_stack.undo()
    editor.load_plan_file(str(path))
    assert editor.state.plan == two_stage(problem, 4)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "edgeshard.profile"}')
    editor.load_plan_file(str(bad))
    assert editor.state.plan == two_stage(problem, 4)
    box = editor.findChild(QMessageBox, "errorDialog")
    assert box is not None and "expected format 'edgeshard.plan'" in box.text()
    box.close()


def test_auto_solve_runs_in_a_worker_and_adopts_the_optimal_plan(editor, qtbot):
    problem = make_problem()
    editor.state.set_problem(problem)
    with qtbot.waitSignal(editor._solve_runner.task_finished, timeout=60_000):
        editor.solve_button.click()
    from core.planning.solvers import solve_min_latency

    assert editor.state.plan == solve_min_latency(problem).plan
    assert editor.cost.feasible
    assert "proven optimal" in editor.solve_status.text()
    editor.undo_stack.undo()
    assert editor.state.plan.devices() == ("phone",)


def test_compare_lists_every_strategy_and_charts_them(editor, qtbot):
    from core.planning.solvers import STRATEGIES

    problem = make_problem()
    editor.state.set_problem(problem)
    with qtbot.waitSignal(editor._solve_runner.task_finished, timeout=60_000):
        editor.compare_button.click()
    names = [editor.compare_table.item(r, 0).text().split(" — ")[0] for r in range(editor.compare_table.rowCount())]
    assert sorted(names) == sorted(STRATEGIES) and names[0] == "edgeshard"
    best = editor.comparison[0]
    assert all(r.cost is None or r.cost.latency_per_token_s >= best.cost.latency_per_token_s - 1e-12
               for r in editor.comparison if r.status in ("optimal", "ok"))
    import pyqtgraph as pg
    assert len([i for i in editor.compare_plot.ci.items if isinstance(i, pg.PlotItem)]) == 2  # latency, tokens/s


def test_the_compare_charts_legend_names_each_bar_colour(editor, qtbot):
    from gui.app import theme_colors

    editor.state.set_problem(make_problem())
    with qtbot.waitSignal(editor._solve_runner.task_finished, timeout=60_000):
        editor.compare_button.click()
    legend = editor.compare_legend.text()
    c = theme_colors()
    for key, words in (("ok", "current plan"), ("accent", "other strategy"), ("error", "does not fit")):
        assert f"color:{c[key]}'>■</span>&nbsp;{words.replace(' ', '&nbsp;')}" in legend


def test_compare_shows_the_core_outcome_of_each_strategy_an_oom_one_in_red_with_its_overflow(editor, qtbot):
    from core.planning.solvers.comparison import compare

    problem = make_problem(phone_memory=100 * MiB)
    editor.state.set_problem(problem)  # the model does not fit its source: solved at once
    qtbot.waitUntil(lambda: not editor._solve_runner.is_busy(), timeout=60_000)
    with qtbot.waitSignal(editor._solve_runner.task_finished, timeout=60_000):
        editor.compare_button.click()
    assert editor.comparison == [msgspec.structs.replace(o, elapsed_s=r.elapsed_s)
                                 for o, r in zip(compare(problem, "latency"), editor.comparison)]
    rows = {editor.compare_table.item(r, 0).text().split(" — ")[0]: r for r in range(editor.compare_table.rowCount())}
    even = editor.compare_table.item(rows["even"], 0)
    assert "OOM: phone +141.50 MiB" in even.text()
    assert even.foreground().color().name() != editor.compare_table.item(rows["memory-proportional"], 0).foreground().color().name()
    assert "proven optimal" in editor.compare_table.item(rows["edgeshard"], 0).text()


def test_the_strip_is_editable_from_the_keyboard(editor, qtbot):
    problem = make_problem()
    editor.state.set_problem(problem)
    editor.push_plan(plan_from_boundaries("tiny-llama", 10, ["phone", "laptop", "server"], [3, 6]), "start")
    editor.strip.setFocus()
    qtbot.keyClick(editor.strip, Qt.Key_Right)
    assert [s.start for s in editor.state.plan.stages] == [0, 4, 6]
    qtbot.keyClick(editor.strip, Qt.Key_Down)  # the next boundary
    qtbot.keyClick(editor.strip, Qt.Key_Left)
    assert [s.start for s in editor.state.plan.stages] == [0, 4, 5]
    qtbot.keyClick(editor.strip, Qt.Key_Left)  # would empty stage 1: refused
    assert [s.start for s in editor.state.plan.stages] == [0, 4, 5]
    editor.undo_stack.undo()
    assert [s.start for s in editor.state.plan.stages] == [0, 4, 6]


def test_throughput_solve_shows_its_micro_batching(editor, qtbot):
    problem = make_problem()
    editor.state.set_problem(problem)
    editor.objective_combo.setCurrentIndex(editor.objective_combo.findData("throughput"))
    editor.batch_spin.setValue(4)  # four sequences to serve: worth pipelining micro-batches
    with qtbot.waitSignal(editor._solve_runner.task_finished, timeout=60_000):
        editor.solve_button.click()
    plan = editor.state.plan
    from core.planning.solvers import solve_max_throughput

    assert plan == solve_max_throughput(editor.state.problem).plan
    assert plan.micro_batches * plan.micro_batch_size == 4 and len(plan.stages) > 1
    assert f"({plan.micro_batches} × {plan.micro_batch_size})" in editor.throughput_card.text()
    assert editor.throughput_card.text().startswith(f"{editor.cost.throughput_tokens_s:.1f} tok/s")


def test_a_constraint_the_problem_refuses_is_shown_inline_and_not_applied(editor):
    problem = make_problem()
    fixed = msgspec.structs.replace(problem, workload=msgspec.structs.replace(
        problem.workload, batch_size=4, micro_batch_size=2))
    editor.state.set_problem(fixed)
    editor.batch_spin.setValue(1)  # smaller than the fixed micro-batch size of 2
    assert editor.state.problem.workload.batch_size == 4
    assert "$.workload.micro_batch_size" in editor.violations.text()


def test_auto_solve_and_compare_before_profiling_say_what_is_missing(qtbot):
    state = StudioState()
    panel = PlanEditorPanel(state)
    qtbot.addWidget(panel)
    logged = []
    state.log_added.connect(lambda level, text: logged.append((level, text)))
    panel.auto_solve()
    assert "no profile" in panel.solve_status.text() and "Profile cluster" in panel.solve_status.text()
    panel.solve_status.setText("")
    panel.compare()
    assert "no profile" in panel.solve_status.text()
    assert [level for level, _ in logged] == ["warning", "warning"]


def test_a_comparison_made_for_another_problem_cannot_be_adopted(editor):
    problem = make_problem()
    editor.state.set_problem(problem)
    plan = plan_from_boundaries("tiny-llama", 10, ["phone", "laptop", "server"], [1, 4])
    result = msgspec.structs.replace(run_strategy(problem, "even", "latency"), strategy="s0", plan=plan,
                                     cost=evaluate(problem, plan))
    editor.show_comparison([result])
    editor.state.set_problem(make_problem(phone_memory=600 * MiB))  # a new profile: the comparison is stale
    button = editor.compare_table.cellWidget(0, 3)
    assert not button.isEnabled() and "Stale" in button.toolTip()
    before = editor.state.plan
    editor.adopt(0)
    assert editor.state.plan == before and "Compare again" in editor.solve_status.text()


def test_a_plan_on_an_offline_device_is_flagged_naming_it_and_clears_when_it_is_back(editor):
    problem = make_problem()
    editor.state.set_problem(problem)
    editor.state.set_plan(two_stage(problem))
    assert editor.status_card.text() == "all satisfied"
    editor.state.set_offline(("server",))
    assert editor.status_card.text() == "1 violated"
    assert "'server', which is offline" in editor.violations.text()
    editor.state.set_offline(("laptop",))  # the plan avoids it: nothing to flag
    assert editor.status_card.text() == "all satisfied"


def test_auto_solve_leaves_offline_devices_out(editor, qtbot):
    from core.planning.problem import without_offline
    from core.planning.solvers import solve_min_latency

    problem = make_problem()
    editor.state.set_problem(problem)
    assert "server" in solve_min_latency(problem).plan.devices()  # online, the optimum uses it
    editor.state.set_offline(("server",))
    with qtbot.waitSignal(editor._solve_runner.task_finished, timeout=60_000):
        editor.solve_button.click()
    assert "server" not in editor.state.plan.devices()
    assert editor.state.plan == solve_min_latency(without_offline(problem, ("server",))).plan
    assert editor.status_card.text() == "all satisfied"


@pytest.mark.parametrize("width", [520, 260])
def test_stage_labels_fit_above_the_strip_without_overlapping(qtbot, width):
    """The strip is ~520 px wide at 1024x700: the last stage (one unit of ten) read "2: edge…".
    A label now uses free space beside a narrow stage and, only where even that is too little,
    a shorter form; the labels never overlap nor leave the strip."""
    from gui.widgets.unit_strip import UnitStripView

    problem = make_problem()
    strip = UnitStripView()
    qtbot.addWidget(strip)
    strip.resize(width, 88)
    strip.set_plan(problem.profile.model,
                   plan_from_boundaries("tiny-llama", 10, ["edge-a", "edge-b", "edge-c"], [4, 9]))
    labels = strip.stage_labels()
    texts = [text for _rect, text, _full in labels]
    if width == 520:
        assert texts == ["0: edge-a  (4)", "1: edge-b  (5)", "2: edge-c  (1)"]
    else:
        assert all("edge-" in t and "…" not in t for t in texts), texts  # shorter forms, each naming its device
    fm = strip.fontMetrics()
    for (rect, text, _full), (nxt, _t, _f) in zip(labels, labels[1:]):
        assert rect.right() < nxt.left()
    for rect, text, _full in labels:
        assert rect.left() >= 0 and rect.right() <= width and rect.width() >= fm.horizontalAdvance(text)


def test_a_profile_whose_source_cannot_hold_the_model_gets_a_solved_plan_with_nothing_to_undo(editor, qtbot):
    editor.state.set_problem(make_problem(phone_memory=100 * MiB))
    qtbot.waitUntil(lambda: len(editor.own_plan.stages) > 1, timeout=60_000)
    assert evaluate(editor.state.problem, editor.own_plan).feasible
    assert not editor.undo_stack.canUndo()


def test_compare_rows_that_do_not_fit_cannot_be_adopted(editor, qtbot):
    editor.state.set_problem(make_problem(phone_memory=100 * MiB))
    qtbot.waitUntil(lambda: not editor._solve_runner.is_busy(), timeout=60_000)
    with qtbot.waitSignal(editor._solve_runner.task_finished, timeout=60_000):
        editor.compare_button.click()
    adopt = {r.strategy: editor.compare_table.cellWidget(i, 3) for i, r in enumerate(editor.comparison)}
    assert not adopt["even"].isEnabled() and "cannot run here" in adopt["even"].toolTip()
    assert adopt["edgeshard"].isEnabled()


def test_another_techniques_plan_being_run_leaves_the_editors_plan_and_its_solve_line(editor, qtbot):
    from core.planning.plan import Stage

    editor.state.set_problem(make_problem())
    layered = plan_from_boundaries("tiny-llama", 10, ["phone", "laptop", "server"], [3, 6])
    editor.push_plan(layered, "start")
    dense = msgspec.structs.replace(layered, stages=(Stage(device="server", start=0, end=10,
                                                           kind="attention-offload-dense"),))
    editor.state.set_plan(dense)
    assert editor.own_plan == layered and editor.strip._plan == layered
    editor.undo_stack.undo()  # undo reaches the layer plan before, never the other technique's
    assert {s.kind for s in editor.own_plan.stages} == {"layers"} and editor.own_plan != layered

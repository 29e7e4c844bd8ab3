"""Every screen fits a real screen (issue item 8): usable at 1024x700 with no clipped control,
and the whole Run page (lanes, axis, figures) visible at 1440x900 without scrolling."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, QPointF, QRect
from PySide6.QtWidgets import (QAbstractButton, QAbstractSlider, QAbstractSpinBox, QComboBox, QLineEdit,
                               QScrollBar, QWidget)

from agents.protocol import TimelineEvent
from gui.main_window import SCREENS, MainWindow
from tests.gui.problems import make_problem
from tests.gui.techniques.spatial_solving import solved

CONTROLS = (QAbstractButton, QLineEdit, QAbstractSpinBox, QComboBox, QAbstractSlider)


def _show(window: MainWindow, qtbot, width: int, height: int) -> None:
    window.resize(width, height)
    window.show()
    qtbot.waitExposed(window)
    qtbot.wait(50)  # layouts and the screen's scroll area settle


def _rect_in_window(widget: QWidget, window: QWidget) -> QRect:
    return QRect(widget.mapTo(window, QPoint(0, 0)), widget.size())


def _visible_rect(widget: QWidget, window: QWidget) -> QRect:
    """The part of the window where ``widget`` can show: every ancestor clips its children."""
    rect = QRect(0, 0, window.width(), window.height())
    parent = widget.parentWidget()
    while parent is not None and parent is not window:
        rect = rect.intersected(_rect_in_window(parent, window))
        parent = parent.parentWidget()
    return rect


def clipped_controls(window: MainWindow, screen: QWidget) -> list[str]:
    """Visible controls of ``screen`` that are cut off, scrolled away or smaller than their minimum."""
    bad = []
    for c in screen.findChildren(QWidget):
        if not isinstance(c, CONTROLS) or isinstance(c, QScrollBar) or not c.isVisible():
            continue
        if isinstance(c.parentWidget(), (QAbstractSpinBox, QComboBox)):
            continue  # a spin box's or combo's own editor
        name = c.accessibleName() or getattr(c, "text", lambda: "")() or type(c).__name__
        rect = _rect_in_window(c, window)
        if not _visible_rect(c, window).contains(rect):
            bad.append(f"{name}: cut off at {rect.getRect()}")
        hint = c.minimumSizeHint()
        if c.width() < hint.width() or c.height() < hint.height():
            bad.append(f"{name}: {c.width()}x{c.height()} below its minimum {hint.width()}x{hint.height()}")
    return bad


@pytest.mark.parametrize("title", SCREENS)
def test_no_control_is_clipped_at_1024x700(window, qtbot, title):
    problem = make_problem()  # violates a constraint: the Plan screen shows its banner too
    window.state.set_profile(problem.profile, source=problem.source, workload=problem.workload)
    for monitor in (window.screens.run.monitor, window.screens.sessions.monitor):
        monitor.reset(["phone", "laptop", "server"], ("a prompt",))  # a run's lanes and utilisation bars
    _show(window, qtbot, 1024, 700)
    screen = dict(window.screens.titled())[title]
    window.show_screen(screen)
    qtbot.wait(50)
    assert clipped_controls(window, screen) == []
    area = window.stack.currentWidget()
    assert not area.verticalScrollBar().isVisible() and not area.horizontalScrollBar().isVisible()


def test_a_start_refusal_leaves_the_serve_toggle_and_the_message_on_screen_at_1024x700(window, qtbot):
    _show(window, qtbot, 1024, 700)
    run = window.screens.run
    window.show_screen(run)
    run.start_run()  # no cluster: refused with a message of several lines under the settings
    assert run.message.isVisible()
    qtbot.wait(50)
    area = window.stack.currentWidget()
    assert not area.verticalScrollBar().isVisible()  # the page did not scroll the Serve row away
    toggle = run.serve_panel.toggle
    assert _visible_rect(toggle, window).contains(_rect_in_window(toggle, window))
    qtbot.waitUntil(lambda: _visible_rect(run.message, window).contains(_rect_in_window(run.message, window)))


def test_no_control_is_clipped_at_1024x700_in_any_techniques_plan_view(window, qtbot):
    _show(window, qtbot, 1024, 700)
    plan = window.screens.plan
    window.show_screen(plan)
    assert len(plan.available()) > 1  # before a model is known, every technique's view is offered
    for technique in plan.available():
        plan.set_technique(technique)
        qtbot.wait(50)
        assert (technique, clipped_controls(window, plan)) == (technique, [])


def test_the_whole_run_page_shows_without_scrolling_at_1440x900(window, qtbot):
    _show(window, qtbot, 1440, 900)
    run = window.screens.run
    window.show_screen(run)
    lanes = ["edge-a", "edge-b", "edge-c"]
    run.monitor.reset(lanes, ("a prompt",))
    run.monitor.add_timeline_events([
        TimelineEvent(device=d, stage=i, kind="compute", phase="prefill", step=0, micro_batch=0,
                      start_s=0.01 * i, end_s=0.01 * i + 0.008)
        for i, d in enumerate(lanes)])
    run.monitor.flush()
    qtbot.wait(50)
    area = window.stack.currentWidget()
    assert not area.verticalScrollBar().isVisible() and not area.horizontalScrollBar().isVisible()
    monitor = run.monitor
    shown = [monitor.timeline.plot_widget, monitor.ttft_card, monitor.latency_card, monitor.rate_card,
             monitor.tokens_card, monitor.rate_plot, monitor.text_edit, *monitor.util_bars.values()]
    for w in shown:
        assert w.isVisible() and _visible_rect(w, window).contains(_rect_in_window(w, window)), w.accessibleName()
    assert monitor.timeline.lanes() == lanes
    plot = monitor.timeline.measured_plot
    top, bottom = plot.getViewBox().viewRange()[1]
    assert top <= 0 and bottom >= len(lanes)  # every lane in view (lane i spans i..i+1)
    assert plot.getAxis("bottom").isVisible() and plot.getAxis("left").isVisible()
    assert clipped_controls(window, run) == []


def _two_runs_compared(window, qtbot, tmp_path, width: int, height: int):
    from core.runs.simulator import simulate
    from core.sessions.recording import record_simulation
    from core.sessions.store import SessionStore
    from tests.gui.run_backends import simulated_run

    problem, plan, _, _ = simulated_run(generated_tokens=4)
    path = str(tmp_path / "ws.sqlite")
    with SessionStore(path) as store:
        sid = store.create_session("bench")
        for mode in ("sequential", "no-bubbles"):
            record_simulation(store, sid, problem, plan, simulate(problem, plan, mode, generated_tokens=4))
    window.open_workspace(path)
    _show(window, qtbot, width, height)
    sessions = window.screens.sessions
    window.show_screen(sessions)
    qtbot.waitUntil(lambda: len(sessions.run_items()) == 2, timeout=30_000)
    for item in sessions.run_items().values():
        item.setSelected(True)
    with qtbot.waitSignal(sessions.runs_compared, timeout=30_000):
        sessions.compare_button.click()
    qtbot.wait(50)
    return sessions


def _lane_px(view) -> float:
    vb = view.measured_plot.getViewBox()
    return abs(vb.mapViewToDevice(QPointF(0, 1)).y() - vb.mapViewToDevice(QPointF(0, 0)).y())


def test_two_compared_runs_lanes_are_a_line_of_text_apart_at_1024x700(window, qtbot, tmp_path):
    comparison = _two_runs_compared(window, qtbot, tmp_path, 1024, 700).comparison
    for view in (comparison.timeline_a, comparison.timeline_b):
        assert len(view.lanes()) == 3
        assert _lane_px(view) >= view.fontMetrics().height() * 1.2, "lane names overlap"


@pytest.mark.parametrize("size", [(1024, 700), (1600, 1000)])
def test_the_compared_runs_figures_table_covers_neither_timeline(window, qtbot, tmp_path, size):
    comparison = _two_runs_compared(window, qtbot, tmp_path, *size).comparison
    table = QRect(comparison.table.mapTo(comparison, QPoint(0, 0)), comparison.table.size())
    for view in (comparison.timeline_a, comparison.timeline_b):
        plot = view.plot_widget
        rect = QRect(plot.mapTo(comparison, QPoint(0, 0)), plot.size())
        assert not rect.intersects(table)
        drawn = plot.mapFromScene(view.measured_plot.sceneBoundingRect()).boundingRect()
        assert drawn.right() <= plot.viewport().width() + 1, "the plot is drawn past its view"


def test_two_runs_compared_fit_the_sessions_screen_at_1024x700(window, qtbot, tmp_path):
    sessions = _two_runs_compared(window, qtbot, tmp_path, 1024, 700)
    area = window.stack.currentWidget()
    assert not area.verticalScrollBar().isVisible() and not area.horizontalScrollBar().isVisible()
    assert clipped_controls(window, sessions) == []


def test_attention_offloadings_pickers_wrap_at_1024x700_and_keep_one_row_at_1600x1000(window, qtbot):
    plan = window.screens.plan
    _show(window, qtbot, 1024, 700)
    window.show_screen(plan)
    plan.set_technique("attention-offload")
    qtbot.wait(50)
    view = plan.view
    area = window.stack.currentWidget()
    assert not area.horizontalScrollBar().isVisible(), "the pickers' row widened the screen past the window"
    assert clipped_controls(window, plan) == [] and view.controls.wrapped
    _show(window, qtbot, 1600, 1000)
    qtbot.wait(50)
    assert not view.controls.wrapped


def test_the_plan_screens_strategy_comparison_keeps_its_names_apart_at_1024x700(window, qtbot):
    from tests.gui.problems import make_problem as problem_of

    problem = problem_of()
    window.state.set_profile(problem.profile, source=problem.source, workload=problem.workload)
    _show(window, qtbot, 1024, 700)
    window.show_screen(window.screens.plan)
    editor = window.screens.plan.view
    with qtbot.waitSignal(editor._solve_runner.task_finished, timeout=60_000):
        editor.compare()
    qtbot.wait(50)
    assert len(editor.comparison) >= 8
    assert not editor.compare_rows_overlap()  # the chart scrolls rather than squeezing its rows


def test_no_text_of_the_profiles_memory_chart_is_cut_off_at_1024x700(window, qtbot):
    import pyqtgraph as pg

    from core.planning.scenarios import DeviceSpec, synthetic_problem

    # a model bigger than every budget: its weights line is the chart's top
    problem = synthetic_problem([DeviceSpec(id="nx", name="NX", tflops=12, memory_bandwidth_gb_s=100, memory_gib=6),
                                 DeviceSpec(id="srv", name="Server", tflops=70, memory_bandwidth_gb_s=900,
                                            memory_gib=20)], "llama-2-13b")
    window.state.set_profile(problem.profile, source=problem.source, workload=problem.workload)
    _show(window, qtbot, 1024, 700)
    profile = window.screens.profile
    window.show_screen(profile)
    qtbot.wait(50)
    mem = profile.memory_plot
    assert "model weights" in mem.titleLabel.text
    view = mem.getViewBox().sceneBoundingRect()
    texts = [i for i in mem.getViewBox().allChildren() if isinstance(i, pg.TextItem) and i.isVisible()]
    assert texts
    for t in texts:
        assert view.contains(t.sceneBoundingRect()), t.toPlainText()


def test_the_empty_strategy_charts_hint_is_whole_at_1024x700(window, qtbot):
    problem = make_problem()
    window.state.set_profile(problem.profile, source=problem.source, workload=problem.workload)
    _show(window, qtbot, 1024, 700)
    window.show_screen(window.screens.plan)
    qtbot.wait(50)
    editor = window.screens.plan.view
    chart = editor.compare_plot
    hint = chart.mapFromScene(editor.compare_hint.item.sceneBoundingRect()).boundingRect()
    assert chart.viewport().rect().contains(hint)


def test_the_plan_tables_memory_bars_show_their_whole_text_at_1024x700(window, qtbot):
    """At 1024x700 the stage table's last column, "Memory vs budget", was squeezed to ~40 px: its
    bars read "3.83 M" and the header "y vs". It keeps the width of its text and the table scrolls."""
    from core.planning.plan import plan_from_boundaries

    problem = make_problem()
    window.state.set_profile(problem.profile, source=problem.source, workload=problem.workload)
    model = problem.profile.model
    window.state.set_plan(plan_from_boundaries(model.name, model.num_units, ["phone", "laptop", "server"], [3, 6]))
    _show(window, qtbot, 1024, 700)
    window.show_screen(window.screens.plan)
    qtbot.wait(50)
    table = window.screens.plan.view.stage_table
    assert table.rowCount() == 3
    for row in range(3):
        bar = table.cellWidget(row, 6)
        assert bar.width() >= bar.fontMetrics().horizontalAdvance(bar.text()), bar.text()


def test_the_runs_list_steps_aside_while_comparing_and_returns_with_back_to_replay(window, qtbot, tmp_path):
    sessions = _two_runs_compared(window, qtbot, tmp_path, 1024, 700)
    assert not sessions.list_pane.isVisible()
    sessions.comparison.back_button.click()
    assert sessions.list_pane.isVisible() and sessions.right_stack.currentIndex() == 0


@pytest.mark.parametrize("size", [(1024, 700), (1600, 1000)])
def test_a_five_lane_runs_lanes_are_a_line_of_text_apart_on_the_sessions_screen(window, qtbot, size):
    """EPD's five lanes got ~45 px below the timeline's toolbar and details at 1024x700: their names
    overlapped. The runs list above gives way instead of the lanes."""
    sessions = window.screens.sessions
    lanes = ["edge-a", "edge-a:link", "edge-c", "edge-b", "edge-b:link"]
    sessions.monitor.reset(lanes, ("a prompt",))
    _show(window, qtbot, *size)
    window.show_screen(sessions)
    qtbot.wait(50)
    view = sessions.monitor.timeline
    assert view.lanes() == lanes
    assert _lane_px(view) >= view.fontMetrics().height() * 1.2, "lane names overlap"
    assert sessions.tree.isVisible() and sessions.tree.height() >= 3 * sessions.tree.fontMetrics().height()
    assert clipped_controls(window, sessions) == []


def _rate_labels(plot) -> list[tuple[str, QRect]]:
    """The tokens/s plot's left-axis labels as drawn, each with its rect in the plot widget."""
    from PySide6.QtGui import QImage, QPainter

    axis = plot.getAxis("left")
    image = QImage(8, 8, QImage.Format.Format_ARGB32)
    painter = QPainter(image)
    try:
        _, _, texts = axis.generateDrawSpecs(painter)
    finally:
        painter.end()
    return [(text, plot.mapFromScene(axis.mapToScene(rect)).boundingRect()) for rect, _, text in texts]


@pytest.mark.parametrize("size", [(1024, 700), (1600, 1000)])
def test_the_tokens_per_second_plot_labels_its_top_tick_whole(window, qtbot, size):
    """At 1024x700 the rate plot's only label was "0": its top tick's label was cut off or dropped."""
    from agents.protocol import TokenEvent

    sessions = window.screens.sessions
    monitor = sessions.monitor
    monitor.reset(["edge-a"], ("a prompt",))
    times = [0.004 * i for i in range(20)] + [0.08 + 0.01 * i for i in range(20)]  # ~250 then ~100 tokens/s
    monitor.add_token_events([TokenEvent(micro_batch=0, step=i, sequence_ids=(0,), token_ids=(1,), text=("a",), t_s=t)
                              for i, t in enumerate(times)])
    monitor.refresh()
    _show(window, qtbot, *size)
    window.show_screen(sessions)
    qtbot.wait(50)
    plot = monitor.rate_plot
    labels = _rate_labels(plot)
    assert len(labels) >= 2, labels  # 0 and a rate above it
    for text, rect in labels:
        assert plot.rect().contains(rect), (text, rect)


def test_the_plan_screen_scrolls_to_the_spatial_runs_lanes_at_1024x700(window, qtbot):
    """The spatial view held its timeline to 220 px: with a line of text per lane the plot ran past
    the view's bottom (edge-c and the time axis cut off, no scroll bar). The page scrolls instead,
    and only the shown technique's view sets the Plan screen's least height (attention offloading's
    page does not scroll for spatial's lanes)."""
    _show(window, qtbot, 1024, 700)
    plan = window.screens.plan
    window.show_screen(plan)
    plan.set_technique("spatial")
    timeline = plan.view.timeline
    timeline.set_lanes(["edge-a", "edge-b", "edge-c"])
    qtbot.wait(100)
    assert _lane_px(timeline) >= timeline.fontMetrics().height() * 1.2
    assert window.stack.currentWidget().verticalScrollBar().isVisible(), "the page scrolls to its lanes"
    plan.set_technique("attention-offload")
    qtbot.wait(100)
    assert clipped_controls(window, plan) == []


def test_scrolled_to_its_bottom_the_spatial_runs_time_axis_shows_whole_at_1024x700(window, qtbot):
    """A run's status wrapped onto 2-3 lines took its height from the timeline below the timeline's
    minimum (its plot, and the time axis at its bottom, cut ~14 px a line), and the page's scroll bar
    kept the range of the screen before it grew (the scroll area's own filter was not called), so
    scrolling to the bottom did not reach the axis."""
    _show(window, qtbot, 1024, 700)
    plan = window.screens.plan
    window.show_screen(plan)
    plan.set_technique("spatial")
    view = solved(qtbot, plan.view)  # its plan (solved on a worker) and summary laid out
    view.timeline.set_lanes(["edge-a", "edge-b", "edge-c"])
    view.run_status.setText("completed: 10 image(s), 8.9 images/s, max |scores − one device| = 1.5e-05; "
                            "recorded as runs 1 (measured) and 2 (predicted)")
    area = window.stack.currentWidget()
    screen, bar = area.widget(), area.verticalScrollBar()
    timeline, plot = view.timeline, view.timeline.plot_widget

    def whole_at_the_bottom() -> bool:
        """Scrolled to the bottom, the timeline has its least height and its plot (the time axis at its
        foot) ends inside it and the view: a few layout passes carry the label's lines up to the screen."""
        bar.setValue(bar.maximum())
        viewport = area.viewport()
        bottom = plot.mapTo(viewport, QPoint(0, plot.height())).y()
        return (timeline.height() >= timeline.minimumSizeHint().height()
                and bar.maximum() == screen.height() - viewport.height() > 0
                and bottom <= min(viewport.height(), timeline.mapTo(viewport, QPoint(0, timeline.height())).y()))

    qtbot.waitUntil(whole_at_the_bottom, timeout=5000)

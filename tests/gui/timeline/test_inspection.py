"""Inspecting the timeline like Perfetto: select a box for its details, highlight its
micro-batch or token, follow its flow through the stages, sum a range, keyboard and wheel
navigation without a focus click, and the prediction drawn as ghosts with each stage's error.
Driven with the simulator's real TimelineEvents for a small real problem."""

from __future__ import annotations

import msgspec
import pytest
from PySide6.QtCore import QEvent, QPoint, QPointF, Qt
from PySide6.QtGui import QEnterEvent, QMouseEvent, QWheelEvent
from PySide6.QtWidgets import QApplication

from agents.protocol import TimelineEvent
from core.planning.plan import plan_from_boundaries
from core.runs.simulator import simulate
from gui.timeline import TimelineView
from tests.gui.problems import make_problem

DEVICES = ["phone", "laptop", "server"]
STEPS = 6


@pytest.fixture(scope="module")
def simulated():
    problem = make_problem()
    plan = plan_from_boundaries("tiny-llama", 10, DEVICES, [2, 6], micro_batches=3)
    return simulate(problem, plan, "no-bubbles", micro_batches=3, micro_batch_size=1, generated_tokens=STEPS)


@pytest.fixture
def view(qtbot, simulated):
    v = TimelineView()
    qtbot.addWidget(v)
    v.resize(1100, 420)
    v.show()
    qtbot.waitExposed(v)
    v.set_lanes(DEVICES)
    v.append_events(simulated.events)
    v.flush()
    return v


def _viewport_pos(view: TimelineView, x_s: float, y: float) -> QPoint:
    scene = view.measured_plot.getViewBox().mapViewToScene(QPointF(x_s, y))
    return view.plot_widget.mapFromScene(scene)


def _longest(events, kind, **where) -> TimelineEvent:
    return max((e for e in events if e.kind == kind and all(getattr(e, k) == v for k, v in where.items())),
               key=lambda e: e.duration_s)


def _zoom_to(view, event):
    view.set_x_range(event.start_s - event.duration_s, event.end_s + event.duration_s)
    view.grab()


def test_clicking_a_box_selects_it_and_shows_its_stage_device_step_times_bytes_and_wait(qtbot, view, simulated):
    box = _longest(simulated.events, "compute", device="laptop", phase="decode")
    _zoom_to(view, box)
    with qtbot.waitSignal(view.selection_changed) as sig:
        qtbot.mouseClick(view.plot_widget.viewport(), Qt.MouseButton.LeftButton,
                         pos=_viewport_pos(view, (box.start_s + box.end_s) / 2, 1.36))
    assert sig.args == [box]
    wait = sum(e.duration_s for e in simulated.events if e.kind == "recv_wait" and e.device == "laptop"
               and e.micro_batch == box.micro_batch and e.step == box.step)
    text = view.details_label.text()
    for part in (f"Stage {box.stage} on laptop", f"micro-batch {box.micro_batch}", f"step {box.step}",
                 f"token {box.step}", f"start {box.start_s * 1000:.2f} ms",
                 f"duration {box.duration_s * 1000:.2f} ms", f"waited {wait * 1000:.2f} ms"):
        assert part in text
    send = _longest(simulated.events, "send", device="phone")
    view.select_event(send)
    assert f"to {send.peer}" in view.details_label.text() and "KiB" in view.details_label.text()


def test_clicking_empty_space_or_escape_clears_the_selection(qtbot, view, simulated):
    view.select_event(simulated.events[0])
    qtbot.keyClick(view, Qt.Key.Key_Escape)
    assert view.selected_event() is None and view.highlighted_count() == 0 and view.flow_count() == 0


def test_a_selected_box_highlights_every_box_of_its_micro_batch_or_of_its_token(qtbot, view, simulated):
    box = _longest(simulated.events, "compute", micro_batch=1, phase="decode")
    view.select_event(box)
    shown = [e for e in simulated.events if e.kind != "recv_wait"]
    assert view.highlighted_count() == sum(1 for e in shown if e.micro_batch == 1)
    view.highlight_combo.setCurrentIndex(view.highlight_combo.findData("step"))
    assert view.highlighted_count() == sum(1 for e in shown if e.step == box.step)
    view.highlight_combo.setCurrentIndex(view.highlight_combo.findData(""))
    assert view.highlighted_count() == 0


def test_flow_arrows_follow_the_selected_micro_batch_through_the_stages_for_the_selected_step_only(qtbot, view,
                                                                                                 simulated):
    box = _longest(simulated.events, "compute", micro_batch=2, stage=1, step=2)
    view.select_event(box)
    computes = [e for e in simulated.events if e.kind == "compute" and e.micro_batch == 2]
    of_step = {e.end_s for e in computes if e.step == 2}
    # stage 0 -> 1 -> 2 at step 2, then the last stage back to stage 0 of step 3; no other step
    assert view.flow_count() == (len(DEVICES) - 1) + 1
    flows = view.overlay_item.flows
    assert set(flows[:, 0]) <= of_step, "every arrow leaves a box of the selected step"
    assert (flows[:, 2] >= flows[:, 0] - 1e-12).all(), "every arrow points forward in time"
    view.fit_all()
    img = view.plot_widget.grab().toImage()  # the arrows paint without error
    assert not img.isNull()


def test_flow_arrows_of_a_sequential_run_stay_on_the_selected_step(qtbot):
    problem = make_problem()
    plan = plan_from_boundaries("tiny-llama", 10, DEVICES, [2, 6], micro_batches=1)
    sim = simulate(problem, plan, "sequential", micro_batches=1, micro_batch_size=1, generated_tokens=STEPS)
    v = TimelineView()
    qtbot.addWidget(v)
    v.set_lanes(DEVICES)
    v.append_events(sim.events)
    v.flush()
    last = max(e.step for e in sim.events)
    v.select_event(_longest(sim.events, "compute", stage=0, step=last))
    # the last step: stage 0 -> 1 -> 2 and no next step to return to (not one arrow per step)
    assert v.flow_count() == len(DEVICES) - 1


def test_shift_drag_selects_a_range_and_shows_its_summed_compute_wait_and_bytes(qtbot, view, simulated):
    end = max(e.end_s for e in simulated.events)
    view.fit_all()
    view.grab()
    x0, x1 = end * 0.25, end * 0.6
    vp = view.plot_widget.viewport()
    a, b = _viewport_pos(view, x0, 0.5), _viewport_pos(view, x1, 0.5)
    left, shift = Qt.MouseButton.LeftButton, Qt.KeyboardModifier.ShiftModifier

    def send(kind, pos, buttons):
        p = QPointF(pos)
        QApplication.sendEvent(vp, QMouseEvent(kind, p, QPointF(vp.mapToGlobal(pos)), left, buttons, shift))

    send(QEvent.Type.MouseButtonPress, a, left)
    for i in range(1, 6):
        send(QEvent.Type.MouseMove, a + (b - a) * (i / 5), left)
    send(QEvent.Type.MouseButtonRelease, b, Qt.MouseButton.NoButton)
    lo, hi = view._range
    assert lo == pytest.approx(x0, rel=0.02) and hi == pytest.approx(x1, rel=0.02)
    summary = view.select_range(x0, x1)
    clip = lambda e: max(0.0, min(e.end_s, x1) - max(e.start_s, x0))  # noqa: E731
    for device in DEVICES:
        assert summary.compute_s[device] == pytest.approx(
            sum(clip(e) for e in simulated.events if e.kind == "compute" and e.device == device))
    assert summary.sent_bytes == sum(e.nbytes for e in simulated.events
                                     if e.kind == "send" and e.end_s > x0 and e.start_s < x1)
    assert "busy" in view.details_label.text() and "sent" in view.details_label.text()


def test_wasd_work_as_soon_as_the_pointer_is_over_the_plot_without_a_focus_click(qtbot, view):
    other = QApplication.focusWidget()
    view.fit_all()
    vp = view.plot_widget.viewport()
    QApplication.sendEvent(vp, QEnterEvent(QPointF(10, 10), QPointF(10, 10), QPointF(vp.mapToGlobal(QPoint(10, 10)))))
    assert view.hasFocus() or other is None
    x0, x1 = view.x_range()
    qtbot.keyClick(view, Qt.Key.Key_W)
    assert view.x_range()[1] - view.x_range()[0] < (x1 - x0) * 0.8
    w = view.x_range()[1] - view.x_range()[0]
    qtbot.keyClick(view, Qt.Key.Key_D)
    assert view.x_range()[0] == pytest.approx(view.x_range()[0]) and view.x_range()[0] > x0
    qtbot.keyClick(view, Qt.Key.Key_S)
    assert view.x_range()[1] - view.x_range()[0] > w


def test_ctrl_wheel_zooms_the_time_axis(qtbot, view):
    view.fit_all()
    before = view.x_range()
    vp = view.plot_widget.viewport()
    centre = QPointF(vp.width() / 2, vp.height() / 3)
    wheel = QWheelEvent(centre, vp.mapToGlobal(centre), QPoint(0, 0), QPoint(0, 240), Qt.MouseButton.NoButton,
                        Qt.KeyboardModifier.ControlModifier, Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(vp, wheel)
    after = view.x_range()
    assert after[1] - after[0] < (before[1] - before[0]) * 0.9


def test_a_tooltip_stays_while_the_pointer_rests_on_the_same_box(qtbot, view, simulated, monkeypatch):
    import gui.timeline.inspection as tv
    calls = []
    monkeypatch.setattr(tv.QToolTip, "showText", staticmethod(lambda *a: calls.append(("show", a[1]))))
    monkeypatch.setattr(tv.QToolTip, "hideText", staticmethod(lambda: calls.append(("hide", None))))
    box = _longest(simulated.events, "compute", device="server")
    _zoom_to(view, box)
    vb = view.measured_plot.getViewBox()
    for f in (0.3, 0.4, 0.5, 0.6):
        view._on_scene_mouse_moved(vb.mapViewToScene(QPointF(box.start_s + f * box.duration_s, 2.36)))
    assert [c[0] for c in calls] == ["show"], "one tooltip, not re-shown or hidden while on the same box"


def test_prediction_is_drawn_as_ghosts_with_each_stages_error_in_percent(qtbot, qapp, simulated):
    view = TimelineView()
    qtbot.addWidget(view)
    view.resize(1000, 400)
    view.show()
    view.set_lanes(DEVICES)
    view.set_predicted(simulated.events)
    slow = [msgspec.structs.replace(e, end_s=e.start_s + e.duration_s * 1.5)
            if e.device == "laptop" and e.kind == "compute" else e for e in simulated.events]
    half = [e for e in slow if e.step < STEPS // 2]  # live: only the first steps measured so far
    view.append_events(half)
    view.flush()
    view.show_predicted(True)
    errors = view.stage_errors()
    assert errors["laptop"] == pytest.approx(50.0)
    assert errors["phone"] == pytest.approx(0.0) and errors["server"] == pytest.approx(0.0)
    labels = [t[1] for t in view.measured_plot.getAxis("left")._tickLevels[0]]
    assert "laptop  +50 %" in labels
    view.fit_all()
    view.grab()
    assert view.predicted_item.painted_boxes > 0 and view.measured_item.painted_boxes > 0
    view.show_predicted(False)
    assert "laptop" in [t[1] for t in view.measured_plot.getAxis("left")._tickLevels[0]]


def test_a_zoomed_out_timeline_is_drawn_as_density_not_a_barcode(qtbot):
    view = TimelineView()
    qtbot.addWidget(view)
    view.resize(600, 300)
    view.show()
    # 1,500 short boxes with gaps: at fit they are ~0.3 px wide, closer than a pixel apart
    events = [TimelineEvent(device="a", stage=0, kind="compute", phase="decode", step=i, micro_batch=i % 2,
                            start_s=i * 1e-3, end_s=i * 1e-3 + 4e-4) for i in range(1500)]
    view.append_events(events)
    view.flush()
    view.fit_all()
    view.grab()
    item = view.measured_item
    assert item.painted_boxes == 1500
    assert item.painted_rects < 300, "adjacent sub-pixel boxes merge into runs"
    view.set_x_range(0.0, 0.02)  # zoomed in: every box is drawn on its own
    view.grab()
    assert item.painted_rects == item.painted_boxes

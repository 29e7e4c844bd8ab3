"""The live pipeline timeline and the queued event bridge, driven with real event lists
(the simulator's predicted TimelineEvents for a small real problem)."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QColor, QPalette, QWheelEvent
from PySide6.QtWidgets import QApplication

from agents.protocol import TimelineEvent
from core.planning.plan import plan_from_boundaries
from core.runs.simulator import simulate
from gui.timeline import TimelineView
from gui.timeline.event_bridge import EventBridge
from gui.timeline.inspection import describe_event
from gui.timeline.items import MICRO_BATCH_COLOURS
from tests.gui.problems import make_problem

DEVICES = ["phone", "laptop", "server"]


@pytest.fixture(scope="module")
def simulated():
    problem = make_problem()
    plan = plan_from_boundaries("tiny-llama", 10, DEVICES, [2, 6], micro_batches=3)
    return simulate(problem, plan, "no-bubbles", micro_batches=3, micro_batch_size=1, generated_tokens=6)


@pytest.fixture
def view(qtbot):
    v = TimelineView()
    qtbot.addWidget(v)
    v.resize(1000, 420)
    v.show()
    qtbot.waitExposed(v)
    return v


def _pixel_at(view: TimelineView, x_s: float, lane: int, band_y: float) -> QColor:
    vb = view.measured_plot.getViewBox()
    scene = vb.mapViewToScene(QPointF(x_s, lane + band_y))
    pos = view.plot_widget.mapFromScene(scene)
    pos = view.plot_widget.mapTo(view, pos)
    return view.grab().toImage().pixelColor(pos)


def test_feeding_events_draws_one_box_per_event_in_each_device_lane(qtbot, view, simulated):
    events = list(simulated.events)
    view.set_lanes(DEVICES)
    view.append_events(events)
    view.flush()
    view.fit_all()
    view.grab()  # paint
    expected = Counter(DEVICES.index(e.device) for e in events)
    assert view.measured_item.painted_per_lane == dict(expected)
    for device in DEVICES:
        assert view.box_count(device) == sum(1 for e in events if e.device == device)
    assert view.box_count(kind="send") == sum(1 for e in events if e.kind == "send")


def test_a_compute_box_is_painted_in_its_micro_batch_colour(qtbot, view, simulated):
    view.set_lanes(DEVICES)
    view.append_events(simulated.events)
    view.flush()
    decode = max((e for e in simulated.events if e.kind == "compute" and e.phase == "decode"
                  and e.micro_batch == 1), key=lambda e: e.duration_s)
    view.set_x_range(decode.start_s - decode.duration_s, decode.end_s + decode.duration_s)
    colour = _pixel_at(view, (decode.start_s + decode.end_s) / 2, DEVICES.index(decode.device), 0.36)
    assert colour.name() == QColor(MICRO_BATCH_COLOURS[1]).name()


def test_events_are_applied_in_batches_on_the_frame_timer_not_one_by_one(qtbot, view, simulated):
    calls = []
    original = view.measured_item.add
    view.measured_item.add = lambda rows, evs: (calls.append(len(rows)), original(rows, evs))
    for event in simulated.events:
        view.append_events([event])
    assert view.box_count() == 0, "nothing is drawn before the next frame"
    qtbot.waitUntil(lambda: view.box_count() == len(simulated.events), timeout=30_000)
    assert calls == [len(simulated.events)]


def test_only_the_visible_time_range_is_drawn(qtbot, view, simulated):
    view.append_events(simulated.events)
    view.flush()
    end = max(e.end_s for e in simulated.events)
    x0, x1 = end * 0.4, end * 0.5
    view.set_x_range(x0, x1)
    view.grab()
    visible = sum(1 for e in simulated.events if e.end_s >= x0 and e.start_s <= x1)
    assert 0 < view.measured_item.painted_boxes == visible < len(simulated.events)


def test_many_sub_pixel_boxes_are_merged_but_all_counted(qtbot, view):
    events = [TimelineEvent(device=f"d{i % 2}", stage=i % 2, kind="compute", phase="decode", step=i,
                            micro_batch=0, start_s=i * 1e-4, end_s=i * 1e-4 + 5e-5) for i in range(20_000)]
    view.append_events(events)
    view.flush()
    view.fit_all()
    view.grab()
    item = view.measured_item
    assert item.painted_boxes == 20_000
    assert item.painted_rects < 2_000, "sub-pixel boxes should collapse into per-pixel runs"


def test_follow_live_keeps_the_newest_events_in_view_until_the_user_zooms(qtbot, view):
    def burst(t0):
        return [TimelineEvent(device="a", stage=0, kind="compute", phase="decode", step=1, micro_batch=0,
                              start_s=t0 + i * 0.01, end_s=t0 + i * 0.01 + 0.008) for i in range(10)]

    view.append_events(burst(0.0))
    view.flush()
    view.append_events(burst(50.0))
    view.flush()
    x0, x1 = view.x_range()
    assert x0 <= 50.098 <= x1
    # a wheel zoom on the plot is a manual range change: follow-live turns off
    viewport = view.plot_widget.viewport()
    centre = QPointF(viewport.width() / 2, viewport.height() / 3)
    wheel = QWheelEvent(centre, viewport.mapToGlobal(centre), QPoint(0, 0), QPoint(0, 120),
                        Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(viewport, wheel)
    assert not view.follow_live() and not view.follow_check.isChecked()
    before = view.x_range()
    view.append_events(burst(100.0))
    view.flush()
    assert view.x_range() == before
    view.follow_check.setChecked(True)
    x0, x1 = view.x_range()
    assert x0 <= 100.098 <= x1


def test_a_small_transfers_rate_reads_in_its_own_unit_not_0_0_mb_s():
    token_back = TimelineEvent(device="edge-b", stage=2, kind="send", phase="decode", step=16, micro_batch=0,
                               start_s=0.320, end_s=0.322, nbytes=16, peer="edge-a")
    assert "16 B to edge-a (8.0 kB/s)" in describe_event(token_back)


def test_hover_shows_times_and_bytes_of_the_transfer_under_the_mouse(qtbot, view, simulated):
    view.set_lanes(DEVICES)
    view.append_events(simulated.events)
    view.flush()
    send = max((e for e in simulated.events if e.kind == "send"), key=lambda e: e.duration_s)
    view.set_x_range(send.start_s - send.duration_s, send.end_s + send.duration_s)
    mid = (send.start_s + send.end_s) / 2
    assert view.event_at(mid, send.device, band="send") == send
    text = describe_event(send)
    assert f"{send.duration_s * 1000:.2f} ms" in text and "KiB" in text and send.peer in text
    shown = []
    import gui.timeline.inspection as tv
    original = tv.QToolTip.showText
    tv.QToolTip.showText = staticmethod(lambda pos, txt, *a: shown.append(txt))
    try:
        vb = view.measured_plot.getViewBox()
        view._on_scene_mouse_moved(vb.mapViewToScene(QPointF(mid, DEVICES.index(send.device) + 0.78)))
    finally:
        tv.QToolTip.showText = original
    assert shown == [text]


def test_predicted_timeline_is_drawn_as_ghosts_on_the_measured_time_axis(qtbot, view, simulated):
    view.set_predicted(simulated.events)
    assert view.box_count(predicted=True) == len(simulated.events)
    assert not view.predicted_item.isVisible()
    view.show_predicted(True)
    assert view.predicted_item.isVisible()
    assert view.predicted_item.getViewBox() is view.measured_plot.getViewBox()
    assert view.predicted_item.zValue() < view.measured_item.zValue()


def test_background_follows_a_dark_palette(qtbot, view):
    pal = QPalette(view.palette())
    pal.setColor(QPalette.ColorRole.Base, QColor(20, 20, 24))
    view.setPalette(pal)
    img = view.plot_widget.grab().toImage()
    assert img.pixelColor(3, 3).lightness() < 60


def test_plot_titles_take_the_palette_text_colour_so_they_read_on_dark(qtbot, view):
    pal = QPalette(view.palette())
    pal.setColor(QPalette.ColorRole.Base, QColor(20, 20, 24))
    pal.setColor(QPalette.ColorRole.Text, QColor(230, 230, 230))
    view.setPalette(pal)
    html = view.measured_plot.titleLabel.item.toHtml().lower()
    assert "#e6e6e6" in html


def test_bridge_delivers_events_from_many_threads_in_few_batches_on_the_gui_thread(qtbot):
    bridge = EventBridge()
    batches, threads = [], set()
    bridge.timeline_events_arrived.connect(lambda evs: (batches.append(evs), threads.add(threading.get_ident())))
    per_thread = 3000

    def produce(device):
        for i in range(per_thread):
            bridge.on_timeline_event(TimelineEvent(device=device, stage=0, kind="compute", phase="decode",
                                                   step=i, micro_batch=0, start_s=i, end_s=i + 1))

    workers = [threading.Thread(target=produce, args=(f"d{k}",)) for k in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    qtbot.waitUntil(lambda: sum(map(len, batches)) == 4 * per_thread, timeout=30_000)
    assert threads == {threading.get_ident()}
    assert len(batches) < 50
    got = [e for b in batches for e in b]
    for k in range(4):
        steps = [e.step for e in got if e.device == f"d{k}"]
        assert steps == list(range(per_thread)), "each thread's events keep their order"


def test_bridge_is_a_coordinator_run_sink(qtbot):
    from agents.protocol import TokenEvent
    from core.runs.coordinator import FanoutSink  # what the coordinator calls during a run

    bridge = EventBridge()
    events, tokens = [], []
    bridge.timeline_events_arrived.connect(events.extend)
    bridge.token_events_arrived.connect(tokens.extend)
    sink = FanoutSink(bridge)
    event = TimelineEvent(device="a", stage=0, kind="send", phase="prefill", step=0, micro_batch=0,
                          start_s=0.0, end_s=0.001, nbytes=64, peer="b")
    token = TokenEvent(micro_batch=0, step=0, sequence_ids=(0,), token_ids=(5,))
    worker = threading.Thread(target=lambda: (sink.on_event(event), sink.on_tokens(token)))
    worker.start()
    worker.join()
    qtbot.waitUntil(lambda: bool(events and tokens), timeout=30_000)
    assert events == [event] and tokens == [token]


def test_keyboard_zooms_and_pans_the_time_axis(qtbot, view, simulated):
    view.append_events(simulated.events)
    view.flush()
    view.set_x_range(0.1, 0.4)
    qtbot.keyClick(view, Qt.Key.Key_Plus)
    x0, x1 = view.x_range()
    assert x1 - x0 == pytest.approx(0.2) and (x0 + x1) / 2 == pytest.approx(0.25)
    qtbot.keyClick(view, Qt.Key.Key_Right)
    assert view.x_range() == pytest.approx((x0 + 0.02, x1 + 0.02))
    qtbot.keyClick(view, Qt.Key.Key_Minus)
    assert view.x_range()[1] - view.x_range()[0] == pytest.approx(0.3)
    assert not view.follow_live()


def test_a_recovery_shows_as_a_red_failure_box_on_the_lost_device_and_reload_boxes_on_the_new_stages(qtbot, view):
    from gui.timeline.items import RECOVERY_COLOURS

    failure = TimelineEvent(device="server", stage=2, kind="failure", phase="decode", step=5, micro_batch=0,
                            start_s=1.0, end_s=3.0)
    events = [failure,
              TimelineEvent(device="server", stage=2, kind="replan", phase="decode", step=5, micro_batch=0,
                            start_s=3.0, end_s=3.2),
              TimelineEvent(device="phone", stage=0, kind="reload", phase="decode", step=5, micro_batch=0,
                            start_s=3.2, end_s=4.0)]
    view.set_lanes(DEVICES)
    view.append_events(events)
    view.flush()
    view.set_x_range(0.0, 5.0)
    assert view.box_count("server") == 2 and view.box_count(kind="reload") == 1
    red = _pixel_at(view, 2.0, DEVICES.index("server"), 0.5)
    assert red.red() > 150 and red.green() < 120 and red.blue() < 120  # RECOVERY_COLOURS["failure"] over the lane
    assert RECOVERY_COLOURS["failure"] == "#d62728"
    assert "device lost" in describe_event(failure) and "step 5" in describe_event(failure)


@pytest.mark.parametrize("width", [260, 420, 700, 1200])
def test_every_legend_entry_is_shown_whole_at_any_width(qtbot, view, simulated, width):
    view.append_events(simulated.events)
    view.flush()
    view.resize(width, 420)
    qtbot.wait(20)
    label = view.legend_label
    if label.wordWrap():
        assert label.height() >= label.heightForWidth(label.width())  # no line cut off below
    else:
        assert label.width() >= label.sizeHint().width()
    assert label.geometry().right() <= view.toolbar.width()  # nor on the right
    assert all(word in view.legend_text() for word in ("mb0", "mb2", "prefill", "decode", "waiting"))


def test_many_micro_batches_are_one_legend_entry_with_their_range(qtbot, view):
    view.append_events([TimelineEvent(device="phone", stage=0, kind="compute", phase="decode", step=1,
                                      micro_batch=m, start_s=m * 0.01, end_s=m * 0.01 + 0.005) for m in range(12)])
    view.flush()
    assert "mb0–11" in view.legend_text() and "mb5 " not in view.legend_text()


def test_a_technique_names_its_own_legend_terms(view):
    view.set_legend_terms((("▨", "strip compute"), ("▂", "gather")), "strips", micro_batches=False)
    assert view.legend_text().split() == ["▨", "strip", "compute", "▂", "gather"]


def test_an_empty_timeline_labels_no_lanes_instead_of_numbers(view):
    assert view.measured_plot.getAxis("left")._tickLevels == [[], []]  # fixed (empty) ticks: no 0.0 … 1.0


def _decode(device: str, request: int, start: float, end: float) -> TimelineEvent:
    return TimelineEvent(device=device, stage=2, kind="compute", phase="decode", step=0, micro_batch=request,
                         start_s=start, end_s=end)


def test_a_batched_decode_stacks_its_requests_in_sub_lanes_of_the_agents_lane(qtbot, view):
    """A decode agent's continuous batch: three requests decoding at once, one box each, are drawn
    one above the other (each its own colour, each hit where it is drawn), not over each other."""
    events = [_decode("dec", r, 1.0 + 0.1 * r, 3.0) for r in range(3)]
    view.set_lanes(["enc", "dec"])
    view.append_events(events)
    view.flush()
    view.set_x_range(0.0, 4.0)
    assert view.measured_item.lane_slots(1) == 3
    b0, b1 = 0.10, 0.62  # the compute band
    share = (b1 - b0) / 3
    for r in range(3):
        y = b0 + share * (r + 0.4)
        assert _pixel_at(view, 2.5, 1, y).name() == QColor(MICRO_BATCH_COLOURS[r]).name()
        assert view.measured_item.box_at(2.5, 1 + y) is events[r]


def test_consecutive_boxes_that_barely_overlap_stay_in_one_sub_lane(qtbot, view):
    """Clock-mapping jitter (a box starting a hair before the previous one ends) is no batch."""
    view.set_lanes(["dev"])
    view.append_events([_decode("dev", 0, 0.0, 1.0), _decode("dev", 1, 0.99, 2.0), _decode("dev", 2, 2.0, 3.0)])
    view.flush()
    assert view.measured_item.lane_slots(0) == 1


def test_a_replay_stacks_a_batched_decode_as_the_live_stream_did(qtbot):
    """Live, events arrive a few at a time; a replay adds them all at once: same sub-lanes."""
    events = [_decode("dec", 0, 0.0, 1.0), _decode("dec", 1, 1.0, 4.0), _decode("dec", 2, 1.5, 3.0),
              _decode("dec", 3, 3.2, 5.0), _decode("dec", 4, 4.5, 6.0)]
    live, replay = TimelineView(), TimelineView()
    qtbot.addWidget(live)
    qtbot.addWidget(replay)
    for e in events:
        live.append_events([e])
        live.flush()
    replay.append_events(events)
    replay.flush()
    assert live.measured_item.slots.rows.tolist() == replay.measured_item.slots.rows.tolist() == [0, 0, 1, 1, 0]


def _lane_axis_fits(qtbot, view: TimelineView) -> tuple[float, float]:
    """(width of the lane-label column once laid out, width of its longest label's text)."""
    from PySide6.QtGui import QFontMetrics

    qtbot.wait(50)  # the plot's layout applies the axis width
    axis = view.measured_plot.getAxis("left")
    metrics = QFontMetrics(axis.style["tickFont"] or axis.font())
    labels = [label for _, label in axis._tickLevels[0]]
    return axis.width(), max(metrics.horizontalAdvance(label) for label in labels)


def test_the_lane_label_column_is_as_wide_as_its_labels_so_short_names_leave_the_boxes_room(qtbot, view):
    """At 1024x700 the Run screen's lane labels ("edge-a", ~45 px) had a fixed 120 px column and the
    boxes ~145 px."""
    view.set_lanes(["edge-a", "edge-b", "edge-c"])
    column, text = _lane_axis_fits(qtbot, view)
    assert text < column <= text + 24


def test_a_long_lane_label_is_not_clipped(qtbot, view):
    view.set_lanes(["edge-a", "edge-b"])
    view.set_lane_notes({"edge-b": "memory agent, KV heads 0-3"})
    column, text = _lane_axis_fits(qtbot, view)
    assert column > text


def test_a_run_that_stopped_early_is_shown_without_ghosts_of_steps_it_never_ran(view, simulated):
    events = list(simulated.events)
    view.set_lanes(DEVICES)
    view.set_predicted(events)
    ran = [e for e in events if e.step <= 1]  # the run stopped (EOS) after its first decode step
    view.append_events(ran)
    view.flush()
    view.clip_predicted_to_run()
    view.show_whole_run()
    assert view.box_count(predicted=True) == len(ran)
    assert view.x_range()[1] <= max(e.end_s for e in ran) * 1.05


def test_fit_shows_the_run_not_hidden_ghosts_that_predicted_it_slower(view, simulated):
    import msgspec

    events = list(simulated.events)
    view.set_lanes(DEVICES)
    view.set_predicted(events)  # predicted, but "Show predicted" is off
    ran = [msgspec.structs.replace(e, start_s=e.start_s / 2, end_s=e.end_s / 2) for e in events]  # ran 2x faster
    view.append_events(ran)
    view.flush()
    view.fit_all()
    run_end = max(e.end_s for e in ran)
    assert view.x_range()[1] <= run_end * 1.05  # the axis ran on to the ghosts' end, 2x the run
    view.show_predicted(True)
    view.fit_all()
    assert view.x_range()[1] >= max(e.end_s for e in events)


def test_before_a_run_fit_shows_the_whole_prediction_even_hidden(view, simulated):
    view.set_lanes(DEVICES)
    view.set_predicted(list(simulated.events))
    view.fit_all()
    assert view.x_range()[1] >= max(e.end_s for e in simulated.events)

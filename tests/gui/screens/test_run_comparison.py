"""Runs as first-class on the Sessions screen: status marks (failed and interrupted runs are
not listed as normal), two runs side by side aligned at t = 0 with one table of figures, and
"Show predicted" drawing the simulator's timeline under a replay. Real SQLite workspaces,
real simulator timelines."""

from __future__ import annotations

import pytest

from core.runs.metrics import bubbles, comparison_rows, compute_figures
from core.runs.simulator import simulate
from core.sessions.recording import record_simulation
from core.sessions.store import SessionStore
from gui.screens.sessions import SessionsPanel, shown_status
from gui.studio_state import StudioState
from tests.gui.run_backends import DEVICES, simulated_run


@pytest.fixture(scope="module")
def run_data():
    return simulated_run(generated_tokens=6, micro_batches=2)


@pytest.fixture
def workspace(tmp_path, run_data):
    """Two finished runs of different modes, a failed one and one cut off mid-run."""
    problem, plan, events, tokens = run_data
    path = str(tmp_path / "ws.sqlite")
    with SessionStore(path) as store:
        sid = store.create_session("bench")
        ids = [record_simulation(store, sid, problem, plan, simulate(problem, plan, mode, generated_tokens=6,
                                                                       micro_batches=2))
               for mode in ("sequential", "no-bubbles")]
        for status in ("failed", None):
            run_id = store.create_run(sid, model="tiny", mode="no-bubbles", problem=problem,
                                      settings={"lanes": DEVICES})
            for seq, e in enumerate(events[:10]):
                store.append_event(run_id, seq, e.end_s, e)
            if status:
                store.finish_run(run_id, status)
            ids.append(run_id)
        store.flush()
    return path, ids


def _panel(qtbot, path, state=None) -> SessionsPanel:
    state = state or StudioState()
    state.set_workspace(path)
    panel = SessionsPanel(state)
    qtbot.addWidget(panel)
    panel.resize(1400, 800)
    panel.show()
    qtbot.waitUntil(lambda: panel.tree.topLevelItemCount() > 0, timeout=30_000)
    return panel


def test_failed_and_interrupted_runs_are_marked_not_listed_as_normal(qtbot, workspace):
    path, (a, b, failed, cut) = workspace
    panel = _panel(qtbot, path)
    items = panel.run_items()
    assert items[a].text(3) == "completed" and items[b].text(3) == "completed"
    assert items[failed].text(3) == "✖ failed"
    assert items[cut].text(3) == "⚠ interrupted", "a 'running' row nobody is recording was cut off"
    assert "incomplete" in items[cut].toolTip(3)
    panel.shutdown()


def test_the_status_mark_leads_the_runs_name_where_the_status_column_is_off_screen(qtbot, workspace):
    path, (a, _b, failed, cut) = workspace
    panel = _panel(qtbot, path)
    items = panel.run_items()
    assert items[failed].text(0).startswith("✖ Layer sharding #") and items[cut].text(0).startswith("⚠ Layer sharding #")
    assert items[a].text(0) == f"Layer sharding #{a}"
    assert "failed" in items[failed].toolTip(0)
    panel.shutdown()


def test_the_replay_controls_keep_their_place_when_play_becomes_pause(qtbot, workspace):
    path, (a, *_rest) = workspace
    panel = _panel(qtbot, path)
    font = panel.font()
    font.setPointSize(24)  # the texts, not the style's minimum button width, decide the width (as under xcb)
    panel.play_button.setFont(font)
    qtbot.wait(10)
    before = panel.speed_combo.geometry()
    panel.play_button.setChecked(True)
    qtbot.wait(10)
    assert panel.play_button.text() == "Pause" and panel.speed_combo.geometry() == before
    panel.play_button.setChecked(False)
    panel.shutdown()


def test_a_run_being_recorded_now_is_running_not_interrupted():
    assert shown_status("running", 7, {7}) == "running"
    assert shown_status("running", 7, set()) == "interrupted"
    assert shown_status("failed", 7, {7}) == "failed"


def test_compare_needs_exactly_two_runs_and_says_so(qtbot, workspace):
    path, (a, b, *_rest) = workspace
    panel = _panel(qtbot, path)
    items = panel.run_items()
    items[a].setSelected(True)
    assert not panel.compare_button.isEnabled() and "two runs" in panel.compare_button.toolTip()
    items[b].setSelected(True)
    assert panel.compare_button.isEnabled()
    panel.shutdown()


def test_two_runs_compare_side_by_side_aligned_at_zero_with_one_table_of_figures(qtbot, workspace):
    path, (a, b, *_rest) = workspace
    panel = _panel(qtbot, path)
    items = panel.run_items()
    items[a].setSelected(True)
    items[b].setSelected(True)
    with qtbot.waitSignal(panel.runs_compared, timeout=30_000):
        panel.compare_button.click()
    view = panel.comparison
    assert panel.right_stack.currentWidget() is view
    with SessionStore(path) as store:
        ea, ta, eb, tb = store.events(a), store.tokens(a), store.events(b), store.tokens(b)
    assert view.timeline_a.box_count() == len(ea) and view.timeline_b.box_count() == len(eb)
    assert view.timeline_a.x_range()[0] == pytest.approx(0.0, abs=1e-9)
    assert view.timeline_b.x_range() == pytest.approx(view.timeline_a.x_range())
    view.timeline_a.set_x_range(0.01, 0.02)  # one time axis: zooming A zooms B
    assert view.timeline_b.x_range() == pytest.approx((0.01, 0.02), abs=1e-4)
    expected = comparison_rows(compute_figures(ea, ta), compute_figures(eb, tb), bubbles(ea), bubbles(eb))
    assert view.figure_rows() == expected
    assert view.table_rows()[0] == ("Technique", "Layer sharding", "Layer sharding")
    figures = [r[0] for r in expected]
    assert "TTFT" in figures and "Decode tokens/s" in figures
    assert all(f"Utilisation · {d}" in figures and f"Bubbles · {d}" in figures for d in DEVICES)
    seq, piped = dict((r[0], r[1]) for r in expected), dict((r[0], r[2]) for r in expected)
    assert seq["Bubbles · phone"] != piped["Bubbles · phone"], "sequential and pipelined differ"
    view.back_button.click()
    assert panel.right_stack.currentIndex() == 0
    panel.shutdown()


def test_a_compared_timelines_fit_button_shares_the_highlight_row_where_there_is_room(qtbot, workspace):
    path, (a, b, *_rest) = workspace
    panel = _panel(qtbot, path)  # 1400 px wide: room for Fit, the highlight picker and the legend in one row
    items = panel.run_items()
    items[a].setSelected(True)
    items[b].setSelected(True)
    with qtbot.waitSignal(panel.runs_compared, timeout=30_000):
        panel.compare_button.click()
    qtbot.wait(50)
    for view in (panel.comparison.timeline_a, panel.comparison.timeline_b):
        assert not view.follow_check.isVisible() and not view.predicted_check.isVisible()
        assert view.fit_button.geometry().center().y() == view.highlight_combo.geometry().center().y()
    panel.shutdown()


def test_bubbles_are_the_idle_share_of_each_device_over_the_pipeline_span(run_data):
    problem, plan, _, _ = run_data
    seq = simulate(problem, plan, "sequential", generated_tokens=4)
    b = bubbles(seq.events)
    computes = [e for e in seq.events if e.kind == "compute"]
    span = max(e.end_s for e in computes) - min(e.start_s for e in computes)
    for d in DEVICES:
        busy = sum(e.duration_s for e in computes if e.device == d)
        assert b[d] == pytest.approx(1 - busy / span)
    # sequential: one device computes at a time (and none while a transfer is on the wire)
    assert sum(b.values()) >= len(DEVICES) - 1 - 1e-9


def test_show_predicted_draws_the_runs_prediction_under_its_replay(qtbot, workspace):
    path, (a, *_rest) = workspace
    panel = _panel(qtbot, path)
    panel.load_runner.task_failed.connect(lambda _id, message: pytest.fail(message))
    with qtbot.waitSignal(panel.run_opened, timeout=60_000):
        panel.open_run(a)
    timeline = panel.monitor.timeline
    assert timeline.predicted_check.isEnabled()
    with SessionStore(path) as store:
        assert timeline.box_count(predicted=True) == len(store.events(a)), "the whole run is predicted"
    timeline.show_predicted(True)
    assert timeline.predicted_item.isVisible()
    panel.seek(panel.replay.duration_s)
    assert timeline.predicted_check.isChecked(), "a seek keeps the prediction shown"
    errors = timeline.stage_errors()
    assert set(errors) == set(DEVICES)
    assert all(abs(e) < 1e-6 for e in errors.values()), "a simulated run is its own prediction"
    panel.shutdown()


def test_two_techniques_runs_of_the_same_prompts_show_each_technique_and_their_texts_side_by_side(qtbot, tmp_path,
                                                                                                  run_data):
    from agents.protocol import TokenEvent

    problem, _plan, events, _tokens = run_data
    path = str(tmp_path / "ws.sqlite")
    prompts = ["The secret of life is", "You will"]
    pieces = {"layer-sharding": ((" to", " be"), (" go", ".")), "attention-offload": ((" to", " be"), (" see", "!"))}
    with SessionStore(path) as store:
        sid = store.create_session("two techniques")
        ids = []
        for technique, texts in pieces.items():
            run_id = store.create_run(sid, model="demo-llama", mode="no-bubbles", problem=problem,
                                      settings={"lanes": DEVICES, "prompts": prompts, "technique": technique})
            for seq, e in enumerate(events[:6]):
                store.append_event(run_id, seq, e.end_s, e)
            for step in range(2):
                store.append_tokens(run_id, step, 0.01 * (step + 1), TokenEvent(
                    micro_batch=0, step=step, sequence_ids=(0, 1), token_ids=(5 + step, 9 + step),
                    text=(texts[0][step], texts[1][step]), t_s=0.01 * (step + 1)))
            store.finish_run(run_id, "completed")
            ids.append(run_id)
        store.flush()
    panel = _panel(qtbot, path)
    with qtbot.waitSignal(panel.runs_compared, timeout=30_000):
        panel.compare_runs(*ids)
    view = panel.comparison
    assert view.table_rows()[0] == ("Technique", "Layer sharding", "Attention offloading")
    assert view.output_rows() == [(prompts[0], " to be", " to be"), (prompts[1], " go.", " see!")]
    assert not view.outputs.isHidden()
    panel.shutdown()


def test_simulated_runs_compare_without_a_texts_table(qtbot, workspace):
    path, (a, b, *_rest) = workspace
    panel = _panel(qtbot, path)
    with qtbot.waitSignal(panel.runs_compared, timeout=30_000):
        panel.compare_runs(a, b)
    assert panel.comparison.output_rows() == [] and panel.comparison.outputs.isHidden()
    panel.shutdown()


def test_an_expert_offload_runs_storage_lane_compares_by_its_reads_not_a_compute_share():
    from agents.protocol import TimelineEvent
    from core.sessions.store import RunInfo
    from gui.screens.run_comparison import ComparedRun, with_reads

    compute = TimelineEvent(device="e0", stage=0, kind="compute", phase="decode", start_s=0.0, end_s=0.4,
                            micro_batch=0, step=0)
    reads = [TimelineEvent(device="e0:storage", stage=0, kind="io", phase="decode", start_s=t, end_s=t + 0.1,
                           micro_batch=0, step=0) for t in (0.0, 0.2)]
    events = [compute, *reads]
    info = RunInfo(id=1, session_id=1, model="moe", mode="no-bubbles", kind="measured", status="completed",
                   started_at="", ended_at="", settings={"technique": "expert-offload"}, figures={})
    run = ComparedRun(info=info, events=events, tokens=[], figures=compute_figures(events, []),
                      bubbles=bubbles(events), lanes=["e0", "e0:storage"])
    rows = with_reads(comparison_rows(run.figures, run.figures, run.bubbles, run.bubbles), run, run)
    names = [r[0] for r in rows]
    assert ("Reads · e0:storage", "50 %", "50 %") in rows and "Utilisation · e0:storage" not in names
    assert ("Utilisation · e0", "100 %", "100 %") in rows


def test_each_techniques_name_in_compare_fits_its_column_whole_on_a_small_screen(qtbot, tmp_path, run_data):
    """At 1024x700 the figures table beside the timelines cut "Layer sharding" to "Layer shardi…" and
    "disaggregation" likewise: every word of a technique's name fits its column."""
    from core.reporting import NullReporter
    from gui.screens.run_comparison import RunComparisonView, load_comparison

    problem, _plan, events, _tokens = run_data
    path = str(tmp_path / "ws.sqlite")
    with SessionStore(path) as store:
        sid = store.create_session("two techniques")
        ids = []
        for technique in ("layer-sharding", "phase-disaggregation"):
            run_id = store.create_run(sid, model="demo-llama", mode="no-bubbles", problem=problem,
                                      settings={"lanes": DEVICES, "technique": technique})
            for seq, e in enumerate(events[:6]):
                store.append_event(run_id, seq, e.end_s, e)
            store.finish_run(run_id, "completed")
            ids.append(run_id)
        store.flush()
    view = RunComparisonView()
    qtbot.addWidget(view)
    view.resize(860, 560)  # the Sessions screen's room in a 1024x700 window
    view.show()
    view.show_runs(*load_comparison(NullReporter(), path, *ids))
    qtbot.wait(50)
    fm = view.table.fontMetrics()
    for column in (1, 2):
        text = view.table.item(0, column).text()
        widest = max(fm.horizontalAdvance(w) for w in text.replace("/", "/ ").split())
        assert widest + 8 <= view.table.columnWidth(column), (text, view.table.columnWidth(column))

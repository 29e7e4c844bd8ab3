"""Speculative decoding on the Run monitor: the tokens-per-trip plot appears once a run drafts,
counts each trip's committed tokens from the token events, and the timeline draws the draft and
rollback boxes in their own colours."""

from __future__ import annotations

from agents.protocol import TimelineEvent, TokenEvent
from gui.screens.run_monitor import RunMonitorView
from gui.techniques.speculative import tokens_per_trip
from gui.timeline.items import KIND_CODE


def event(kind: str, device: str, stage: int, step: int, start: float, end: float, nbytes: int = 0) -> TimelineEvent:
    return TimelineEvent(device=device, stage=stage, kind=kind, phase="decode" if step else "prefill", step=step,
                         micro_batch=0, start_s=start, end_s=end, nbytes=nbytes)


def tokens(*per_trip: int) -> list[TokenEvent]:
    """Token events as a speculative source posts them: a trip's tokens share one arrival time."""
    out, step = [], 0
    for trip, n in enumerate(per_trip):
        for _ in range(n):
            out.append(TokenEvent(micro_batch=0, step=step, sequence_ids=(0,), token_ids=(7,), t_s=0.1 * (trip + 1)))
            step += 1
    return out


def test_tokens_per_trip_groups_a_trips_arrivals_and_leaves_out_the_prefills_token():
    assert tokens_per_trip(tokens(1, 4, 1, 2)) == [4, 1, 2]
    assert tokens_per_trip(tokens(1)) == []


def test_the_trip_plot_appears_with_a_drafting_run_and_counts_its_trips(qtbot):
    monitor = RunMonitorView()
    qtbot.addWidget(monitor)
    monitor.resize(1200, 700)
    monitor.show()
    monitor.reset(["a", "b"], ["p"])
    monitor.add_timeline_events([event("compute", "a", 0, 0, 0.0, 0.05), event("compute", "b", 1, 0, 0.05, 0.08)])
    monitor.flush()
    assert monitor.trips_plot.isHidden() and monitor.trips_label.isHidden()
    monitor.add_timeline_events([event("draft", "a", 0, 1, 0.1, 0.11, 3), event("compute", "a", 0, 1, 0.11, 0.12),
                                 event("rollback", "b", 1, 2, 0.2, 0.2005, 2), event("compute", "b", 1, 1, 0.12, 0.15)])
    monitor.add_token_events(tokens(1, 4, 2))
    monitor.flush()
    assert monitor.trips_plot.isVisible() and monitor.trips_plot.counts == [4, 2] and monitor.trips_plot.mean == 3.0
    drawn = monitor.timeline.measured_item.boxes.rows["kind"].tolist()
    assert KIND_CODE["draft"] in drawn and KIND_CODE["rollback"] in drawn
    monitor.reset(["a", "b"], ["p"])
    assert monitor.trips_plot.isHidden()


def test_a_recorded_speculative_run_replays_with_its_marks_and_trip_plot(qtbot, tmp_path):
    from core.sessions.recording import record_run
    from gui.studio_state import StudioState
    from tests.gui.screens.test_sessions import _open, _play_to_end, _sessions

    workspace = tmp_path / "ws.edgeshard"
    events = [event("compute", "a", 0, 0, 0.0, 0.05), event("compute", "b", 1, 0, 0.05, 0.08),
              event("draft", "a", 0, 1, 0.1, 0.11, 3), event("compute", "a", 0, 1, 0.11, 0.12),
              event("compute", "b", 1, 1, 0.12, 0.15), event("draft", "a", 0, 2, 0.2, 0.21, 3),
              event("rollback", "b", 1, 2, 0.22, 0.2205, 2), event("compute", "b", 1, 2, 0.2205, 0.25)]
    with record_run(workspace, model="demo-llama", mode="sequential",
                    settings={"prompts": ["p"], "lanes": ["a", "b"]}) as run:
        for e in events:
            run.recorder.on_event(e)
        for t in tokens(1, 4, 2):
            run.recorder.on_tokens(t)
        run.status = "completed"
    state = StudioState()
    state.set_workspace(str(workspace))
    panel = _sessions(qtbot, state)
    [(run_id, _)] = panel.run_items().items()
    _open(qtbot, panel, run_id)
    _play_to_end(qtbot, panel, 30_000)
    panel.monitor.flush()
    assert not panel.monitor.trips_plot.isHidden() and panel.monitor.trips_plot.counts == [4, 2]
    drawn = panel.monitor.timeline.measured_item.boxes.rows["kind"].tolist()
    assert KIND_CODE["draft"] in drawn and KIND_CODE["rollback"] in drawn
    assert "draft" in panel.monitor.timeline.legend_text() and "rollback" in panel.monitor.timeline.legend_text()
    panel.shutdown()

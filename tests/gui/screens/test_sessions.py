"""The Sessions screen: lists the workspace, replays a run exactly as it was seen live
(same boxes, figures and text), seeks, pauses, changes speed, exports."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from core import formats
from core.planning.plan import ShardPlan
from core.sessions.recording import record_simulation
from core.runs.metrics import compute_figures
from core.runs.simulator import simulate
from core.sessions.store import SessionStore
from gui.screens.run import RunPanel
from gui.screens.sessions import SCRUB_STEPS, SessionsPanel
from gui.studio_state import StudioState
from tests.gui.run_backends import DEVICES, PacedBackend, simulated_run


@pytest.fixture(scope="module")
def run_data():
    return simulated_run(generated_tokens=6, micro_batches=2)


@pytest.fixture
def state(qtbot, run_data, tmp_path):
    problem, plan, _, _ = run_data
    s = StudioState()
    s.set_profile(problem.profile)
    s.set_problem(problem)
    s.set_plan(plan)
    s.set_workspace(str(tmp_path / "workspace.sqlite"))
    return s


@pytest.fixture
def live_run(qtbot, state, run_data):
    """A run made on the Run screen and recorded in the workspace: (run panel, run id)."""
    _, _, events, tokens = run_data
    panel = RunPanel(state, PacedBackend(events, tokens, speed=6.0))
    qtbot.addWidget(panel)
    panel.prompts_edit.setPlainText("first prompt\nsecond prompt")
    ids = []
    panel.run_recorded.connect(lambda s, r: ids.append(r))
    with qtbot.waitSignal(panel.run_finished, timeout=60_000):
        panel.start_run()
    assert panel.shutdown()
    return panel, ids[0]


def _sessions(qtbot, state) -> SessionsPanel:
    panel = SessionsPanel(state)
    qtbot.addWidget(panel)
    panel.resize(1400, 800)
    qtbot.waitUntil(lambda: panel.tree.topLevelItemCount() > 0, timeout=30_000)
    yield_panel = panel
    return yield_panel


def _open(qtbot, panel: SessionsPanel, run_id: int) -> None:
    with qtbot.waitSignal(panel.run_opened, timeout=30_000):
        panel.open_run(run_id)


def _play_to_end(qtbot, panel: SessionsPanel, timeout_ms: int) -> None:
    """Play the opened run's replay at 20x and wait until it has played to its end."""
    panel.set_speed(20.0)
    with qtbot.waitSignal(panel.replay_finished, timeout=timeout_ms):
        panel.play()


def test_lists_the_sessions_and_runs_of_the_workspace(qtbot, state, run_data):
    problem, plan, _, _ = run_data
    with SessionStore(state.workspace) as store:
        a = store.create_session("bench A")
        b = store.create_session("bench B")
        for mode in ("sequential", "no-bubbles"):
            record_simulation(store, a, problem, plan, simulate(problem, plan, mode, generated_tokens=4))
        record_simulation(store, b, problem, plan, simulate(problem, plan, "bubbles", generated_tokens=4))
    panel = _sessions(qtbot, state)
    names = [panel.tree.topLevelItem(i).text(0) for i in range(panel.tree.topLevelItemCount())]
    assert [n.split(" · ")[0] for n in names] == ["bench A", "bench B"] and " · 2 run(s) · " in names[0]
    assert [panel.tree.topLevelItem(0).child(i).text(1) for i in range(2)] == ["sequential", "no-bubbles"]
    assert sorted(panel.run_items()) == [1, 2, 3]
    assert all(item.text(3) == "completed" and item.text(2) == "simulated" for item in panel.run_items().values())
    panel.shutdown()


def test_a_replayed_run_draws_the_same_boxes_figures_and_text_as_live(qtbot, state, live_run):
    live_panel, run_id = live_run
    panel = _sessions(qtbot, state)
    _open(qtbot, panel, run_id)
    assert panel.monitor.timeline.box_count() == 0, "opened paused at the start"
    _play_to_end(qtbot, panel, 10_000)
    live, replayed = live_panel.monitor, panel.monitor
    assert replayed.timeline.lanes() == live.timeline.lanes() == DEVICES
    assert np.array_equal(replayed.timeline.boxes(), live.timeline.boxes())
    assert replayed.figures() == live.figures()
    assert replayed.text_edit.toPlainText() == live.text_edit.toPlainText()
    assert [c.text() for c in (replayed.ttft_card, replayed.rate_card, replayed.tokens_card)] == \
        [c.text() for c in (live.ttft_card, live.rate_card, live.tokens_card)]
    assert panel.scrubber.value() == panel.scrubber.maximum()
    panel.shutdown()


def test_seeking_shows_exactly_what_had_arrived_by_then(qtbot, state, live_run):
    _, run_id = live_run
    panel = _sessions(qtbot, state)
    _open(qtbot, panel, run_id)
    items = panel.replay.items
    # the middle event's arrival, not half the replayed time: on a loaded machine the events may
    # arrive in a few bursts, and half the time can fall before the first of them
    arrivals = sorted(i.recv_s for i in items if i.event is not None)
    t = arrivals[len(arrivals) // 2]
    panel.seek(t)
    prefix = [i for i in items if i.recv_s <= t]
    events = [i.event for i in prefix if i.event is not None]
    tokens = [i.tokens for i in prefix if i.tokens is not None]
    assert 0 < panel.monitor.timeline.box_count() == len(events) < len(items)
    assert panel.monitor.figures() == compute_figures(events, tokens)
    span = panel.replay.duration_s - panel.start_s
    assert panel.scrubber.value() == pytest.approx(SCRUB_STEPS * (t - panel.start_s) / span, abs=1)
    # the scrubber seeks too
    panel.scrubber.setValue(panel.scrubber.maximum())
    assert panel.monitor.timeline.box_count() == sum(1 for i in items if i.event is not None)
    panel.shutdown()


def test_the_label_and_the_time_give_the_runs_own_duration_not_the_loading_before_it():
    """A 0.38 s run whose first event came 15 s after recording began (its agents loading) read
    "over 15.15 s"; its own span is its first event's start to its last token."""
    from agents.protocol import TimelineEvent, TokenEvent
    from core.sessions.store import RecordedItem
    from gui.screens.sessions import replay_start_s, run_span_s

    event = TimelineEvent(device="a", stage=0, kind="compute", phase="prefill", step=0, micro_batch=0,
                          start_s=0.10, end_s=0.30)
    token = TokenEvent(micro_batch=0, step=1, sequence_ids=(0,), token_ids=(5,), t_s=0.48)
    items = [RecordedItem(seq=0, recv_s=15.0, event=event), RecordedItem(seq=1, recv_s=15.15,
                                                                       tokens=token)]
    assert run_span_s(items) == pytest.approx(0.38)
    assert replay_start_s(items) == pytest.approx(14.95)


def test_opening_a_run_labels_it_with_its_own_span_and_times_only_the_replayed_part(qtbot, state, live_run):
    from gui.screens.sessions import run_span_s

    _, run_id = live_run
    panel = _sessions(qtbot, state)
    _open(qtbot, panel, run_id)
    assert f"a {run_span_s(panel.replay.items):.2f} s run" in panel.run_label.text()
    assert panel.time_label.text() == f"0.00 / {run_span_s(panel.replay.items):.2f} s"
    assert panel.scrubber.value() == 0
    panel.shutdown()


def test_the_scrubber_reads_the_runs_own_time_and_ends_at_the_headers_span():
    """Its label read the arrivals' span plus the 0.05 s lead-in (0.09 s under "a 0.06 s run" for an
    expert-offload run): items arrive after they end, so the run's time is the events' and tokens'."""
    from agents.protocol import TimelineEvent, TokenEvent
    from core.sessions.store import RecordedItem
    from gui.screens.replay_clock import RunClock

    def event(start, end):
        return TimelineEvent(device="a", stage=0, kind="compute", phase="prefill", step=0, micro_batch=0,
                             start_s=start, end_s=end)

    token = TokenEvent(micro_batch=0, step=1, sequence_ids=(0,), token_ids=(5,), t_s=0.060)
    items = [RecordedItem(seq=0, recv_s=9.594, event=event(0.001, 0.023)),
             RecordedItem(seq=1, recv_s=9.610, event=event(0.030, 0.045)),
             RecordedItem(seq=2, recv_s=9.634, tokens=token)]
    clock = RunClock(items)
    assert clock.span_s == pytest.approx(0.059)
    assert clock.at(9.0) == 0.0 and clock.at(9.594) == pytest.approx(0.022) and clock.at(9.62) == pytest.approx(0.044)
    assert clock.at(9.7) == pytest.approx(0.059)


def test_a_replay_played_to_its_end_reads_the_headers_span(qtbot, state, live_run):
    from gui.screens.sessions import run_span_s

    _, run_id = live_run
    panel = _sessions(qtbot, state)
    _open(qtbot, panel, run_id)
    _play_to_end(qtbot, panel, 60_000)
    span = f"{run_span_s(panel.replay.items):.2f}"
    assert f"a {span} s run" in panel.run_label.text() and panel.time_label.text() == f"{span} / {span} s"
    panel.shutdown()


def test_pause_stops_the_replay_and_speed_changes_its_pace(qtbot, state, live_run):
    _, run_id = live_run
    panel = _sessions(qtbot, state)
    _open(qtbot, panel, run_id)
    panel.set_speed(0.25)
    assert panel.replay.speed == 0.25
    panel.play()
    qtbot.waitUntil(lambda: panel.monitor.timeline.box_count() > 0, timeout=30_000)
    panel.pause()
    shown = panel.monitor.timeline.box_count()
    position = panel.replay.position_s
    qtbot.wait(150)
    panel.monitor.flush()
    assert panel.monitor.timeline.box_count() == shown
    assert panel.replay.position_s == position and panel.replay.paused
    assert panel.play_button.text() == "Play"
    panel.shutdown()


def test_exports_the_trace_plan_and_profile_of_a_run(qtbot, state, live_run, run_data, tmp_path):
    problem, plan, events, _ = run_data
    _, run_id = live_run
    panel = _sessions(qtbot, state)
    _open(qtbot, panel, run_id)
    for what, name in (("trace", "t.json"), ("trace", "t.csv"), ("plan", "p.json"), ("profile", "f.json")):
        with qtbot.waitSignal(panel.exported, timeout=30_000) as done:
            panel.export(what, str(tmp_path / name))
        assert done.args == [what, str(tmp_path / name)]
    trace = json.loads((tmp_path / "t.json").read_text())
    assert sum(1 for e in trace["traceEvents"] if e.get("ph") == "X") == len(events)
    assert (tmp_path / "t.csv").read_text().count("\n") == len(events) + 1
    assert formats.load(tmp_path / "p.json", ShardPlan) == plan
    assert (tmp_path / "f.json").exists()
    panel.shutdown()


def test_a_file_that_is_not_a_workspace_is_reported_inline(qtbot, tmp_path):
    bad = tmp_path / "notes.sqlite"
    bad.write_text("these are my notes, not a database")
    state = StudioState()
    panel = SessionsPanel(state)
    qtbot.addWidget(panel)
    state.set_workspace(str(bad))
    qtbot.waitUntil(lambda: panel.message.isVisibleTo(panel), timeout=30_000)
    assert "not an EdgeShard workspace" in panel.message.text()
    assert "Traceback" not in panel.message.text()
    assert bad.read_text() == "these are my notes, not a database", "the file is left as it was"
    panel.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("edgeshard-sessions")]


def test_a_run_recorded_by_edgeshard_run_replays_in_the_sessions_screen(qtbot, tmp_path):
    """The CLI and the Run screen record through one path: a CLI run (real loopback agents)
    opens and replays here with its lanes, boxes, text and figures."""
    import contextlib
    import io

    from core.cli import main as cli_main
    from core.models.checkpoints import ModelRecipe, make_model
    from core.planning.plan import plan_from_boundaries

    devices = ["edge-0", "edge-1"]
    model = make_model(ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3),
                       tmp_path / "tiny-llama")
    formats.save(tmp_path / "plan.json", plan_from_boundaries("tiny-llama", 6, devices, [3]))
    workspace = tmp_path / "ws.sqlite"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli_main(["run", "--model", str(model), "--plan", str(tmp_path / "plan.json"), "--local",
                         "--prompt", "the river", "--max-new-tokens", "4", "--workspace", str(workspace)])
    assert code == 0
    state = StudioState()
    state.set_workspace(str(workspace))
    panel = _sessions(qtbot, state)
    session = panel.tree.topLevelItem(0)
    assert session.text(0).startswith("edgeshard run")
    [(run_id, item)] = panel.run_items().items()
    assert (item.text(1), item.text(2), item.text(3)) == ("sequential", "measured", "completed")
    _open(qtbot, panel, run_id)
    _play_to_end(qtbot, panel, 20_000)
    monitor = panel.monitor
    assert monitor.timeline.lanes() == devices
    assert all(monitor.timeline.box_count(device=d) > 0 for d in devices)
    generated = printed.getvalue().split("\nTTFT ")[0]
    assert generated and monitor.text_of(0) == generated
    assert monitor.figures().tokens == 4
    panel.shutdown()


def test_a_replay_at_its_end_shows_the_whole_run(qtbot, state):
    """The run's prediction (shown before it) was shorter than the run, so following it scrolled
    and the replay's end left the run's start out of view (the README's Sessions picture)."""
    _, _, events, tokens = simulated_run(generated_tokens=40, micro_batches=2)
    live = RunPanel(state, PacedBackend(events, tokens, speed=8.0))
    qtbot.addWidget(live)
    live.prompts_edit.setPlainText("first prompt\nsecond prompt")
    live.max_tokens_spin.setValue(2)  # predicted: 2 tokens; the backend plays a run of 40
    ids = []
    live.run_recorded.connect(lambda s, r: ids.append(r))
    with qtbot.waitSignal(live.run_finished, timeout=60_000):
        live.start_run()
    assert live.shutdown()
    panel = _sessions(qtbot, state)
    _open(qtbot, panel, ids[0])
    first, last = min(e.start_s for e in events), max(e.end_s for e in events)
    panel.seek(1e6)  # scrubbed to the end
    x0, x1 = panel.monitor.timeline.x_range()
    assert x0 <= first and x1 >= last
    panel.seek(0.0)
    _play_to_end(qtbot, panel, 20_000)  # played to the end
    x0, x1 = panel.monitor.timeline.x_range()
    assert x0 <= first and x1 >= last
    panel.shutdown()


def test_the_monitor_stops_refreshing_even_when_a_loader_outlives_the_shutdown(qtbot, state, run_data, monkeypatch):
    """A loader still finishing a read at quit must not leave the replay's refresh timer running."""
    import gui.screens.sessions

    problem, plan, _, _ = run_data
    with SessionStore(state.workspace) as store:
        record_simulation(store, store.create_session("s"), problem, plan,
                          simulate(problem, plan, "sequential", generated_tokens=4))
    panel = _sessions(qtbot, state)
    stopped = []
    monkeypatch.setattr(panel.monitor, "shutdown", lambda timeout_s=5.0: stopped.append(timeout_s) or True)
    with monkeypatch.context() as m:
        m.setattr(gui.screens.sessions, "shutdown_together", lambda runners, timeout_s=5.0: False)
        assert not panel.shutdown(1.0)
    assert stopped == [1.0]
    assert panel.shutdown()


def test_every_column_of_the_list_shows_at_1024x700(qtbot, state, run_data):
    """The page's width at 1024x700 (less the navigation): kind, status, tokens and started read
    without scrolling the list sideways."""
    problem, plan, _, _ = run_data
    with SessionStore(state.workspace) as store:
        record_simulation(store, store.create_session("a long session name of the studio"), problem, plan,
                          simulate(problem, plan, "no-bubbles", generated_tokens=4))
    panel = _sessions(qtbot, state)
    panel.resize(860, 560)
    panel.show()
    qtbot.waitExposed(panel)
    header = panel.tree.header()
    right = header.sectionPosition(5) + header.sectionSize(5)
    assert panel.width() <= 860 and right <= panel.tree.viewport().width()
    assert header.sectionSize(5) >= panel.tree.fontMetrics().horizontalAdvance("22:38")
    panel.shutdown()


def test_a_replayed_expert_offload_run_has_no_ghosts_of_layer_sharding_s_problem():
    """Its stored problem is the studio's (layer sharding's, the Llama's): its prediction drew a layer-sharding
    schedule under an expert-offload replay. Without the technique's own problem it predicts nothing, saying why."""
    from core.planning.plan import Stage
    from core.sessions.store import RunInfo
    from core.techniques.run_origin import replay_prediction
    from tests.gui.problems import make_problem

    problem = make_problem()
    plan = ShardPlan(model="demo-moe", num_units=2, stages=(Stage(device=problem.source, start=0, end=2,
                                                                  kind="expert-offload"),))
    info = RunInfo(id=1, session_id=1, model="demo-moe", mode="sequential", kind="live", status="completed",
                   started_at="", ended_at=None, settings={"prompts": ["a"], "max_new_tokens": 4}, figures={})
    events, why = replay_prediction(info, problem, plan, None)
    assert events == () and why.startswith("No prediction: the run's technique's own problem is not recorded")


def test_a_run_whose_stored_origin_is_unreadable_opens_saying_no_prediction_and_why(run_data, tmp_path):
    """A damaged origin (a hand-edited or half-written workspace) costs the replay its prediction, not the replay."""
    import sqlite3

    from core.reporting import NullReporter
    from gui.screens.sessions import load_run

    problem, plan, _, _ = run_data
    workspace = tmp_path / "ws.sqlite"
    with SessionStore(workspace) as store:
        run_id = record_simulation(store, store.create_session("s"), problem, plan,
                                   simulate(problem, plan, "no-bubbles", generated_tokens=4))
    with sqlite3.connect(workspace) as db:
        db.execute("UPDATE runs SET origin_json = ? WHERE id = ?", (b"{not json", run_id))
    loaded = load_run(NullReporter(), str(workspace), run_id)
    assert loaded.items and loaded.predicted == ()
    assert loaded.prediction_note.startswith("No prediction: ") and "origin" in loaded.prediction_note


def test_a_recovered_runs_details_name_its_plan_and_the_plan_it_was_replanned_to(qtbot, state, run_data):
    """A run a lost device re-planned (``final_plan_id``, schema v5) says so where its plan is shown; a run that
    finished where it started names its plan alone."""
    problem, plan, _, _ = run_data
    with SessionStore(state.workspace) as store:
        session = store.create_session("recovery")
        kept, recovered = (record_simulation(store, session, problem, plan,
                                             simulate(problem, plan, "bubbles", generated_tokens=4)) for _ in "ab")
        final = store.set_final_plan(recovered, plan)  # as a recorded recovery stores its re-plan
        started = {r: store.run(r).plan_id for r in (kept, recovered)}
    panel = _sessions(qtbot, state)
    _open(qtbot, panel, recovered)
    assert f" · plan {started[recovered]}, re-planned to {final} · " in panel.run_label.text()
    _open(qtbot, panel, kept)
    assert f" · plan {started[kept]} · " in panel.run_label.text() and "re-planned" not in panel.run_label.text()
    assert panel.shutdown()

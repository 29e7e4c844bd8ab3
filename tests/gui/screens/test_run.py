"""The Run screen: Start streams a run (on a worker thread) into the timeline, figures and
text; Stop ends it and leaves no thread; errors are shown in plain words; the run is
recorded in the workspace."""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest
from PySide6.QtCore import Qt

from core.runs.metrics import compute_figures
from core.sessions.store import SessionStore
from gui.screens.run import RunPanel
from gui.studio_state import StudioState
from tests.gui.run_backends import DEVICES, PacedBackend, cluster_run_panel, simulated_run


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


def _panel(qtbot, state, backend) -> RunPanel:
    panel = RunPanel(state, backend)
    qtbot.addWidget(panel, before_close_func=lambda w: w.shutdown(5.0))  # no prediction thread left
    panel.resize(1400, 800)
    panel.prompts_edit.setPlainText("first prompt\nsecond prompt")
    return panel


def _no_run_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("edgeshard-run")]


def test_start_streams_the_run_into_timeline_figures_and_text(qtbot, state, run_data):
    _, _, events, tokens = run_data
    backend = PacedBackend(events, tokens, speed=8.0)
    panel = _panel(qtbot, state, backend)
    with qtbot.waitSignal(panel.run_finished, timeout=60_000) as done:
        qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
        assert panel.is_running() and not panel.start_button.isEnabled() and panel.stop_button.isEnabled()
    assert done.args == ["completed"]
    assert backend.thread_names and backend.thread_names[0] != threading.main_thread().name
    monitor = panel.monitor
    for device in DEVICES:
        assert monitor.timeline.box_count(device) == sum(1 for e in events if e.device == device)
    assert monitor.figures() == compute_figures(events, tokens)
    assert monitor.ttft_card.text() == f"{compute_figures(events, tokens).ttft_s * 1000:.1f} ms"
    assert monitor.text_of(0) == "".join(t.text[0] for t in tokens if t.sequence_ids == (0,))
    assert "first prompt" in monitor.text_edit.toPlainText()
    assert set(monitor.util_bars) == set(DEVICES)
    assert panel.start_button.isEnabled() and not panel.stop_button.isEnabled()
    panel.shutdown()
    assert _no_run_threads()


def test_stop_ends_a_run_and_leaves_no_thread_running(qtbot, state, run_data):
    _, _, events, tokens = run_data
    backend = PacedBackend(events, tokens, speed=1.0, repeat=True)  # only ends when stopped
    panel = _panel(qtbot, state, backend)
    panel.start_run()
    qtbot.waitUntil(lambda: panel.monitor.timeline.box_count() > 10, timeout=30_000)
    with qtbot.waitSignal(panel.run_finished, timeout=30_000) as done:
        qtbot.mouseClick(panel.stop_button, Qt.MouseButton.LeftButton)
    assert done.args == ["stopped"]
    assert not panel.is_running() and panel.start_button.isEnabled()
    qtbot.waitUntil(_no_run_threads, timeout=30_000)
    drawn = panel.monitor.timeline.box_count()
    assert 10 < drawn < backend.emitted + 1
    with SessionStore(state.workspace) as store:
        (run,) = store.runs()
        assert run.status == "stopped"
        assert len(store.events(run.id)) == drawn, "what was drawn is what was recorded"


def test_a_completed_run_is_recorded_in_the_workspace(qtbot, state, run_data):
    _, plan, events, tokens = run_data
    panel = _panel(qtbot, state, PacedBackend(events, tokens, speed=10.0))
    recorded = []
    panel.run_recorded.connect(lambda s, r: recorded.append((s, r)))
    with qtbot.waitSignal(panel.run_finished, timeout=60_000):
        panel.start_run()
    panel.shutdown()
    with SessionStore(state.workspace) as store:
        (run,) = store.runs()
        assert recorded == [(run.session_id, run.id)]
        assert run.status == "completed" and run.kind == "measured"
        assert run.settings["prompts"] == ["first prompt", "second prompt"]
        assert store.plan(run.plan_id) == plan
        assert sorted(store.events(run.id), key=lambda e: (e.start_s, e.device)) == \
            sorted(events, key=lambda e: (e.start_s, e.device))
        assert run.figures["tokens"] == sum(len(t.token_ids) for t in tokens)


def test_a_failing_run_shows_its_reason_inline_not_a_traceback(qtbot, state, run_data):
    _, _, events, tokens = run_data
    panel = _panel(qtbot, state, PacedBackend(events, tokens, speed=20.0, fail_after=20))
    with qtbot.waitSignal(panel.run_finished, timeout=60_000) as done:
        panel.start_run()
    assert done.args == ["failed"]
    assert panel.message.isVisibleTo(panel)
    assert "laptop: agent stopped answering" in panel.message.text()
    assert "Traceback" not in panel.message.text()
    panel.shutdown()
    with SessionStore(state.workspace) as store:
        assert [r.status for r in store.runs()] == ["failed"]


def test_a_failed_runs_reason_is_in_the_log_not_only_that_it_failed(qtbot, state, run_data):
    _, _, events, tokens = run_data
    logged = []
    state.log_added.connect(lambda level, text: logged.append((level, text)))
    panel = _panel(qtbot, state, PacedBackend(events, tokens, speed=20.0, fail_after=20))
    with qtbot.waitSignal(panel.run_finished, timeout=60_000):
        panel.start_run()
    errors = [text for level, text in logged if level == "error"]
    assert errors and errors[-1].startswith("Run failed: ") and "laptop: agent stopped answering" in errors[-1]
    panel.shutdown()


def test_start_without_prompts_or_cluster_says_what_to_do(qtbot, state):
    panel = RunPanel(state, backend=None)
    qtbot.addWidget(panel, before_close_func=lambda w: w.shutdown(5.0))
    panel.prompts_edit.setPlainText("   \n")
    panel.start_run()
    assert not panel.is_running()
    text = panel.message.text()
    assert "at least one prompt" in text and "No cluster to run on" in text


def test_start_before_any_profile_points_to_profiling_not_to_auto_solve(qtbot, run_data):
    """A new presenter's first Start in the demo: Auto-solve (what it advised) has nothing to solve yet,
    and itself says to profile first; Profile cluster makes the plan."""
    panel = _panel(qtbot, StudioState(), PacedBackend(*run_data[2:]))
    panel.start_run()
    assert not panel.is_running()
    text = panel.message.text()
    assert "Profile cluster" in text and "Ctrl+P" in text and "Ctrl+R" not in text


def test_start_while_a_new_profiles_plan_is_being_solved_waits_for_it_then_runs(qtbot, state, run_data):
    """Ctrl+Return right after Profile cluster (the demo's first launch): the plan was still the one-device
    placeholder, so Start refused it, and the refusal vanished when the solved plan landed a moment
    later; nothing ran. Start now waits for the solve and runs its plan."""
    _problem, plan, events, tokens = run_data
    panel = _panel(qtbot, state, PacedBackend(events, tokens, speed=50.0))
    state.set_plan_solving(True)
    panel.start_run()
    assert not panel.is_running() and panel.message.isHidden()
    assert "Waiting for the new profile's plan" in panel.status_label.text()
    with qtbot.waitSignal(panel.run_finished, timeout=30_000):
        state.set_plan(plan)
        state.set_plan_solving(False)
    assert panel.message.isHidden()


def _predicted_mbs(panel) -> set[int]:
    return set(panel.monitor.timeline.boxes(predicted=True)["micro_batch"].tolist())


def test_the_predicted_timeline_follows_mode_and_micro_batches(qtbot, state):
    panel = _panel(qtbot, state, None)
    timeline = panel.monitor.timeline
    panel.mode_combo.setCurrentText("sequential")
    panel.micro_batches_spin.setValue(1)
    qtbot.waitUntil(lambda: not panel.predict_runner.is_busy() and not panel._predict_timer.isActive()
                    and _predicted_mbs(panel) == {0}, timeout=30_000)
    panel.mode_combo.setCurrentText("no-bubbles")
    panel.micro_batches_spin.setValue(2)
    qtbot.waitUntil(lambda: _predicted_mbs(panel) == {0, 1}, timeout=30_000)
    assert timeline.predicted_check.isEnabled()
    assert panel.shutdown(5.0)


def test_micro_batches_come_from_the_plan_in_every_mode_unless_overridden(qtbot, state):
    """The plan (2 micro-batches) decides; sequential is not forced to one micro-batch."""
    panel = _panel(qtbot, state, None)
    assert state.plan.micro_batches == 2
    assert panel.micro_batches_spin.value() == 0 and panel.micro_batches_spin.text() == "Plan's (2)"
    assert panel.settings().micro_batches is None
    panel.mode_combo.setCurrentText("sequential")
    qtbot.waitUntil(lambda: not panel.predict_runner.is_busy() and not panel._predict_timer.isActive()
                    and _predicted_mbs(panel) == {0, 1}, timeout=30_000)
    panel.micro_batches_spin.setValue(1)
    assert panel.settings().micro_batches == 1
    qtbot.waitUntil(lambda: not panel.predict_runner.is_busy() and not panel._predict_timer.isActive()
                    and _predicted_mbs(panel) == {0}, timeout=30_000)
    assert panel.shutdown(5.0)


def _recorded_run(qtbot, state, run_data, choose):
    """The workspace's only run after ``choose(panel)`` set the Run screen's controls and it ran."""
    _, _, events, tokens = run_data
    panel = _panel(qtbot, state, PacedBackend(events, tokens, speed=20.0))
    choose(panel)
    with qtbot.waitSignal(panel.run_finished, timeout=60_000):
        panel.start_run()
    panel.shutdown()
    with SessionStore(state.workspace) as store:
        (run,) = store.runs()
    return run


@pytest.mark.parametrize("override, used", [(0, 2), (3, 3)])
def test_a_recorded_run_keeps_its_micro_batch_count_and_whether_the_operator_overrode_the_plans(
        qtbot, state, run_data, override, used):
    run = _recorded_run(qtbot, state, run_data, lambda panel: panel.micro_batches_spin.setValue(override))
    assert run.settings["micro_batches"] == used
    assert run.settings["micro_batches_override"] == (override or None)
    assert run.settings["plan_micro_batches"] == 2


def test_quick_settings_changes_predict_off_the_gui_thread_once_and_keep_the_gui_responsive(
        qtbot, state, monkeypatch):
    import core.runs.prediction as run_prediction
    from PySide6.QtCore import QElapsedTimer, QTimer

    calls = []
    real_simulate = run_prediction.simulate

    def slow_simulate(*args, **kwargs):  # a big plan: the simulation takes a while
        calls.append((threading.current_thread() is threading.main_thread(), kwargs.get("micro_batch_sizes")))
        time.sleep(1.0)
        return real_simulate(*args, **kwargs)

    monkeypatch.setattr(run_prediction, "simulate", slow_simulate)
    panel = _panel(qtbot, state, None)
    # debounced over 1 s here (200 ms in the studio): the steps below are 20 ms apart on a quiet host,
    # and a loaded one must not stretch one past the debounce and count as a pause
    panel._predict_timer.setInterval(1000)
    panel.mode_combo.setCurrentText("no-bubbles")
    gaps, clock = [], QElapsedTimer()
    clock.start()

    def tick():
        gaps.append(clock.restart())

    ticker = QTimer()
    ticker.setInterval(10)
    ticker.timeout.connect(tick)
    ticker.start()
    for k in range(1, 9):  # an operator stepping the spin box quickly
        panel.micro_batches_spin.setValue(k)
        qtbot.wait(20)
    panel.prompts_edit.setPlainText("a\nb\nc\nd\ne")
    panel.micro_batches_spin.setValue(2)
    qtbot.waitUntil(lambda: _predicted_mbs(panel) == {0, 1} and not panel.predict_runner.is_busy()
                    and not panel._predict_timer.isActive(), timeout=60_000)
    ticker.stop()
    assert calls and not any(on_gui for on_gui, _ in calls)
    assert calls[-1][1] == (3, 2)  # the real run's split of 5 prompts, not 3 + 3
    assert len(calls) <= 3  # debounced: not one simulation per spin-box step
    assert max(gaps) < 800  # the GUI thread was never blocked by a 1 s simulation (room for a loaded host)
    assert panel.shutdown(5.0)


# -- against a real local run: in-process agents, ZeroMQ, a generated tiny Llama -------------------


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory):
    from core.models.checkpoints import ModelRecipe, make_model
    from core.planning.plan import plan_from_boundaries
    from tests.core.in_process_agents import in_process_cluster

    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)
    model_dir = str(make_model(recipe, tmp_path_factory.mktemp("gui-run") / "tiny-llama"))
    devices = ["src", "mid", "head"]
    plan = plan_from_boundaries("tiny-llama", 6, devices, [2, 3])
    with in_process_cluster(devices) as (coordinator, _):
        yield coordinator, plan, model_dir, devices


def test_stop_ends_a_real_local_run_and_the_cluster_runs_again(qtbot, real_cluster, tmp_path):
    coordinator, plan, model_dir, devices = real_cluster
    state, panel = cluster_run_panel(qtbot, coordinator, plan, tmp_path / "ws.sqlite", model_dir,
                                     ["the river and its banks", "hello there"],
                                     1500)  # seconds of decoding if nobody stops it
    panel.mode_combo.setCurrentText("no-bubbles")
    panel.micro_batches_spin.setValue(2)
    panel.start_run()
    timeline = panel.monitor.timeline

    def streaming():  # agents send events in batches, tokens at once: wait for both
        timeline.flush()
        return len(panel.monitor.tokens) >= 6 and all(timeline.box_count(d, "compute") > 0 for d in devices)

    qtbot.waitUntil(streaming, timeout=60_000)
    assert timeline.lanes() == devices
    with qtbot.waitSignal(panel.run_finished, timeout=60_000) as done:
        qtbot.mouseClick(panel.stop_button, Qt.MouseButton.LeftButton)
    assert done.args == ["stopped"]
    qtbot.waitUntil(_no_run_threads, timeout=30_000)
    stopped_tokens = panel.monitor.figures().tokens
    assert 6 <= stopped_tokens < 2 * 1500
    # the agents are back to ready: a short run on the same cluster completes
    panel.max_tokens_spin.setValue(4)
    with qtbot.waitSignal(panel.run_finished, timeout=60_000) as done:
        panel.start_run()
    assert done.args == ["completed"], panel.message.text()
    assert panel.monitor.figures().tokens == 2 * 4
    assert panel.monitor.text_of(0) and panel.monitor.text_of(1)
    assert panel.shutdown()
    with SessionStore(state.workspace) as store:
        runs = store.runs()
        assert [r.status for r in runs] == ["stopped", "completed"]
    # the real run replays exactly as it was seen live
    from gui.screens.sessions import SessionsPanel
    from tests.gui.screens.test_sessions import _play_to_end

    sessions = SessionsPanel(state)
    qtbot.addWidget(sessions)
    with qtbot.waitSignal(sessions.run_opened, timeout=60_000):
        sessions.open_run(runs[1].id)
    _play_to_end(qtbot, sessions, 20_000)
    assert np.array_equal(sessions.monitor.timeline.boxes(), panel.monitor.timeline.boxes())
    assert sessions.monitor.figures() == panel.monitor.figures()
    assert sessions.monitor.text_edit.toPlainText() == panel.monitor.text_edit.toPlainText()
    assert sessions.shutdown()


def test_a_second_start_of_the_same_plan_loads_no_stage_again(qtbot, real_cluster, tmp_path, monkeypatch):
    coordinator, plan, model_dir, devices = real_cluster
    coordinator.unload()  # whatever the module's earlier runs left loaded
    sent: list[str] = []
    request_async = coordinator.request_async
    monkeypatch.setattr(coordinator, "request_async",
                        lambda device, msg: (sent.append(type(msg).__name__), request_async(device, msg))[1])
    _state, panel = cluster_run_panel(qtbot, coordinator, plan, tmp_path / "ws.sqlite", model_dir, ["hello there"], 2)
    loads = []
    for _ in range(2):
        sent.clear()
        with qtbot.waitSignal(panel.run_finished, timeout=60_000) as done:
            panel.start_run()
        assert done.args == ["completed"], panel.message.text()
        loads.append(sent.count("LoadShard"))
        assert sent.count("StartRun") == len(plan.stages)
    assert loads == [len(plan.stages), 0]
    assert panel.shutdown()


def test_send_stage_weights_ships_each_agent_its_slice_and_runs_from_it(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESHARD_HOME", str(tmp_path / "home"))  # the coordinator's slice cache
    import transformers  # noqa: F401

    from agents.agent import Agent
    from agents.transport import CurveKeys
    from core.models.checkpoints import ModelRecipe, make_model
    from core.planning.plan import plan_from_boundaries
    from core.runs.coordinator import AgentEndpoint, Coordinator
    from gui.connection.cluster_backend import ClusterRunBackend

    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)
    model_dir = str(make_model(recipe, tmp_path / "tiny-llama"))
    keys = CurveKeys.generate()
    devices = ["src", "head"]
    agents = [Agent(d, keys.public, weights_dir=tmp_path / "on-device" / d).start() for d in devices]
    coordinator = Coordinator([AgentEndpoint(a.device, a.control_address, a.keys.public) for a in agents], keys)
    coordinator.open()
    try:
        state = StudioState()
        state.set_workspace(str(tmp_path / "ws.sqlite"))
        state.set_plan(plan_from_boundaries("tiny-llama", 6, devices, [3]))
        panel = RunPanel(state, ClusterRunBackend(coordinator, state))
        qtbot.addWidget(panel)
        panel.model_edit.setText(model_dir)
        panel.prompts_edit.setPlainText("the river")
        panel.max_tokens_spin.setValue(3)
        assert not panel.send_weights_check.isChecked()  # default: each device's own copy
        panel.send_weights_check.setChecked(True)
        assert panel.settings().send_weights
        with qtbot.waitSignal(panel.run_finished, timeout=60_000) as done:
            panel.start_run()
        assert done.args == ["completed"], panel.message.text()
        for a in agents:
            blobs = list((tmp_path / "on-device" / a.device / "blobs").iterdir())
            assert blobs and not [b for b in blobs if b.name.endswith(".part")]
            assert any("received weights" in line and "checksum ok" in line for line in a._logs)
        assert sorted(p.name.rsplit("-units-", 1)[1] for p in (tmp_path / "home" / "stage-weights").iterdir()) \
            == ["0-3", "3-6"]
        assert panel.shutdown()
    finally:
        coordinator.close()
        for a in agents:
            a.close()


def test_a_failed_runs_banner_goes_when_a_new_plan_is_made(qtbot, state, run_data):
    problem, plan, events, tokens = run_data
    panel = _panel(qtbot, state, PacedBackend(events, tokens, speed=20.0, fail_after=20))
    with qtbot.waitSignal(panel.run_finished, timeout=60_000):
        panel.start_run()
    assert panel.message.isVisibleTo(panel)
    state.set_plan(msgspec.structs.replace(plan, micro_batches=plan.micro_batches + 1))
    assert not panel.message.isVisibleTo(panel)
    assert panel.status_label.text() == "Run failed."  # the outcome itself stays
    panel.shutdown()


def test_the_no_cluster_banner_goes_when_a_cluster_is_attached(qtbot, state, run_data):
    _, _, events, tokens = run_data
    panel = RunPanel(state, backend=None)
    qtbot.addWidget(panel, before_close_func=lambda w: w.shutdown(5.0))
    panel.start_run()
    assert "No cluster to run on" in panel.message.text() and panel.message.isVisibleTo(panel)
    panel.set_backend(PacedBackend(events, tokens, speed=20.0))
    assert not panel.message.isVisibleTo(panel)


def test_the_run_page_does_not_move_when_a_run_ends(qtbot, state, run_data):
    from PySide6.QtWidgets import QSplitter

    _, _, events, tokens = run_data
    panel = _panel(qtbot, state, PacedBackend(events, tokens, speed=1.0))
    panel.show()
    qtbot.waitExposed(panel)
    splitter = panel.findChild(QSplitter)
    done = []
    panel.run_finished.connect(done.append)
    panel.start_run()
    qtbot.wait(20)  # laid out as the run starts, before its micro-batches are seen
    during = splitter.sizes()
    qtbot.waitUntil(lambda: done == ["completed"], timeout=60_000)
    qtbot.wait(50)
    assert splitter.sizes() == during
    assert panel.monitor.timeline.legend_label.width() > 100  # the legend still shows (it only stopped pushing)
    panel.shutdown()


def test_a_finished_run_becomes_the_cluster_screens_measured_traffic(qtbot, state, run_data):
    _, _, events, tokens = run_data
    panel = _panel(qtbot, state, PacedBackend(events, tokens, speed=8.0))
    with qtbot.waitSignal(state.last_run_changed, timeout=60_000):
        panel.start_run()
    assert state.last_run_events == tuple(panel.monitor.events) and len(state.last_run_events) == len(events)
    assert len(state.last_run_tokens) == len(tokens)
    panel.shutdown()


def _recorded_settings_after_a_run(qtbot, state, run_data, set_fields) -> dict:
    """The settings recorded with a run started after ``set_fields(panel)``."""
    _, _, events, tokens = run_data
    panel = _panel(qtbot, state, PacedBackend(events, tokens, speed=10.0))
    set_fields(panel)
    with qtbot.waitSignal(panel.run_finished, timeout=60_000):
        panel.start_run()
    panel.shutdown()
    with SessionStore(state.workspace) as store:
        (run,) = store.runs()
        return run.settings


def test_the_repetition_penalty_is_off_by_default_and_the_one_set_is_recorded_with_the_run(qtbot, state, run_data):
    def set_fields(panel):
        assert panel.settings().repetition_penalty == 1.0 and panel.penalty_spin.text() == "off"
        panel.penalty_spin.setValue(1.25)

    assert _recorded_settings_after_a_run(qtbot, state, run_data, set_fields)["repetition_penalty"] == 1.25


def test_the_no_repeat_ngram_size_is_off_by_default_and_the_one_set_is_recorded_with_the_run(qtbot, state, run_data):
    def set_fields(panel):
        assert panel.settings().no_repeat_ngram_size == 0 and panel.ngram_spin.text() == "off"
        assert (panel.ngram_spin.minimum(), panel.ngram_spin.maximum()) == (0, 64)  # GenerationSettings' range
        panel.ngram_spin.setValue(3)

    assert _recorded_settings_after_a_run(qtbot, state, run_data, set_fields)["no_repeat_ngram_size"] == 3


def test_the_cluster_backend_hands_the_ngram_size_and_the_penalty_to_the_generation(qtbot, state, monkeypatch,
                                                                                   tmp_path):
    import gui.connection.cluster_backend as cluster_backend
    from gui.screens.run import RunSettings

    seen = []

    class Out:
        class result:
            run_id, wall_s, recoveries = "r", 0.0, ()
        texts = ("x",)

    def fake_generate(coordinator, plan, model_dir, prompts, settings, **_kw):
        seen.append(settings)
        return Out()

    monkeypatch.setattr(cluster_backend, "generate", fake_generate)

    class Coordinator:
        endpoints = {d: None for d in state.plan.devices()}

        def is_loaded(self, *_a):
            return True

    backend = cluster_backend.ClusterRunBackend(Coordinator(), state)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    backend._run(RunSettings(model_dir=str(model_dir), prompts=("a",), max_new_tokens=2, mode="sequential",
                             micro_batches=None, repetition_penalty=1.2, no_repeat_ngram_size=2), None, None)
    assert (seen[0].repetition_penalty, seen[0].no_repeat_ngram_size) == (1.2, 2)


def test_the_run_screen_recovers_from_a_lost_device_by_default_and_can_be_set_to_stop(qtbot, state, run_data):
    _, _, events, tokens = run_data
    panel = _panel(qtbot, state, PacedBackend(events, tokens, speed=8.0))
    assert panel.on_failure_combo.currentText() == "Re-plan and resume"
    assert panel.settings().on_failure == "replan"
    panel.on_failure_combo.setCurrentIndex(panel.on_failure_combo.findData("stop"))
    settings = panel.settings()
    assert settings.on_failure == "stop"
    panel.on_failure_combo.setCurrentIndex(0)
    panel.apply_settings(settings)
    assert panel.on_failure_combo.currentData() == "stop"


class _RecoveringBackend(PacedBackend):
    """A run that lost a device and finished on another plan, as ClusterRunBackend reports it."""

    def __init__(self, events, tokens, recovered_plan):
        super().__init__(events, tokens, speed=8.0)
        self.recovered_plan = recovered_plan

    def run(self, settings, sink, reporter):
        super().run(settings, sink, reporter)
        return {"run_id": "r", "wall_s": 0.1, "texts": [], "recoveries": ["server lost at step 3: re-planned onto "
                                                                           "phone, laptop"],
                "recovered_plan": self.recovered_plan}


def test_after_a_recovery_the_plan_the_run_finished_on_becomes_the_current_plan(qtbot, state, run_data):
    _, plan, events, tokens = run_data
    survivors = msgspec.structs.replace(plan, stages=tuple(
        msgspec.structs.replace(st, device=DEVICES[i % 2]) for i, st in enumerate(plan.stages[:2])))
    survivors = msgspec.structs.replace(survivors, stages=(
        *survivors.stages[:-1], msgspec.structs.replace(survivors.stages[-1], end=plan.stages[-1].end)))
    panel = _panel(qtbot, state, _RecoveringBackend(events, tokens, survivors))
    with qtbot.waitSignal(panel.run_finished, timeout=60_000) as done:
        panel.start_run()
    assert done.args == ["completed"]
    assert "Recovered: server lost at step 3" in panel.status_label.text()
    assert state.plan == survivors
    with SessionStore(state.workspace) as store:  # recorded: started on the plan, finished on the re-plan
        (run,) = store.runs()
        assert store.plan(run.plan_id) == plan and store.plan(run.final_plan_id) == survivors


def test_the_run_screen_refuses_a_plan_on_an_offline_device_naming_it(qtbot, real_cluster, tmp_path):
    from gui.connection.cluster_backend import ClusterRunBackend

    coordinator, plan, model_dir, devices = real_cluster
    state = StudioState()
    state.set_workspace(str(tmp_path / "ws.sqlite"))
    state.set_plan(plan)
    state.set_offline((devices[-1],))
    panel = RunPanel(state, ClusterRunBackend(coordinator, state))
    qtbot.addWidget(panel, before_close_func=lambda w: w.shutdown(5.0))
    panel.model_edit.setText(model_dir)
    panel.prompts_edit.setPlainText("the river")
    panel.start_run()  # refused at Start, before any work
    assert not panel.is_running()
    assert f"{devices[-1]!r}, which is offline" in panel.message.text()


def test_a_finished_run_that_the_timeline_followed_is_shown_whole(qtbot, state):
    """Before a run the view shows the prediction; a run longer than it is followed with a window
    of that width, and when the run ended its start (the prefill) stayed scrolled out of view (the
    README's Run picture began at 75 ms)."""
    _, _, events, tokens = simulated_run(generated_tokens=40, micro_batches=2)
    panel = _panel(qtbot, state, PacedBackend(events, tokens, speed=8.0))
    panel.max_tokens_spin.setValue(2)  # predicted: 2 tokens; the backend plays a run of 40
    panel.show()
    qtbot.waitExposed(panel)
    timeline = panel.monitor.timeline
    with qtbot.waitSignal(panel.run_finished, timeout=60_000):
        panel.start_run()
    x0, x1 = timeline.x_range()
    assert x0 <= min(e.start_s for e in events) and x1 >= max(e.end_s for e in events)
    assert timeline.follow_live()  # still following: the next run is followed too
    panel.shutdown()


def test_a_finished_run_keeps_the_range_the_operator_chose(qtbot, state, run_data):
    _, _, events, tokens = run_data
    panel = _panel(qtbot, state, PacedBackend(events, tokens, speed=1.0))
    panel.show()
    qtbot.waitExposed(panel)
    timeline = panel.monitor.timeline
    with qtbot.waitSignal(panel.run_finished, timeout=60_000):
        panel.start_run()
        qtbot.wait(50)
        timeline.set_x_range(0.01, 0.02)  # the operator zooms in while it runs
    assert timeline.x_range() == pytest.approx((0.01, 0.02))
    panel.shutdown()


def test_start_refuses_a_plan_the_plan_screen_flags_and_says_to_auto_solve(qtbot, state, run_data):
    _, plan, events, tokens = run_data
    backend = PacedBackend(events, tokens, speed=8.0)
    panel = _panel(qtbot, state, backend)
    source = state.problem.source
    over = msgspec.structs.replace(plan, stages=(msgspec.structs.replace(plan.stages[0], device=source, start=0,
                                                                        end=plan.num_units),))
    cluster = state.problem.profile.cluster
    devices = tuple(msgspec.structs.replace(d, memory_bytes=1) if d.id == source else d
                    for d in cluster.devices)
    state.set_problem(msgspec.structs.replace(state.problem, profile=msgspec.structs.replace(
        state.problem.profile, cluster=msgspec.structs.replace(cluster, devices=devices))))
    state.set_plan(over)
    panel.start_run()
    assert not panel.is_running() and backend.thread_names == []
    assert "Auto-solve" in panel.message.text()


def test_each_technique_keeps_its_own_micro_batches(qtbot, state, run_data):
    from core.planning.plan import Stage

    _, plan, events, tokens = run_data
    panel = _panel(qtbot, state, PacedBackend(events, tokens))
    panel.micro_batches_spin.setValue(2)
    dense = msgspec.structs.replace(plan, stages=(Stage(device=plan.stages[0].device, start=0, end=plan.num_units,
                                                        kind="attention-offload-dense"),))
    state.set_plan(dense)
    state.propose_run_options({"compute_replicas": 1, "schedule": "rotational"}, 3)
    assert panel.micro_batches_spin.value() == 3
    state.use_technique("layer-sharding")
    assert state.plan == plan and panel.micro_batches_spin.value() == 2
    state.use_technique("attention-offload")
    assert panel.micro_batches_spin.value() == 3


def test_re_plan_and_resume_re_plans_when_an_agent_refuses_its_shard_over_a_budget_the_profile_overstated(tmp_path):
    import transformers  # noqa: F401  (imported once here, not concurrently in the agents' threads)

    from agents.agent import Agent
    from agents.emulation import DeviceEmulation
    from agents.transport import CurveKeys
    from core.devices.cluster import Cluster, Device, Link
    from core.devices.profile import DeviceTimes, ProfiledWorkload, Profile
    from core.models.checkpoints import ModelRecipe, make_model
    from core.models.units import model_spec_from_config
    from core.planning.plan import plan_from_boundaries
    from core.planning.problem import PlanningProblem, Workload
    from core.reporting import RecordingReporter
    from core.runs.coordinator import AgentEndpoint, Coordinator
    from core.runs.generation import load_tokenizer
    from gui.connection.cluster_backend import ClusterRunBackend
    from gui.screens.run_job import RunSettings
    from tests.core.hf_reference import hf_greedy_new_tokens

    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)
    model_dir = str(make_model(recipe, tmp_path / "tiny-llama"))
    import json
    from pathlib import Path

    model = model_spec_from_config(json.loads((Path(model_dir) / "config.json").read_text()), dtype="fp32",
                                   name="tiny-llama")
    devices = (Device(id="a", memory_bytes=1 << 30), Device(id="b", memory_bytes=1 << 30))  # b's is overstated
    times = tuple(DeviceTimes(device=d.id, decode_batch_sizes=(1,), decode_s=tuple((0.001 * (1 + i),) for _ in range(6)),
                              prefill_token_counts=(16,), prefill_s=tuple((0.002 * (1 + i),) for _ in range(6)))
                  for i, d in enumerate(devices))
    links = (Link(src="a", dst="b", bandwidth_mbit_s=1000.0, latency_ms=0.1),
             Link(src="b", dst="a", bandwidth_mbit_s=1000.0, latency_ms=0.1))
    problem = PlanningProblem(name="t", source="a", workload=Workload(prompt_tokens=16, generated_tokens=4),
                              profile=Profile(model=model, cluster=Cluster(devices=devices, links=links), times=times,
                                              profiled_workload=ProfiledWorkload(prompt_tokens=16), source="synthetic"))
    keys = CurveKeys.generate()
    agents = [Agent("a", keys.public).start(),
              Agent("b", keys.public, emulation=DeviceEmulation(memory_budget_bytes=200_000)).start()]
    co = Coordinator([AgentEndpoint(x.device, x.control_address, x.keys.public) for x in agents], keys)
    co.open()
    try:
        state = StudioState()
        state.set_problem(problem)
        state.set_plan(plan_from_boundaries("tiny-llama", 6, ["a", "b"], [1]))  # b gets 4 blocks and the head
        settings = RunSettings(model_dir=model_dir, prompts=("the river",), max_new_tokens=4, mode="sequential",
                               micro_batches=None, on_failure="replan")
        tokens = []
        sink = type("Sink", (), {"on_event": lambda self, e: None, "on_tokens": lambda self, t: tokens.append(t)})()
        said = ClusterRunBackend(co, state).run(settings, sink, RecordingReporter())
    finally:
        co.close()
        for x in agents:
            x.close()
    enc = load_tokenizer(model_dir)(["the river"], return_tensors="pt", padding=True)
    assert "b refused its shard" in said["recoveries"][0]
    assert sum(s.num_units for s in said["recovered_plan"].stages if s.device == "b") < 5
    generated = [t.token_ids[0] for t in sorted(tokens, key=lambda t: t.step)]
    assert generated == list(hf_greedy_new_tokens(model_dir, enc, 4)[0])


def test_presenter_pace_is_recorded_with_the_run(qtbot, state, run_data):
    run = _recorded_run(qtbot, state, run_data, lambda panel: panel.pace_check.setChecked(True))
    assert run.settings["presenter_pace"] is True


def test_the_model_field_keeps_its_width_and_its_tooltip_gives_the_whole_path(qtbot):
    """At 1024x700 "Browse…" left the field ~70 px ("mo-llama"): the button is "…", the path in the tooltip."""
    panel = RunPanel(StudioState(), None)
    qtbot.addWidget(panel)
    panel.model_edit.setText("/home/me/models/demo-llama")
    assert panel.model_edit.toolTip() == "/home/me/models/demo-llama"
    assert panel.browse_button.text() == "…" and "Browse" in panel.browse_button.toolTip()
    assert panel.browse_button.width() < panel.browse_button.fontMetrics().horizontalAdvance("Browse…")


def test_a_real_run_records_and_shows_its_wire_bytes_beside_the_cost_model_and_the_replay_shows_them(
        qtbot, real_cluster, tmp_path):
    from core.planning.cost import format_bytes

    coordinator, plan, model_dir, devices = real_cluster
    state, panel = cluster_run_panel(qtbot, coordinator, plan, tmp_path / "ws.sqlite", model_dir,
                                     ["the river and its banks", "hello there"], 4)
    with qtbot.waitSignal(panel.run_finished, timeout=60_000) as done:
        panel.start_run()
    assert done.args == ["completed"], panel.message.text()
    assert panel.shutdown()
    with SessionStore(state.workspace) as store:
        [run] = store.runs()
    wire = run.figures["wire"]  # the agents' socket counts, as `edgeshard run` records them
    assert wire["measured_bytes"] == wire["predicted_bytes"] > 0  # 3 stages' frames, headers included
    assert set(wire["per_link"]) == {"src->mid", "mid->head", "head->src"}
    assert panel.monitor.wire_label.isVisibleTo(panel) and "model ×1.000" in panel.monitor.wire_label.text()
    assert f"predicted {format_bytes(wire['predicted_bytes'])}" in panel.monitor.wire_label.toolTip()
    from gui.screens.sessions import SessionsPanel

    sessions = SessionsPanel(state)
    qtbot.addWidget(sessions)
    with qtbot.waitSignal(sessions.run_opened, timeout=60_000):
        sessions.open_run(run.id)
    assert sessions.monitor.wire_label.text() == panel.monitor.wire_label.text()
    assert sessions.shutdown()


def test_at_1024x700_the_figures_go_under_the_timeline_and_beside_it_on_a_large_screen(qtbot):
    """At 1024x700 the figures' column beside the timeline left its plot ~90 px wide (seen under Xvfb with
    an attention-offload run): the Run screen's area there (~870x560) stacks them under it."""
    from PySide6.QtCore import Qt

    panel = RunPanel(StudioState(), None)
    qtbot.addWidget(panel, before_close_func=lambda w: w.shutdown(5.0))
    panel.resize(870, 560)
    panel.show()
    qtbot.waitExposed(panel)
    qtbot.waitUntil(lambda: panel.monitor.splitter.orientation() == Qt.Orientation.Vertical, timeout=30_000)
    assert panel.monitor.timeline.width() >= 400
    panel.resize(1450, 860)  # the Run screen's area at 1600x1000
    qtbot.waitUntil(lambda: panel.monitor.splitter.orientation() == Qt.Orientation.Horizontal, timeout=30_000)
    assert panel.monitor.side_scroll.x() > panel.monitor.timeline.x()

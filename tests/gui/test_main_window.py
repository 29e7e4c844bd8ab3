"""The main window: every screen reachable, shortcuts, status bar, remembered layout."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFileDialog, QMessageBox

from core import formats
from gui import app as studio_app
from gui.main_window import SCREENS, MainWindow
from tests.gui.problems import make_problem


@pytest.fixture(scope="module")
def solo(tmp_path_factory):
    """One agent, "solo", for the tests that connect to it and leave it running (each its own
    coordinator): started once for the module rather than once a test."""
    from core.devices.local_cluster import LocalCluster

    with LocalCluster(tmp_path_factory.mktemp("solo"), ["solo"]) as cluster:
        yield cluster


@pytest.fixture
def window(qtbot, isolated_settings):
    studio_app.create_app()
    w = MainWindow()
    qtbot.addWidget(w)
    w.show()
    qtbot.waitExposed(w)
    yield w
    w.close()


def test_every_screen_is_in_the_sidebar_and_ctrl_number_switches_to_it(window, qtbot):
    assert [window.sidebar.item(i).text() for i in range(window.sidebar.count())] == list(SCREENS)
    for i, (_, screen) in enumerate(window.screens.titled()):
        qtbot.keyClick(window, Qt.Key_1 + i, Qt.ControlModifier)
        assert window.current_screen() is screen
        assert window.stack.currentWidget().widget() is screen


def test_loading_a_profile_file_sets_model_in_status_bar_and_a_plan(window, tmp_path):
    problem = make_problem()
    path = tmp_path / "problem.json"
    formats.save(path, problem)
    assert window.load_profile_file(str(path))
    assert window.model_label.text() == "Model: tiny-llama"
    assert window.state.plan is not None and window.state.plan.devices() == ("phone",)


def test_the_profile_screens_load_button_loads_the_chosen_file_through_the_window(window, tmp_path, monkeypatch):
    path = tmp_path / "problem.json"
    formats.save(path, make_problem())
    asked = []
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (asked.append(a[1]), (str(path), ""))[1])
    window.screens.profile.load_button.click()
    assert asked == ["Load profile"]
    assert window.model_label.text() == "Model: tiny-llama"


def test_a_wrong_file_is_a_dialog_with_what_to_do_not_a_traceback(window, tmp_path):
    bad = tmp_path / "notes.json"
    bad.write_text("{not json")
    assert not window.load_profile_file(str(bad))
    box = window.findChild(QMessageBox, "errorDialog")
    assert box is not None and "not valid JSON" in box.text() and "edgeshard profile" in box.informativeText()
    box.close()


def test_workspace_appears_in_status_bar_and_in_recent_workspaces(window, tmp_path):
    ws = tmp_path / "lab.edgeshard"
    window.open_workspace(str(ws))
    assert window.workspace_label.text() == "Workspace: lab.edgeshard"
    assert studio_app.recent_workspaces()[0] == str(ws.resolve())


def test_window_geometry_and_last_screen_are_restored(qtbot, isolated_settings):
    """Both windows are really shown, and each step waits for its real condition: on a
    window system a shown window's resize is confirmed asynchronously, so saving right
    after resize() (or reading a restored size before the window is mapped) raced with it."""
    studio_app.create_app()
    first = MainWindow()
    qtbot.addWidget(first)
    first.show()
    qtbot.waitExposed(first)
    first.resize(720, 520)
    qtbot.waitUntil(lambda: (first.width(), first.height()) == (720, 520), timeout=30_000)
    first.show_screen(first.screens.cluster)
    first.close()
    saved = studio_app.settings().value("window/geometry")
    assert saved is not None and not saved.isEmpty()
    second = MainWindow()
    qtbot.addWidget(second)
    second.show()
    qtbot.waitExposed(second)
    assert second.current_screen() is second.screens.cluster
    qtbot.waitUntil(lambda: (second.width(), second.height()) == (720, 520), timeout=30_000)
    second.close()


def test_log_messages_reach_the_log_dock(window):
    window.state.log("agent on phone started")
    window.state.log("phone went offline", "warning")
    text = window.log_view.toPlainText()
    assert "INFO    agent on phone started" in text and "WARNING phone went offline" in text


def test_dark_theme_switch_restyles_without_errors(window):
    window._on_dark_toggled(True)
    assert studio_app.theme_mode() == "dark"
    assert window.palette().window().color().name() == studio_app.theme_colors()["window"]
    window._on_dark_toggled(False)
    assert studio_app.theme_mode() == "light"


def test_connecting_to_an_agents_file_lists_the_agents_and_enables_profile_and_run(window, qtbot, solo):
    window.connect_agents(str(solo.agents_file))
    qtbot.waitUntil(lambda: window.connection_label.text() == "● 1 agent(s) connected", timeout=60_000)
    devices = window.screens.devices
    assert devices.registry.records["solo"].status == "running" and devices.registry.records["solo"].origin == "agents file"
    assert window.screens.profile.profile_button.isEnabled()
    assert window.screens.run.backend is not None
    window.close()
    assert window.coordinator is None


def test_connecting_twice_closes_the_superseded_connection_instead_of_leaking_it(window, qtbot, solo):
    import threading

    def coordinator_threads() -> int:
        return sum(t.name == "edgeshard-coordinator" for t in threading.enumerate())

    before = coordinator_threads()
    window.connect_agents(str(solo.agents_file))
    window.connect_agents(str(solo.agents_file))  # supersedes the first, which still connects
    qtbot.waitUntil(lambda: window.connection_label.text() == "● 1 agent(s) connected", timeout=60_000)
    qtbot.waitUntil(lambda: window._agents_runner.alive_threads() == [], timeout=30_000)
    qtbot.waitUntil(lambda: coordinator_threads() == before + 1, timeout=60_000)  # only the adopted one
    window.close()
    assert coordinator_threads() == before


def test_a_killed_agent_shows_as_offline_on_the_devices_screen(window, qtbot, tmp_path):
    import os
    import signal

    from core.devices.local_cluster import LocalCluster

    with LocalCluster(tmp_path / "cluster", ["solo", "duo"]) as cluster:
        window.connect_agents(str(cluster.agents_file))
        qtbot.waitUntil(lambda: window.connection_label.text() == "● 2 agent(s) connected", timeout=60_000)
        devices = window.screens.devices
        assert devices.registry.records["duo"].status == "running"
        os.kill(cluster.pid_of("duo"), signal.SIGKILL)
        qtbot.waitUntil(lambda: devices.registry.records["duo"].status == "offline", timeout=60_000)
        assert window.offline_label.text() == "⚠ Offline: duo"
        assert "stopped answering" in devices.registry.records["duo"].detail
        assert devices.registry.records["solo"].status == "running"  # the live one is untouched
        window.close()


def test_the_status_bar_lists_offline_agents_and_clears_when_they_return(window, qtbot):
    from core.devices.registry import DeviceRecord

    devices = window.screens.devices
    devices.upsert(DeviceRecord(id="edge-a", status="running"))
    devices.upsert(DeviceRecord(id="edge-b", status="running"))
    assert not window.offline_label.isVisible()
    devices.set_status("edge-b", "offline", "the agent stopped answering heartbeats")
    assert window.offline_label.isVisible() and "edge-b" in window.offline_label.text()
    assert "edge-a" not in window.offline_label.text()
    devices.set_status("edge-b", "running")
    assert not window.offline_label.isVisible()


def test_a_bad_agents_file_is_a_dialog_not_a_traceback(window, qtbot, tmp_path):
    bad = tmp_path / "agents.json"
    bad.write_text('{"format": "edgeshard.agents", "version": 1}')
    window.connect_agents(str(bad))
    qtbot.waitUntil(lambda: window.findChild(QMessageBox, "errorDialog") is not None, timeout=60_000)
    box = window.findChild(QMessageBox, "errorDialog")
    assert str(bad) in box.text() and "Traceback" not in box.text()
    assert window.state.connection == "not connected"
    box.close()


def test_the_plan_screen_is_the_technique_screen_with_layer_sharding_editor_as_its_view(window, qtbot):
    from gui.techniques.layer_sharding.editor import PlanEditorPanel
    from gui.screens.plan import PlanScreen

    plan = window.screens.plan
    assert isinstance(plan, PlanScreen) and plan.view is window.screens.plan_editor
    assert isinstance(plan.view, PlanEditorPanel) and plan.technique == "layer-sharding"  # first of the techniques offered
    problem = make_problem()
    window.state.set_profile(problem.profile, source=problem.source, workload=problem.workload)
    auto_solve = next(a for m in window.menuBar().actions() if m.text() == "&Plan"
                      for a in m.menu().actions() if a.text() == "Auto-solve")
    with qtbot.waitSignal(plan.view._solve_runner.task_finished, timeout=60_000):
        auto_solve.trigger()
    assert window.current_screen() is plan
    assert plan.view.cost is not None and plan.view.cost.feasible


def test_a_plugged_in_techniques_view_takes_the_windows_plan_menu(qtbot, isolated_settings):
    from core.techniques import register, unregister
    from gui.techniques import register_plan_view, unregister_plan_view
    from tests.gui.screens.test_plan import WholeModelView
    from tests.techniques import whole_model

    register(whole_model.TECHNIQUE)
    register_plan_view(whole_model.TECHNIQUE.name, WholeModelView)
    try:
        studio_app.create_app()
        w = MainWindow()
        qtbot.addWidget(w)
        problem = make_problem()
        w.state.set_profile(problem.profile, source=problem.source, workload=problem.workload)
        plan = w.screens.plan
        assert not plan.picker_row.isHidden()
        plan.set_technique("whole-model")
        compare = next(a for m in w.menuBar().actions() if m.text() == "&Plan"
                       for a in m.menu().actions() if a.text() == "Compare strategies")
        compare.trigger()
        assert plan.view.result.text() == "fastest-device, source-only"
        w.close()
    finally:
        unregister_plan_view(whole_model.TECHNIQUE.name)
        unregister(whole_model.TECHNIQUE.name)


def _menu_paths(window) -> set[tuple[str, str]]:
    paths = set()
    for top in window.menuBar().actions():
        for action in top.menu().actions():
            if action.text():
                paths.add((top.text().replace("&", ""), action.text().replace("&", "")))
    return paths


def test_the_readme_and_the_demo_hint_name_only_menus_that_exist(window):
    import re
    from pathlib import Path

    from gui.demo import DEMO_MENU_STEPS

    paths = _menu_paths(window)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    named = re.findall(r"\*\*(\w+) ▸ ([^*]+?)\*\*", readme)
    assert named, "the README names no menus"
    assert [n for n in named if n not in paths] == []
    assert [s for s in DEMO_MENU_STEPS if s not in paths] == []


def test_the_window_title_names_the_app_once_qt_appends_the_display_name(window, tmp_path):
    from PySide6.QtGui import QGuiApplication

    assert QGuiApplication.applicationDisplayName() == studio_app.APPLICATION
    assert studio_app.APPLICATION not in window.windowTitle()  # no workspace: Qt shows the display name alone
    window.open_workspace(str(tmp_path / "lab.edgeshard"))
    assert window.windowTitle() == "lab.edgeshard"  # shown as "lab.edgeshard — EdgeShard Studio"


def test_a_workspace_and_model_set_before_the_window_is_built_are_shown(qtbot, isolated_settings, tmp_path):
    from gui.studio_state import StudioState

    studio_app.create_app()
    state = StudioState()  # as the demo does: its workspace is opened while the agents start
    state.set_workspace(str(tmp_path / "demo.edgeshard"))
    state.set_model("demo-llama")
    w = MainWindow(state)
    qtbot.addWidget(w)
    assert w.workspace_label.text() == "Workspace: demo.edgeshard"
    assert w.windowTitle() == "demo.edgeshard"
    assert w.model_label.text() == "Model: demo-llama"


def test_a_failed_connect_keeps_the_agents_already_attached_and_says_so(window, qtbot, tmp_path, solo):
    bad = tmp_path / "agents.json"
    bad.write_text('{"format": "edgeshard.agents", "version": 1}')
    window.connect_agents(str(solo.agents_file))
    qtbot.waitUntil(lambda: window.connection_label.text() == "● 1 agent(s) connected", timeout=60_000)
    backend = window.screens.run.backend
    window.connect_agents(str(bad))
    qtbot.waitUntil(lambda: window.findChild(QMessageBox, "errorDialog") is not None, timeout=60_000)
    box = window.findChild(QMessageBox, "errorDialog")
    assert "Still using the agents already attached" in box.text() + box.informativeText()
    box.close()
    assert window.state.connection == "1 agent(s) connected"
    assert window.screens.run.backend is backend
    window.close()


def test_a_second_agents_file_marks_the_agents_it_replaces_and_warns(window, qtbot, tmp_path, solo):
    from core.devices.local_cluster import LocalCluster

    logged = []
    window.state.log_added.connect(lambda level, text: logged.append((level, text)))
    with LocalCluster(tmp_path / "two", ["duo"]) as second:
        window.connect_agents(str(solo.agents_file))
        qtbot.waitUntil(lambda: window.connection_label.text() == "● 1 agent(s) connected", timeout=60_000)
        window.connect_agents(str(second.agents_file))
        records = window.screens.devices.registry.records
        qtbot.waitUntil(lambda: "duo" in records and records["duo"].status == "running", timeout=60_000)
        assert records["solo"].status == "not in use"
        assert any(level == "warning" and "no longer used: solo" in text for level, text in logged)
        window.close()


def test_a_lost_demo_agent_gives_the_same_advice_as_its_start_button(window, qtbot, tmp_path):
    import os
    import signal

    from core.devices.local_cluster import LocalCluster
    from core.runs.coordinator import Coordinator
    from gui.connection.attach import attach
    from gui.demo_cluster import DemoParts, LocalAgentControl

    with LocalCluster(tmp_path / "cluster", ["solo"]) as cluster:
        parts = DemoParts(workdir=tmp_path, cluster=cluster)
        parts.coordinator = Coordinator(cluster.endpoints, cluster.keys, request_timeout_s=10.0)
        parts.coordinator.open()
        try:
            statuses = parts.coordinator.wait_ready(30.0)
            attach(window, parts.coordinator, statuses, origin="local cluster", agent_control=LocalAgentControl(parts))
            os.kill(cluster.pid_of("solo"), signal.SIGKILL)
            records = window.screens.devices.registry.records
            qtbot.waitUntil(lambda: records["solo"].status == "offline", timeout=60_000)
            assert "restart the studio with --demo" in records["solo"].detail
            assert "redeploy" not in records["solo"].detail
        finally:
            parts.coordinator.close()
        window.close()


def test_a_local_agent_s_row_shows_its_control_endpoint_and_pid_not_an_ssh_port(window, qtbot, solo):
    from core.runs.coordinator import Coordinator
    from gui.connection.attach import attach
    from gui.screens.devices import COLUMNS

    coordinator = Coordinator(solo.endpoints, solo.keys, request_timeout_s=10.0)
    coordinator.open()
    try:
        attach(window, coordinator, coordinator.wait_ready(30.0), origin="local cluster")
        table = window.screens.devices.table
        address = table.item(0, COLUMNS.index("Address")).text()
        port = coordinator.endpoints["solo"].control_address.rsplit(":", 1)[1]
        assert address == f"127.0.0.1:{port} (local, pid {solo.pid_of('solo')})"
    finally:
        coordinator.close()
    window.close()


def test_every_screens_title_starts_at_the_same_place(window, qtbot):
    from PySide6.QtCore import QPoint
    from PySide6.QtWidgets import QLabel

    lefts = {}
    for title, screen in window.screens.titled():
        window.show_screen(screen)
        qtbot.wait(10)
        label = next(w for w in screen.findChildren(QLabel)
                     if w.property("role") == "title" and w.isVisible())
        lefts[title] = label.mapTo(window, QPoint(0, 0)).x()
    assert len(set(lefts.values())) == 1, lefts


def test_ctrl_return_is_run_start_from_any_screen(window, qtbot, monkeypatch):
    """The README's steps are Ctrl+P, Ctrl+R, Ctrl+Return: after Auto-solve the Plan screen is
    shown, and Ctrl+Return there did nothing and said nothing (it was the Run screen's own)."""
    started = []
    monkeypatch.setattr(window.screens.run, "start_run", lambda: started.append(window.current_screen()))
    start = next(a for m in window.menuBar().actions() if m.text() == "&Run" for a in m.menu().actions()
                 if a.text() == "Start")
    assert start.shortcut().toString() == "Ctrl+Return"
    window.show_screen(window.screens.plan)
    qtbot.keyClick(window, Qt.Key_Return, Qt.ControlModifier)
    assert started == [window.screens.run]
    window.screens.run.prompts_edit.setFocus()  # on the Run screen too: one shortcut, not two ambiguous ones
    qtbot.keyClick(window.screens.run.prompts_edit, Qt.Key_Return, Qt.ControlModifier)
    assert started == [window.screens.run, window.screens.run]


def test_a_window_larger_than_the_screen_is_shrunk_and_moved_inside_it():
    from PySide6.QtCore import QRect, QSize

    from gui.main_window import fitted_geometry

    fitted = fitted_geometry(QRect(100, 50, 1440, 900), QSize(0, 24), QRect(0, 0, 1024, 700))
    assert fitted == QRect(0, 0, 1024, 676)
    assert fitted_geometry(QRect(10, 10, 800, 600), QSize(0, 0), QRect(0, 0, 1600, 1000)) == QRect(10, 10, 800, 600)


def test_the_status_bar_names_the_model_of_the_technique_shown_not_always_the_llama(window, tmp_path):
    """The demo's tour runs a MoE for expert offloading and a Llava for EPD: the status bar said
    "Model: demo-llama" all along. The Plan screen's technique (``use_technique``) picks the model named."""
    llama, moe = tmp_path / "demo-llama", tmp_path / "demo-moe"
    window.state.set_model("demo-llama", str(llama))
    window.state.set_technique_models({"layer-sharding": str(llama), "expert-offload": str(moe),
                                       "phase-disaggregation": str(tmp_path / "demo-llava")})
    window.state.use_technique("expert-offload")
    assert window.model_label.text() == "Model: demo-moe"
    window.state.use_technique("phase-disaggregation")
    assert window.model_label.text() == "Model: demo-llava"
    window.state.use_technique("attention-offload")  # no model of its own: the studio's
    assert window.model_label.text() == "Model: demo-llama"
    window.state.use_technique("layer-sharding")
    assert window.model_label.text() == "Model: demo-llama"


def test_setting_a_techniques_plan_names_its_model_in_the_status_bar(window, tmp_path):
    """A plan set for the Run screen (expert offloading's "Use for run") names its technique's model."""
    from core.planning.plan import ShardPlan, Stage

    window.state.set_model("demo-llama", str(tmp_path / "demo-llama"))
    window.state.set_technique_models({"expert-offload": str(tmp_path / "demo-moe")})
    window.state.set_plan(ShardPlan(model="demo-moe", num_units=2, stages=(Stage(device="edge-a", start=0, end=2,
                                                                        kind="expert-offload"),)))
    assert window.state.technique == "expert-offload"
    assert window.model_label.text() == "Model: demo-moe"
    window.show_screen(window.screens.devices)
    window.state.use_technique("phase-disaggregation")  # the Plan screen shows EPD (no plan of its own)
    window.state.set_technique_models({"expert-offload": str(tmp_path / "demo-moe"),
                                       "phase-disaggregation": str(tmp_path / "demo-llava")})
    assert window.model_label.text() == "Model: demo-llava"
    window.show_screen(window.screens.run)  # the Run screen runs the expert-offload plan: its model
    assert window.model_label.text() == "Model: demo-moe"

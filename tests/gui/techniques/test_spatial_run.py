"""*Run on agents* in the spatial plan view, on real local agents over CurveZMQ (pytest-qt):
the live timeline and image table fill as images land, the run is recorded for Sessions,
Stop ends it, a killed worker is named inline, and without agents the control says why."""

from __future__ import annotations

import os
import signal

import pytest

from core.devices.local_cluster import LocalCluster
from core.runs.coordinator import Coordinator
from core.sessions.replay import Replay
from core.sessions.store import SessionStore
from gui.screens.plan import PlanScreen
from gui.studio_state import StudioState
from gui.widgets import UNAVAILABLE
from tests.gui.techniques.spatial_solving import solved
from tests.techniques.spatial.conftest import make_problem

WAIT_MS = 90_000


def _cluster(path, n):
    lc = LocalCluster(path, n)
    lc.start()
    coordinator = Coordinator(lc.endpoints, lc.keys, request_timeout_s=30.0)
    coordinator.open()
    coordinator.wait_ready(30.0)
    return lc, coordinator


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    lc, coordinator = _cluster(tmp_path_factory.mktemp("spatial-gui"), 3)
    yield coordinator
    coordinator.close()
    lc.stop()


@pytest.fixture
def view(qtbot, tmp_path):
    state = StudioState()
    state.set_workspace(str(tmp_path / "ws.sqlite"))
    screen = PlanScreen(state)
    qtbot.addWidget(screen)
    screen.set_technique("spatial")
    view = screen.view
    view.set_problem(make_problem((4.0, 2.0, 1.0), 50.0))  # devices d0..d2: mapped onto the agents
    view.strategy.setCurrentText("even")  # every device gets strips
    yield solved(qtbot, view)
    screen.shutdown()


def test_without_agents_run_on_agents_is_disabled_and_says_why(view):
    assert not view.run_button.isEnabled()
    assert UNAVAILABLE + "no agents connected" in view.run_button.toolTip()


def test_a_plan_on_more_devices_than_agents_is_disabled_and_says_how_many(view, agents):
    view.state.set_offline(("local-2",))
    view.state.set_agents(agents)
    assert not view.run_button.isEnabled()
    assert "the plan uses 3 devices but 2 agent(s) are connected" in view.run_button.toolTip()


def test_a_run_draws_each_images_strips_live_checks_them_and_is_recorded(view, agents, qtbot):
    view.state.set_agents(agents)
    assert view.run_button.isEnabled()
    view.run_images.setValue(3)
    view.run_button.click()
    assert view.stop_button.isEnabled() and not view.run_button.isEnabled()
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
    assert view.run_message.isHidden(), view.run_message.text()
    t = view.image_table
    assert t.rowCount() == 3
    assert [t.item(r, 3).text() for r in range(3)] == ["yes"] * 3
    assert all(float(t.item(r, 4).text()) < 1e-3 and float(t.item(r, 1).text()) > 0 for r in range(3))
    assert view.timeline.lanes() == ["local-0", "local-1", "local-2"]
    for lane in ("local-1", "local-2"):
        assert view.timeline.box_count(lane, "compute") >= 3
        assert view.timeline.box_count(lane, "send") >= 3
    assert view.run_status.text().startswith("completed: 3 images,")
    with SessionStore(view.state.workspace) as store:
        runs = store.runs(store.sessions()[-1].id)
        assert sorted(r.kind for r in runs) == ["measured", "predicted"]
        measured = next(r for r in runs if r.kind == "measured")
        assert measured.status == "completed" and len(store.tokens(measured.id)) == 3
        assert Replay.from_store(store, measured.id).duration_s > 0


def test_chosen_image_files_are_classified_by_name_and_checked_against_one_device(view, agents, qtbot):
    from core.models.multimodal import synthetic_images

    files = [str(p) for p in synthetic_images()[:2]]
    view.state.set_agents(agents)
    view.set_image_files(files)
    assert not view.run_images.isEnabled() and view.files_button.text() == "2 files…"
    view.run_button.click()
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
    assert view.run_message.isHidden(), view.run_message.text()
    t = view.image_table
    assert [t.item(r, 0).text() for r in range(t.rowCount())] == [f"{i} {os.path.basename(f)}"
                                                                   for i, f in enumerate(files)]
    assert [t.item(r, 3).text() for r in range(2)] == ["yes", "yes"]
    view.random_button.click()
    assert view.image_files == [] and view.run_images.isEnabled()


def test_an_unreadable_image_file_fails_the_run_naming_the_file_before_anything_runs(view, agents, qtbot, tmp_path):
    bad = tmp_path / "notes.png"
    bad.write_text("not a picture")
    view.state.set_agents(agents)
    view.set_image_files([str(bad)])
    view.run_button.click()
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
    assert "notes.png" in view.run_message.text() and "not a readable image" in view.run_message.text()
    assert view.image_table.rowCount() == 0


def test_stop_ends_the_run_and_records_it_as_stopped(view, agents, qtbot):
    view.state.set_agents(agents)
    view.run_images.setValue(200)
    view.run_button.click()
    qtbot.waitUntil(lambda: view.image_table.rowCount() >= 1, timeout=WAIT_MS)
    view.stop_button.click()
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
    assert view.run_status.text().startswith("stopped:")
    assert view.image_table.rowCount() < 200
    with SessionStore(view.state.workspace) as store:
        measured = next(r for r in store.runs(store.sessions()[-1].id) if r.kind == "measured")
        assert measured.status == "stopped"
    assert view.run_button.isEnabled()


def test_a_killed_worker_agent_is_named_inline_and_the_run_recorded_as_failed(view, qtbot, tmp_path):
    lc, coordinator = _cluster(tmp_path / "cluster", 2)
    try:
        view.set_problem(make_problem((4.0, 2.0), 50.0))
        view.strategy.setCurrentText("even")
        solved(qtbot, view)
        view.state.set_agents(coordinator)
        view.run_images.setValue(200)
        view.run_button.click()
        qtbot.waitUntil(lambda: view.image_table.rowCount() >= 1, timeout=WAIT_MS)
        os.kill(lc.pid_of("local-1"), signal.SIGKILL)
        qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
        assert not view.run_message.isHidden() and "local-1: agent lost" in view.run_message.text()
        with SessionStore(view.state.workspace) as store:
            measured = next(r for r in store.runs(store.sessions()[-1].id) if r.kind == "measured")
            assert measured.status == "failed"
    finally:
        coordinator.close()
        lc.stop()

"""The expert heat map in the Run monitor: hidden for runs without expert activity, filled live
from io events, cleared on reset, and shown the same in the Sessions replay of a real
``edgeshard run`` of an expert-offload plan (real loopback agents, generated Mixtral)."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint

from agents.protocol import TimelineEvent
from agents.techniques.expert_offload.activity import expert_activity
from core.sessions.store import SessionStore
from core.techniques.expert_offload.activity import ExpertActivity
from gui.techniques.expert_offload.heat_map import ExpertHeatMap, cell_colour
from gui.screens.run_monitor import RunMonitorView
from gui.studio_state import StudioState
from tests.gui.screens.test_sessions import _open, _play_to_end, _sessions
from tests.techniques.expert_offload.test_activity import io


def compute(step: int = 1) -> TimelineEvent:
    return TimelineEvent(device="d", stage=0, kind="compute", phase="decode", step=step, micro_batch=0,
                         start_s=0.0, end_s=0.01)


def test_the_heat_map_stays_hidden_for_a_run_without_expert_activity(qtbot):
    monitor = RunMonitorView()
    qtbot.addWidget(monitor)
    monitor.show()
    monitor.reset(["d"], ["p"])
    monitor.add_timeline_events([compute()])
    assert monitor.heat_map.isHidden() and monitor.heat_map_label.isHidden()


def test_the_heat_map_appears_with_expert_events_counts_them_and_reset_clears_it(qtbot):
    monitor = RunMonitorView()
    qtbot.addWidget(monitor)
    monitor.resize(1200, 700)
    monitor.show()
    monitor.reset(["d"], ["p"])
    monitor.add_timeline_events([compute(), io(0, 2, "load", 1000), io(0, 2, "hit"), io(1, 5, "preload", 1000)])
    heat = monitor.heat_map
    assert heat.isVisible() and heat.blocks() == [0, 1]
    assert heat.grid()[0][2] == 2 and heat.grid()[1][5] == 0  # activations: a preload is not a pick
    assert "hit rate 50 %" in heat.summary.text() and "preloads 1" in heat.summary.toolTip()
    heat.set_measure("preloads")
    assert heat.grid()[1][5] == 1
    cell = heat.grid_widget.cell_rect(1, 5).center()
    assert heat.grid_widget.cell_at(cell) == (1, 5) and heat.grid_widget.cell_at(QPoint(0, 0)) is None
    assert "block 1, expert 5" in heat.describe(1, 5) and "preloads 1" in heat.describe(1, 5)
    monitor.reset(["d"], ["p"])
    assert heat.isHidden() and heat.activity.is_empty()


def test_cells_are_coloured_on_one_scale_with_grey_for_never_picked():
    assert cell_colour(0.0) != cell_colour(1.0)
    assert cell_colour(2.0) == cell_colour(1.0) and cell_colour(-1.0) == cell_colour(0.0)
    assert cell_colour(None).alpha() < 255


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from tests.techniques.expert_offload.test_run import ran

    return ran.__wrapped__(tmp_path_factory)


def test_a_recorded_expert_offload_run_replays_with_its_heat_map(qtbot, recorded):
    _, _, workspace, _ = recorded
    with SessionStore(workspace) as store:
        [run] = store.runs(store.sessions()[0].id)
        expected = ExpertActivity()
        expected.add([i.event for i in store.timeline(run.id) if i.event is not None])
    state = StudioState()
    state.set_workspace(str(workspace))
    panel = _sessions(qtbot, state)
    [(run_id, _)] = panel.run_items().items()
    _open(qtbot, panel, run_id)
    _play_to_end(qtbot, panel, 30_000)
    heat = panel.monitor.heat_map
    assert not heat.isHidden() and not expected.is_empty()
    assert heat.activity.totals() == expected.totals() and heat.grid() == expected.grid("activations")
    assert heat.activity.resident() == expected.resident() and 0 < len(expected.resident()) <= 3  # 3 slots
    assert "edge-0:storage" in panel.monitor.timeline.lanes()
    panel.shutdown()


def test_a_heat_map_alone_paints_without_data(qtbot):
    heat = ExpertHeatMap()
    qtbot.addWidget(heat)
    heat.resize(300, 150)
    heat.show()
    heat.grid_widget.repaint()
    assert heat.summary.text() == "No expert activity yet."

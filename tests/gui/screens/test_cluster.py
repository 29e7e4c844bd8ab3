"""The cluster screen draws the devices and links it is given, with their figures."""

from __future__ import annotations

import numpy as np
import pytest

from core.devices.cluster import Cluster, Device, Link
from PySide6.QtWidgets import QWidget

from gui.screens.cluster import ClusterPanel, device_compute, link_matrix
from gui.studio_state import StudioState
from tests.gui.problems import make_problem


def test_link_matrix_is_directed_and_marks_missing_links():
    cluster = Cluster(devices=(Device(id="a", memory_bytes=1), Device(id="b", memory_bytes=1), Device(id="c", memory_bytes=1)),
                      links=(Link(src="a", dst="b", bandwidth_mbit_s=100, latency_ms=2),
                             Link(src="b", dst="a", bandwidth_mbit_s=40, latency_ms=3)))
    ids, bw, lat = link_matrix(cluster)
    assert ids == ["a", "b", "c"]
    assert bw[0, 1] == 100 and bw[1, 0] == 40 and lat[1, 0] == 3
    assert np.isnan(bw[0, 2]) and np.isnan(lat[2, 1])


def test_node_size_follows_profiled_speed():
    problem = make_problem()
    compute = device_compute(problem.profile.cluster, problem.profile)
    assert compute["server"][0] > compute["laptop"][0] > compute["phone"][0]
    assert "profiled" in compute["server"][1]


def test_a_link_markers_hover_tip_is_its_links_text_and_holds_no_closure_over_the_panel(qtbot):
    import pyqtgraph as pg

    state = StudioState()
    panel = ClusterPanel(state)
    qtbot.addWidget(panel)
    state.set_profile(make_problem().profile)
    markers = [i for i in panel.graph.getPlotItem().items if isinstance(i, pg.ScatterPlotItem)
               and any(tuple(d) == ("phone", "laptop") for d in i.data["data"])]
    assert len(markers) == 1
    tip = markers[0].opts["tip"]
    assert tip(0.0, 0.0, ["phone", "laptop"]) == panel.link_tips[("phone", "laptop")]
    # the item keeps the panel's dict, not the panel: a closure over it was a cycle through the scene it owns
    assert panel not in getattr(tip, "args", ()) and all(c.cell_contents is not panel
                                                         for c in getattr(tip, "__closure__", None) or ())


def test_panel_shows_every_device_and_link_figure_on_hover_text(qtbot):
    state = StudioState()
    panel = ClusterPanel(state)
    qtbot.addWidget(panel)
    assert "No cluster yet" in panel.summary.text()
    problem = make_problem()
    state.set_profile(problem.profile)
    assert panel.summary.text().startswith("3 device(s), 6 directed link(s)")
    assert set(panel.node_tips) == {"phone", "laptop", "server"}
    assert "memory 16.0 GiB" in panel.node_tips["server"] and "cuda:RTX 3090" in panel.node_tips["server"]
    assert panel.link_tips[("phone", "laptop")].startswith("phone → laptop: 100 Mbit/s, 2.0 ms")


def test_link_labels_sit_on_a_chip_above_the_lines_not_struck_through(qtbot):
    import pyqtgraph as pg
    from PySide6.QtCore import Qt

    state = StudioState()
    panel = ClusterPanel(state)
    qtbot.addWidget(panel)
    state.set_cluster(make_problem().profile.cluster)
    assert len(panel.link_labels) == 3
    lines = [i for i in panel.graph.items() if isinstance(i, pg.PlotCurveItem)]
    assert lines
    for label in panel.link_labels:
        assert label.fill.style() != Qt.BrushStyle.NoBrush
        assert label.zValue() > max(line.zValue() for line in lines)


def _three_stage(problem):
    from core.planning.plan import ShardPlan, Stage

    n = problem.profile.model.num_units
    return ShardPlan(model=problem.profile.model.name, num_units=n,
                     stages=(Stage(device="phone", start=0, end=3), Stage(device="laptop", start=3, end=6),
                             Stage(device="server", start=6, end=n)))


@pytest.fixture
def profiled(qtbot):
    """A Cluster screen over a profiled three-device problem (phone with 4 GiB), no plan yet."""
    state = StudioState()
    panel = ClusterPanel(state)
    qtbot.addWidget(panel)
    problem = make_problem(phone_memory=4096 * 2**20)
    state.set_profile(problem.profile, source=problem.source, workload=problem.workload)
    return state, panel, problem


def test_show_plan_draws_each_stage_on_its_device_and_each_links_predicted_traffic(profiled):
    from gui.widgets import UNAVAILABLE

    state, panel, problem = profiled
    state.set_plan(None)
    assert not panel.plan_check.isEnabled() and UNAVAILABLE in panel.plan_check.toolTip()
    state.set_plan(_three_stage(problem))
    assert panel.plan_check.isEnabled()
    panel.plan_check.setChecked(True)
    assert panel.placement == {"phone": "stage 0 · units 0–2", "laptop": "stage 1 · units 3–5",
                               "server": "stage 2 · units 6–9"}
    assert "stage 1 · units 3–5" in panel.node_tips["laptop"]
    # each block sends 4096 bytes per token; the head's token back to the source is 4 bytes
    assert panel.plan_links == {("phone", "laptop"): "4.0 KiB/token predicted",
                                ("laptop", "server"): "4.0 KiB/token predicted",
                                ("server", "phone"): "4 B/token predicted"}
    assert "plan: phone → laptop 4.0 KiB/token predicted" in panel.link_tips[("phone", "laptop")]
    panel.plan_check.setChecked(False)
    assert panel.placement == {} and panel.plan_links == {}


def test_after_a_run_each_plan_link_also_shows_its_measured_traffic(profiled):
    from core.runs.prediction import predict_run

    state, panel, problem = profiled
    plan = _three_stage(problem)
    state.set_plan(plan)
    panel.plan_check.setChecked(True)
    run = predict_run(problem, plan, "no-bubbles", 2, 2, 8).result  # the simulator's events, as a run's
    state.set_last_run(run.events, run.tokens)
    assert panel.plan_links[("laptop", "server")] == "4.0 KiB/token predicted\n4.0 KiB/token measured"
    sent = sum(e.nbytes for e in run.events if e.kind == "send" and (e.device, e.peer) == ("laptop", "server"))
    assert f"({sent / 1024:.1f} KiB in the last run)" in panel.link_tips[("laptop", "server")]


def test_a_hidden_cluster_screen_redraws_when_shown_not_at_each_change(qtbot):
    """In a shown window with another screen on top, changes only mark the screen stale (the
    demo's agents attaching changed cluster, profile and plan at once: ~0.2 s a redraw)."""
    from PySide6.QtWidgets import QStackedWidget

    state = StudioState()
    stack = QStackedWidget()
    qtbot.addWidget(stack)
    other, panel = QWidget(), ClusterPanel(state)
    stack.addWidget(other)
    stack.addWidget(panel)
    stack.show()
    assert "No cluster yet" in panel.summary.text()
    state.set_profile(make_problem().profile)
    assert "No cluster yet" in panel.summary.text()  # not drawn while hidden
    stack.setCurrentWidget(panel)
    assert panel.summary.text().startswith("3 device(s), 6 directed link(s)")


@pytest.mark.parametrize("size", [(860, 470), (1430, 770)])  # the screen's area at 1024x700 and 1600x1000
def test_with_the_plan_shown_no_label_overlaps_another_a_device_or_an_arrow(profiled, qtbot, size):
    """Node labels sat below each node, over the arrows and the traffic labels (worst at 1024x700
    with the plan shown and a run's measured traffic: two-line labels everywhere)."""
    import pyqtgraph as pg
    from PySide6.QtCore import QPointF, QRectF

    from core.runs.prediction import predict_run
    from gui.screens.cluster import PLAN_Z

    state, panel, problem = profiled
    panel.resize(*size)
    panel.show()
    qtbot.waitExposed(panel)
    plan = _three_stage(problem)
    state.set_plan(plan)
    panel.plan_check.setChecked(True)
    run = predict_run(problem, plan, "no-bubbles", 2, 2, 8).result
    state.set_last_run(run.events, run.tokens)
    qtbot.wait(100)
    vb = panel.graph.getPlotItem().getViewBox()
    items = panel.graph.getPlotItem().items
    labels = [i.sceneBoundingRect().adjusted(2, 2, -2, -2) for i in items if isinstance(i, pg.TextItem)]
    assert len(labels) == 6  # three devices, three plan links
    nodes = []
    for item in items:
        if isinstance(item, pg.ScatterPlotItem) and item.data["size"].max() > 20:  # devices, not link midpoints
            for spot in item.points():
                centre, r = vb.mapViewToScene(spot.pos()), spot.size() / 2
                nodes.append(QRectF(centre.x() - r * 0.7, centre.y() - r * 0.7, r * 1.4, r * 1.4))
    assert len(nodes) == 3
    arrows = []
    for item in items:
        if isinstance(item, pg.PlotCurveItem) and item.zValue() == PLAN_Z:
            xs, ys = item.getData()
            a, b = vb.mapViewToScene(QPointF(xs[0], ys[0])), vb.mapViewToScene(QPointF(xs[1], ys[1]))
            arrows.append([a + (b - a) * (k / 40) for k in range(41)])
    assert len(arrows) == 3
    view = vb.sceneBoundingRect()
    for k, rect in enumerate(labels):
        assert view.contains(rect), (k, rect, view)
        assert not any(rect.intersects(other) for other in labels[k + 1:]), (k, labels)
        assert not any(rect.intersects(node) for node in nodes), (k, rect, nodes)
        assert not any(rect.contains(p) for line in arrows for p in line), (k, rect, [(l[0], l[-1]) for l in arrows])


def test_a_one_unit_stage_reads_unit_n_not_a_range_from_n_to_n():
    from core.planning.plan import ShardPlan, Stage
    from gui.screens.cluster import placement_of

    plan = ShardPlan(model="m", num_units=4, stages=(Stage(device="a", start=0, end=3), Stage(device="b", start=3, end=4)))
    assert placement_of(plan, None) == {"a": "stage 0 · units 0–2", "b": "stage 1 · unit 3"}

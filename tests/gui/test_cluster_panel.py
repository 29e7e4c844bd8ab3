"""The cluster screen draws the devices and links it is given, with their figures."""

from __future__ import annotations

import numpy as np

from core.devices.cluster import Cluster, Device, Link
from gui.cluster_panel import ClusterPanel, device_compute, link_matrix
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

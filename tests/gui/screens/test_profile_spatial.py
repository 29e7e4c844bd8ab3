"""The Profile screen's CNN time models (spatial partitioning): each device's fitted y = a·x + b
per layer type and the fit's median error, from a fit, from agents (real local cluster over
CurveZMQ, on the worker) and from a loaded spatial problem."""

from __future__ import annotations

import pytest
from msgspec import structs

from core import formats
from core.techniques.spatial.problem import fit_time_model
from core.techniques.spatial.profiling import DeviceFit, SpatialFits
from core.techniques.spatial.scenarios import paper_shaped
from gui.screens.profile import ProfilePanel
from gui.studio_state import StudioState
from gui.widgets import UNAVAILABLE


def _cells(table):
    return [[table.item(r, c).text() for c in range(table.columnCount())] for r in range(table.rowCount())]


@pytest.fixture
def panel(qtbot):
    state = StudioState()
    p = ProfilePanel(state)
    qtbot.addWidget(p)
    yield p
    p.shutdown()


def test_no_spatial_profile_shows_no_fit_table(panel):
    assert panel.spatial_table.isHidden() and panel.spatial_label.isHidden()


def test_fits_show_a_b_speed_and_median_fit_error_per_device_and_layer_type(panel):
    # 4 GFLOP/s plus 1 ms per call; one sample 10 % slow, one 20 % fast: median error is known
    xs = [1e8, 2e8, 4e8, 8e8, 1.6e9]
    ys = [x / 4e9 + 1e-3 for x in xs]
    conv = fit_time_model([(x, y * f) for x, y, f in zip(xs, ys, [1.0, 1.1, 1.0, 0.8, 1.0])])
    fc = fit_time_model([(1e6, 2e-3), (2e6, 3e-3), (4e6, 5e-3)])
    panel.state.set_spatial_fits(SpatialFits(source="measured on 2 agent(s)", devices=(
        DeviceFit(device="pi-0", conv=conv, fc=fc), DeviceFit(device="pi-1", conv=conv))))
    assert not panel.spatial_table.isHidden()
    assert "measured on 2 agent(s)" in panel.spatial_label.text()
    rows = _cells(panel.spatial_table)
    assert [r[:2] for r in rows] == [["pi-0", "convolutions"], ["pi-0", "FC head"], ["pi-1", "convolutions"]]
    assert rows[0][2:6] == [f"{conv.a * 1e12:.2f}", f"{conv.b * 1e3:.3f}", f"{1e-9 / conv.a:.2f}",
                           f"{conv.median_rel_error * 100:.1f} %"]
    assert conv.median_rel_error > 0.001 and rows[0][5] != "0.0 %"
    assert rows[1][2:4] == ["1000.00", "1.000"] and rows[1][4] == "1.00"  # FC head: exactly 1 ms per MFLOP + 1 ms


def test_a_loaded_spatial_problem_shows_its_models_and_no_error_where_nothing_was_fitted(qtbot, isolated_settings,
                                                                                       tmp_path):
    from gui import app as studio_app
    from gui.main_window import MainWindow

    problem = paper_shaped(2)
    measured = fit_time_model([(1e8, 0.06), (2e8, 0.1), (4e8, 0.21)])
    problem = structs.replace(problem, devices=(structs.replace(problem.devices[0], time=measured),
                                                problem.devices[1]))
    path = tmp_path / "spatial.json"
    formats.save(path, problem)
    studio_app.create_app()
    window = MainWindow()
    qtbot.addWidget(window)
    assert window.load_profile_file(str(path))
    rows = _cells(window.screens.profile.spatial_table)
    assert rows[0][0] == "pi-0" and rows[0][5] == f"{measured.median_rel_error * 100:.1f} %"
    assert rows[1][0] == "pi-1" and rows[1][4] == "2.00" and rows[1][5] == "—"
    assert "spatial.json" in window.screens.profile.spatial_label.text()
    window.close()


def test_without_agents_profile_cnn_is_disabled_and_says_why(panel):
    assert not panel.conv_button.isEnabled()
    assert UNAVAILABLE + "no agents connected" in panel.conv_button.toolTip()
    panel.start_conv_profiling()
    assert "No agents connected" in panel.error.text()


def test_profile_cnn_times_convolutions_on_the_agents_in_a_worker_and_shows_each_fit(panel, qtbot, tmp_path):
    from core.devices.local_cluster import LocalCluster
    from core.runs.coordinator import Coordinator

    with LocalCluster(tmp_path / "cl", 2) as lc:
        coordinator = Coordinator(lc.endpoints, lc.keys, request_timeout_s=60.0)
        coordinator.open()
        try:
            coordinator.wait_ready(30.0)
            panel.state.set_agents(coordinator)
            assert panel.conv_button.isEnabled()
            panel.conv_sweep = {"sizes": (8, 16, 32), "channels": (8,), "repeats": 2}
            with qtbot.waitSignal(panel.state.spatial_fits_changed, timeout=120_000):
                panel.conv_button.click()
        finally:
            coordinator.close()
    fits = panel.state.spatial_fits
    assert [d.device for d in fits.devices] == [e.device for e in lc.endpoints]
    conv_rows = [r for r in _cells(panel.spatial_table) if r[1] == "convolutions"]
    assert [r[0] for r in conv_rows] == [e.device for e in lc.endpoints]
    for row, d in zip(conv_rows, fits.devices):
        assert row[4] == f"{1e-9 / d.conv.a:.2f}" and row[5] == f"{d.conv.median_rel_error * 100:.1f} %"


def _window_with_cnn_fits(qtbot, profile=None):
    """The main window at 1024x700 on the Profile screen, with three devices' CNN fits (and ``profile``)."""
    from gui import app as studio_app
    from gui.main_window import MainWindow

    studio_app.create_app()
    window = MainWindow()
    qtbot.addWidget(window)
    window.resize(1024, 700)
    window.show()
    qtbot.waitExposed(window)
    conv = fit_time_model([(1e8, 0.03), (2e8, 0.055), (4e8, 0.11)])
    if profile is not None:
        window.state.set_profile(profile)
    window.state.set_spatial_fits(SpatialFits(source="measured on 3 agent(s)", devices=tuple(
        DeviceFit(device=d, conv=conv, fc=conv) for d in ("edge-a", "edge-b", "edge-c"))))
    window.show_screen(window.screens.profile)
    return window


def test_with_cnn_fits_at_1024x700_the_charts_keep_a_readable_height_and_the_page_scrolls(qtbot, isolated_settings):
    """The demo after Profile cluster and Profile CNN: the fit table took the height and squeezed
    the three charts to ~40 px each (a bar's value label cut off), in a real xcb window."""
    from tests.gui.problems import make_problem

    window = _window_with_cnn_fits(qtbot, make_problem().profile)
    profile = window.screens.profile
    qtbot.waitUntil(lambda: profile.plots.height() > 0)
    qtbot.wait(50)
    assert profile.plots.height() >= 300
    assert window.stack.currentWidget().verticalScrollBar().maximum() > 0
    window.close()


def test_at_1024x700_every_fit_heading_is_whole_without_a_horizontal_scroll(qtbot, isolated_settings):
    window = _window_with_cnn_fits(qtbot)
    table = window.screens.profile.spatial_table
    header = table.horizontalHeader()
    qtbot.waitUntil(lambda: header.sectionSize(0) > 0)
    qtbot.wait(50)
    metrics = header.fontMetrics()
    clipped = [table.horizontalHeaderItem(c).text() for c in range(table.columnCount())
               if header.sectionSize(c) < metrics.horizontalAdvance(table.horizontalHeaderItem(c).text()) + 8]
    assert clipped == []  # "a (ms per GFLOP)" read "ms per GFLO"
    assert table.horizontalScrollBar().maximum() == 0
    window.close()

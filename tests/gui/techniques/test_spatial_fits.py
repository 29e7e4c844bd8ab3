"""CNN time models measured by the Profile screen feed the spatial view's problem (its devices
named as the timed agents) and are kept for the next launch (pytest-qt)."""

from __future__ import annotations

import pytest

from core.techniques.spatial.problem import TimeModel
from core.techniques.spatial.profiling import DeviceFit, SpatialFits
from gui.last_workspace import SPATIAL_FITS_FILE
from gui.main_window import MainWindow
from gui.screens.plan import PlanScreen
from gui.studio_state import StudioState
from gui.widgets import UNAVAILABLE
from tests.gui.techniques.spatial_solving import solved


def _fits(n: int) -> SpatialFits:
    return SpatialFits(source=f"measured on {n} agent(s)", devices=tuple(
        DeviceFit(device=f"local-{i}", conv=TimeModel(a=1e-10 * (i + 1), b=1e-4, per_weight_byte=2e-10,
                                                      per_activation_byte=3e-10, median_rel_error=0.05),
                  fc=TimeModel(a=4e-10, b=1e-5, median_rel_error=0.1) if i == 0 else None)
        for i in range(n)))


@pytest.fixture
def view(qtbot):
    screen = PlanScreen(StudioState())
    qtbot.addWidget(screen)
    screen.set_technique("spatial")
    screen.view.nodes.setValue(2)
    screen.view.use_scenario()
    yield solved(qtbot, screen.view)
    screen.shutdown()


def test_without_fits_the_button_is_disabled_and_says_to_profile(view):
    assert not view.fits_button.isEnabled()
    assert UNAVAILABLE + "no CNN time models yet" in view.fits_button.toolTip()


def test_profile_fits_become_the_problems_models_on_devices_named_as_the_agents(qtbot, view):
    view.state.set_spatial_fits(_fits(2))
    assert view.fits_button.isEnabled()
    view.fits_button.click()
    problem = solved(qtbot, view).problem
    assert [d.id for d in problem.devices] == ["local-0", "local-1"] and problem.gateway == "local-0"
    assert problem.device("local-1").time == _fits(2).devices[1].conv
    assert problem.device("local-0").fc_time == _fits(2).devices[0].fc
    assert problem.device("local-1").bandwidth_Bps == 1000 * 1e6 / 8  # the scenario's link is kept
    assert set(view.plan.devices) <= {"local-0", "local-1"} and "measured" in view.summary.text()
    assert view.message.isHidden()


def test_fits_of_fewer_agents_than_the_problem_has_devices_are_refused_inline_and_the_problem_stays(view):
    view.nodes.setValue(4)
    view.use_scenario()
    before = view.problem
    view.state.set_spatial_fits(_fits(3))
    view.fits_button.click()
    assert view.problem is before
    assert not view.message.isHidden()
    assert "4 devices but there are fits of 3" in view.message.text() and "profile more agents" in view.message.text()


def test_fits_are_kept_for_the_next_launch_and_the_profile_screen_shows_them(qtbot, isolated):
    def reopen() -> MainWindow:
        w = MainWindow()
        qtbot.addWidget(w)
        w.restore_last_workspace()
        return w

    first = reopen()
    first.state.set_spatial_fits(_fits(2))
    first.close()
    assert (isolated / SPATIAL_FITS_FILE).exists()
    second = reopen()
    assert second.state.spatial_fits == _fits(2)
    table = second.screens.profile.spatial_table
    assert [table.item(r, 0).text() for r in range(table.rowCount())] == ["local-0", "local-0", "local-1"]
    assert table.item(0, 6).text() == "0.200" and table.item(1, 6).text() == "—"  # ms per MB of weights
    second.close()


class _Agents:
    """The connected agents as the view sees them (their names)."""

    endpoints = ("local-0", "local-1", "local-2")


def test_fits_of_connected_agents_become_the_measured_problem_and_new_fits_re_plan_it(qtbot, view):
    view.state.set_agents(_Agents())
    assert view.source == "scenario" and not view.measured_button.isEnabled()  # no fits yet: the what-if stays
    view.state.set_spatial_fits(_fits(2))
    assert view.source == "measured" and [d.id for d in view.problem.devices] == ["local-0", "local-1"]
    assert not view.nodes.isEnabled() and solved(qtbot, view).plan is not None
    view.state.set_spatial_fits(_fits(3))  # a new profile: planned again, with the third agent
    assert [d.id for d in view.problem.devices] == ["local-0", "local-1", "local-2"]
    assert view.problem.device("local-2").time == _fits(3).devices[2].conv


def test_a_scenario_the_operator_picked_stays_when_fits_arrive(view):
    view.state.set_agents(_Agents())
    scenario_button = next(b for b in view.findChildren(type(view.measured_button)) if b.text() == "Use scenario")
    scenario_button.click()
    view.state.set_spatial_fits(_fits(2))
    assert view.source == "scenario" and view.measured_button.isEnabled()
    view.measured_button.click()
    assert view.source == "measured"


def test_picking_spatial_with_a_measured_cluster_solves_only_the_measured_problem(qtbot, monkeypatch):
    """The view solved the what-if scenario first and then the measured cluster that replaced it: two
    fused solves on the GUI thread (the pick froze the studio 1.1 s at load 19); the scenario is not solved."""
    from gui.techniques.spatial import solving

    solves = []
    real = solving.run_strategy
    monkeypatch.setattr(solving, "run_strategy", lambda problem, name: solves.append(
        (tuple(d.id for d in problem.devices), name)) or real(problem, name))
    state = StudioState()
    state.set_agents(_Agents())
    state.set_spatial_fits(_fits(2))
    screen = PlanScreen(state)
    qtbot.addWidget(screen)
    screen.set_technique("spatial")
    assert screen.view.source == "measured" and solved(qtbot, screen.view).plan is not None
    assert solves == [(("local-0", "local-1"), screen.view.strategy.currentText())]
    screen.shutdown()

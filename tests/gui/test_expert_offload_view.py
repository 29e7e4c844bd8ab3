"""The expert-offloading plan view: reachable from the Plan screen, Compare lists EdgeMoE and
the paper's baselines with their figures, and the scenario's controls change the plan."""

from __future__ import annotations

from gui.expert_offload_view import ExpertOffloadPlanView
from gui.plan_views import PlanScreen
from gui.studio_state import StudioState


def test_the_plan_screen_offers_the_expert_offload_view(qtbot):
    screen = PlanScreen(StudioState())
    qtbot.addWidget(screen)
    screen.set_technique("expert-offload")
    assert isinstance(screen.view, ExpertOffloadPlanView)


def test_compare_lists_every_strategy_with_edgemoe_optimal_and_bars_per_fitting_plan(qtbot):
    view = ExpertOffloadPlanView(StudioState())
    qtbot.addWidget(view)
    view.compare()
    rows = {view.table.item(r, 0).text(): view.table.item(r, 1).text() for r in range(view.table.rowCount())}
    assert set(rows) == {"edgemoe", "io-free", "io-exp", "io-qexp", "sti"}
    assert rows["edgemoe"] == "optimal" and rows["io-free"] == "oom"
    assert [name for name, _c, _s in view.bars.rows] == [name for name, status in rows.items()
                                                          if not status.startswith("failed")]
    sti = next(r for r in range(5) if view.table.item(r, 0).text() == "sti")
    assert rows["sti"] == "failed" and "whole layers" in view.table.item(sti, 1).toolTip()  # 10 %: a layer does not fit


def test_a_budget_too_small_for_the_resident_weights_says_what_to_do(qtbot):
    view = ExpertOffloadPlanView(StudioState())
    qtbot.addWidget(view)
    view.budget.setValue(5)
    assert "more memory" in view.plan_label.text()
    view.budget.setValue(15)
    assert "experts in the buffer" in view.plan_label.text()

"""The Plan screen shows the chosen technique's plan view (gui.techniques, gui.screens.plan): layer sharding's
editor alone and with no picker by default; a plugged-in technique adds itself to the picker."""

from __future__ import annotations

import pytest
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from core.techniques import register, unregister
from gui.techniques.layer_sharding.editor import PlanEditorPanel
from gui.screens.plan import PlanScreen
from gui.techniques import register_plan_view, unregister_plan_view
from gui.studio_state import StudioState
from tests.gui.problems import make_problem
from tests.techniques import whole_model


class WholeModelView(QWidget):
    """The test technique's plan view: its exact strategy's device, or its comparison."""

    def __init__(self, state: StudioState) -> None:
        super().__init__()
        self.state = state
        self.result = QLabel("no plan")
        QVBoxLayout(self).addWidget(self.result)

    def auto_solve(self) -> None:
        t = whole_model.TECHNIQUE
        out = t.run_strategy(self.state.problem, t.exact, "latency")
        self.result.setText(f"{out.strategy}: {out.plan.device}")

    def compare(self) -> None:
        outs = whole_model.TECHNIQUE.compare(self.state.problem, "latency")
        self.result.setText(", ".join(o.strategy for o in outs))


_screens: list[PlanScreen] = []


def request_shutdown(screen: PlanScreen) -> None:
    _screens.append(screen)


@pytest.fixture(autouse=True)
def _shut_screens_down():
    yield
    while _screens:
        _screens.pop().shutdown()


@pytest.fixture
def state(qtbot):
    s = StudioState()
    problem = make_problem()
    s.set_profile(problem.profile, source=problem.source, workload=problem.workload)
    return s


@pytest.fixture
def plugged_in():
    register(whole_model.TECHNIQUE)
    register_plan_view(whole_model.TECHNIQUE.name, WholeModelView)
    yield
    unregister_plan_view(whole_model.TECHNIQUE.name)
    unregister(whole_model.TECHNIQUE.name)


@pytest.fixture
def no_attention_offload_view(monkeypatch):
    """The shipped attention-offload view also applies to LLMs; these tests are about the others."""
    from gui import techniques

    monkeypatch.delitem(techniques._VIEWS, "attention-offload")


def test_an_llm_is_offered_layer_sharding_first_and_attention_offloading(qtbot, state):
    screen = PlanScreen(state)
    qtbot.addWidget(screen)
    request_shutdown(screen)
    assert screen.available() == ["layer-sharding", "attention-offload"] and not screen.picker_row.isHidden()
    assert screen.technique == "layer-sharding"


def test_with_layer_sharding_alone_the_screen_is_its_editor_and_has_no_picker(qtbot, state, no_attention_offload_view):
    screen = PlanScreen(state)
    qtbot.addWidget(screen)
    request_shutdown(screen)
    assert isinstance(screen.view, PlanEditorPanel)
    assert screen.technique == "layer-sharding" and screen.picker_row.isHidden()


def test_a_plugged_in_technique_is_offered_and_its_view_takes_the_menus_actions(qtbot, state, plugged_in,
                                                                                 no_attention_offload_view):
    screen = PlanScreen(state)
    qtbot.addWidget(screen)
    request_shutdown(screen)
    assert not screen.picker_row.isHidden() and screen.picker.count() == 2
    with qtbot.waitSignal(screen.technique_changed) as changed:
        screen.set_technique("whole-model")
    assert changed.args == ["whole-model"] and isinstance(screen.view, WholeModelView)
    screen.auto_solve()
    assert screen.view.result.text() == "fastest-device: server"
    screen.compare()
    assert screen.view.result.text() == "fastest-device, source-only"


def test_a_technique_that_does_not_apply_to_the_model_is_not_offered(qtbot, state, plugged_in,
                                                                      no_attention_offload_view):
    from msgspec import structs

    problem = state.problem
    model = structs.replace(problem.profile.model, family="gpt2")
    state.set_profile(structs.replace(problem.profile, model=model), source=problem.source, workload=problem.workload)
    screen = PlanScreen(state)
    qtbot.addWidget(screen)
    request_shutdown(screen)
    assert screen.available() == ["layer-sharding"] and screen.picker_row.isHidden()
    with pytest.raises(ValueError, match="whole-model"):
        screen.set_technique("whole-model")

"""EPD planned from and run on the connected agents in the studio (pytest-qt, three real agent
processes, a generated Llava checkpoint): *Measure phases on agents* (only ever the operator's
action: it replaces what the agents hold) makes the problem theirs, the
search plans for exactly them, *Run on agents* serves the selected layout with tokens equal to
transformers' own generate, recorded beside its prediction and replayable; what cannot run says
why."""

from __future__ import annotations

import pytest

from core.devices.local_cluster import LocalCluster
from core.runs.coordinator import Coordinator
from core.sessions.replay import Replay
from core.sessions.store import SessionStore
from core.techniques.phase_disaggregation.runtime import prepare_requests, reference_tokens
from gui.studio_state import StudioState
from gui.techniques.phase_disaggregation import PhaseDisaggregationPlanView
from gui.techniques.phase_disaggregation.agent_run import MEASURED
from gui.techniques.phase_disaggregation.plan_view import MEASURE_TEXT
from gui.widgets import UNAVAILABLE

WAIT_MS = 120_000


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from core.models.multimodal import TINY_LLAVA, make_multimodal_model

    return str(make_multimodal_model(TINY_LLAVA, tmp_path_factory.mktemp("llava") / "tiny-llava"))


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    lc = LocalCluster(tmp_path_factory.mktemp("epd-gui"), 3)
    lc.start()
    coordinator = Coordinator(lc.endpoints, lc.keys, request_timeout_s=60.0)
    coordinator.open()
    coordinator.wait_ready(30.0)
    yield coordinator
    coordinator.close()
    lc.stop()


@pytest.fixture(scope="module")
def measured(agents, llava):
    """Phase costs measured once on the agents (what *Measure on agents* does), shared by the tests."""
    from core.techniques.phase_disaggregation.on_agents import measure_costs

    return measure_costs(agents.link, llava, list(agents.endpoints), repeats=2)


@pytest.fixture
def view(qtbot, tmp_path, llava):
    state = StudioState()
    state.set_workspace(str(tmp_path / "ws.sqlite"))
    view = PhaseDisaggregationPlanView(state)
    qtbot.addWidget(view)
    assert view.set_model_dir(llava)
    yield view
    view.shutdown()


def _searched(view, qtbot, measured, agents, trials=4):
    view.state.set_agents(agents)
    view.show_measured(measured)
    view.requests.setValue(4)
    view.trials.setValue(trials)
    view.auto_solve()
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
    assert view.message.isHidden(), view.message.text()


def test_without_agents_measure_and_run_are_disabled_saying_why(view):
    assert not view.measure_button.isEnabled() and UNAVAILABLE + "no agents connected" in view.measure_button.toolTip()
    assert not view.run_button.isEnabled() and "no agents connected" in view.run_button.toolTip()


def test_a_what_if_layout_cannot_be_run_on_the_agents(view, agents, qtbot):
    view.state.set_agents(agents)
    view.devices.setValue(4)
    view.trials.setValue(2)
    view.auto_solve(requests=10)
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
    assert not view.run_button.isEnabled() and "what-if devices" in view.run_button.toolTip()
    assert view.table.item(0, 7).text() == "simulated only"


def test_choosing_the_measured_source_asks_for_the_measure_button_and_sets_no_agent_to_work(view, agents, qtbot):
    view.state.set_agents(agents)
    view.source.setCurrentText(MEASURED)  # nothing to plan until measured, but measuring replaces what they hold
    assert not view.runner.is_busy() and view.measured_costs is None
    assert MEASURE_TEXT in view.message.text() and "in place of what they hold" in view.message.text()
    assert MEASURE_TEXT == view.measure_button.text() and "in place of what they hold" in view.measure_button.toolTip()


def test_the_measure_button_measures_on_the_agents_with_progress_and_makes_the_problem_theirs(view, agents, qtbot):
    view.state.set_agents(agents)
    view.source.setCurrentText(MEASURED)
    assert view.measure_button.isEnabled()
    with qtbot.waitSignal(view.runner.progress_reported, timeout=WAIT_MS):  # one step per rotation of the agents
        view.measure_button.click()
    assert view.runner.is_busy() and view.stop_button.isEnabled()
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
    assert view.message.isHidden(), view.message.text()
    assert view.progress.value() == view.progress.maximum() == 3
    assert view.source.currentText() == MEASURED and "measured on local-0, local-1, local-2" in view.subtitle.text()
    assert view.problem().devices == ("local-0", "local-1", "local-2")
    assert view.measured_costs.encode_s_per_tile > 0 and view.ttft.value() > 0


def test_stop_cancels_a_measurement_and_keeps_the_costs_unmeasured(view, agents, qtbot):
    view.state.set_agents(agents)
    view.measure_button.click()
    assert view.runner.is_busy()
    view.stop_button.click()
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
    assert view.measured_costs is None and view.status.text().startswith("measuring stopped")
    assert view.message.isHidden(), view.message.text()  # a cancel, not a failure


def test_the_searchs_pick_runs_on_the_agents_with_generates_tokens_recorded_and_replayable(view, agents, measured,
                                                                                          llava, qtbot):
    _searched(view, qtbot, measured, agents)
    assert view.problem().devices == tuple(agents.endpoints)
    assert {view.table.item(r, 7).text() for r in range(view.table.rowCount())} == {"runs"}
    assert view.run_button.isEnabled(), view.run_button.toolTip()
    view.table.setCurrentCell(0, 0)
    view.run_button.click()
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
    assert view.message.isHidden(), view.message.text()
    run = view.run_tab.last
    assert run.pools == view.result.top[0].config and len(run.metrics) == 4
    workload = view.last_problem.workload
    assert run.tokens == reference_tokens(llava, prepare_requests(llava, workload))
    from core.models.checkpoints import corpus_lines
    from gui.techniques.phase_disaggregation.agent_run import answer_line

    shipped = " ".join(" ".join(corpus_lines()[:12]).split())  # each prompt is the shipped text's start
    assert all(run.prompts[r] and shipped.startswith(" ".join(run.prompts[r].split())) for r in run.texts)
    assert view.run_tab.answers.toPlainText().splitlines()[0] == answer_line(0, run.prompts[0], run.texts[0])
    assert "measured: TTFT p50" in view.run_tab.summary.text() and "predicted: TTFT p50" in view.run_tab.summary.text()
    with SessionStore(view.state.workspace) as store:
        runs = {r.id: r for r in store.runs()}
        assert runs[run.run_id].kind == "measured" and runs[run.predicted_id].kind == "predicted"
        assert Replay.from_store(store, run.run_id).duration_s > 0


@pytest.mark.parametrize("baseline", ["aggregated", "pd-only"])
def test_a_baselines_layout_runs_on_the_agents_with_generates_tokens(view, agents, measured, llava, qtbot, baseline):
    _searched(view, qtbot, measured, agents, trials=1)
    view.table.setCurrentCell(view.row_names.index(baseline), 0)
    view.run_on_agents()
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
    assert view.message.isHidden(), view.message.text()
    run = view.run_tab.last
    assert run.layout == baseline and run.pools.disaggregation == {"aggregated": "aggregated", "pd-only": "pd"}[baseline]
    assert run.tokens == reference_tokens(llava, prepare_requests(llava, view.last_problem.workload))


def test_the_studios_model_for_epd_is_the_views_checkpoint(qtbot, llava):
    state = StudioState()
    view = PhaseDisaggregationPlanView(state)
    qtbot.addWidget(view)
    assert view.model_dir == ""
    state.set_technique_models({"phase-disaggregation": llava})  # the demo tour's models
    assert view.model_dir == llava and view.model_button.text() == "Model: tiny-llava"


def test_shown_with_agents_and_a_llava_the_view_leaves_the_agents_as_they_are(view, agents, qtbot):
    view.state.set_agents(agents)
    view.show()  # the plan screen showing EPD: measuring would load EPD's phases in place of the agents' stages
    qtbot.waitExposed(view)
    assert not view.runner.is_busy() and view.measured_costs is None and view.source.currentText() != MEASURED

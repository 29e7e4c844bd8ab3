"""The EPD plan view: reachable from the Plan screen; a search fills the configurations (with
both baselines), the pools, the request timeline, the SLO curves and the progress chart; Stop
stops it; a bad calibration file is refused with its reason."""

from __future__ import annotations

from core.techniques.phase_disaggregation.types import PoolConfig
from gui.techniques.phase_disaggregation import PhaseDisaggregationPlanView, PoolsDiagram, RequestTimeline
from gui.screens.plan import PlanScreen
from gui.studio_state import StudioState


def _view(qtbot) -> PhaseDisaggregationPlanView:
    view = PhaseDisaggregationPlanView(StudioState())
    qtbot.addWidget(view)
    return view


def _searched(qtbot, devices: int, trials: int, requests: int) -> PhaseDisaggregationPlanView:
    """A view whose search over ``devices`` devices (``trials`` trials, ``requests`` requests) has finished."""
    view = _view(qtbot)
    view.devices.setValue(devices)
    view.trials.setValue(trials)
    view.auto_solve(requests=requests)
    qtbot.waitUntil(lambda: view.result is not None, timeout=120_000)
    return view


def test_the_plan_screen_offers_the_epd_view(qtbot):
    screen = PlanScreen(StudioState())
    qtbot.addWidget(screen)
    screen.set_technique("phase-disaggregation")
    assert isinstance(screen.view, PhaseDisaggregationPlanView)
    screen.shutdown()


def test_a_search_fills_every_pane_and_lists_both_baselines(qtbot):
    view = _searched(qtbot, devices=5, trials=3, requests=20)
    names = [view.table.item(r, 0).text() for r in range(view.table.rowCount())]
    assert names[-2:] == ["aggregated", "pd-only"] and names[0].startswith("#1")
    assert view.pools.config == view.result.best.config
    assert len(view.timeline.metrics) == 20
    assert {name for name, _ in view.result.curves} == {"search's pick", "aggregated", "pd-only"}
    assert len(view.trials_seen) == 3 and "picked" in view.status.text()
    assert view.search_button.isEnabled() and not view.stop_button.isEnabled()
    view.shutdown()


def test_selecting_a_baselines_row_shows_its_pools(qtbot):
    view = _searched(qtbot, devices=4, trials=2, requests=10)
    rows = {view.table.item(r, 0).text(): r for r in range(view.table.rowCount())}
    view.table.setCurrentCell(rows["pd-only"], 0)
    assert view.pools.config.disaggregation == "pd" and not view.pools.caches
    assert view.pools.config == dict(view.result.baselines)["pd-only"].config
    view.table.setCurrentCell(rows["aggregated"], 0)
    assert view.pools.config.disaggregation == "aggregated"
    view.shutdown()


def test_stop_ends_the_search_and_says_so(qtbot):
    view = _view(qtbot)
    view.trials.setValue(500)
    view.auto_solve(requests=20)
    qtbot.waitUntil(lambda: len(view.trials_seen) >= 1, timeout=120_000)
    view.stop_button.click()
    qtbot.waitUntil(lambda: view.search_button.isEnabled(), timeout=60_000)
    assert view.status.text() == "search stopped" and view.result is None
    view.shutdown()


def test_a_bad_costs_file_keeps_the_calibration_and_says_why(qtbot, tmp_path):
    view = _view(qtbot)
    before = view.costs
    bad = tmp_path / "c.json"
    bad.write_text('{"format": "edgeshard.epd-costs", "version": 1}')
    assert not view.load_costs(str(bad))
    assert view.costs == before and "costs not loaded" in view.status.text()


def test_a_requests_spans_follow_its_phases_in_order():
    from core.techniques.phase_disaggregation.types import RequestMetrics

    m = RequestMetrics(request_id=0, arrival_s=0.0, encode_start_s=0.0, encode_end_s=1.0, ep_transfer_end_s=1.5,
                       prefill_start_s=2.0, prefill_end_s=3.0, pd_transfer_end_s=3.5, decode_end_s=5.0,
                       output_tokens=4)
    assert RequestTimeline.spans(m) == [("encode", 0.0, 1.0), ("E→P", 1.0, 1.5), ("queue", 1.5, 2.0),
                                        ("prefill", 2.0, 3.0), ("P→D", 3.0, 3.5), ("decode", 3.5, 5.0)]


def test_record_stores_the_picks_simulated_run_in_the_workspace(qtbot, tmp_path):
    from core.sessions.store import SessionStore

    view = _view(qtbot)
    assert not view.record_button.isEnabled()
    view.devices.setValue(4)
    view.trials.setValue(2)
    view.auto_solve(requests=15)
    qtbot.waitUntil(lambda: view.result is not None, timeout=120_000)
    assert not view.record_button.isEnabled()  # no workspace yet
    view.state.set_workspace(str(tmp_path / "ws.sqlite"))
    assert view.record_button.isEnabled()
    run_id = view.record()
    with SessionStore(tmp_path / "ws.sqlite") as store:
        assert next(r for r in store.runs() if r.id == run_id).kind == "predicted"
        assert store.events(run_id)
    view.shutdown()


def test_a_device_serving_several_phases_is_labelled_with_them(qtbot):
    diagram = PoolsDiagram()
    qtbot.addWidget(diagram)
    diagram.show_pools(PoolConfig(disaggregation="pd", encode=("a", "b"), prefill=("a", "b"), decode=("c",)))
    assert [diagram.box_label(d) for d in ("a", "c")] == ["a EP", "c"]
    diagram.show_pools(PoolConfig(disaggregation="aggregated", encode=("a",), prefill=("a",), decode=("a",)))
    assert diagram.box_label("a") == "a EPD"


def test_a_narrow_pool_box_puts_the_phases_under_the_device_instead_of_eliding_its_name(qtbot):
    from PySide6.QtGui import QFontMetrics

    from gui.techniques.phase_disaggregation.drawings import box_text

    diagram = PoolsDiagram()
    qtbot.addWidget(diagram)
    metrics = QFontMetrics(diagram.font())
    narrow = metrics.horizontalAdvance("local-0") + 4  # the name fits, the name and its phases do not
    assert box_text("local-0 EPD", metrics, narrow, 3 * metrics.height()) == "local-0\nEPD"
    assert box_text("local-0 EPD", metrics, 4 * narrow, metrics.height()) == "local-0 EPD"
    assert "…" in box_text("local-0 EPD", metrics, narrow, metrics.height())  # one line's room: elided


def test_the_request_timelines_legend_wraps_instead_of_running_past_a_narrow_timeline(qtbot):
    from PySide6.QtGui import QFontMetrics

    from gui.techniques.phase_disaggregation.drawings import SPANS, RequestTimeline, legend_layout

    timeline = RequestTimeline()
    qtbot.addWidget(timeline)
    metrics = QFontMetrics(timeline.font())
    names = [name for name, _ in SPANS]
    narrow = legend_layout(names, metrics, 300)
    assert [n for n, _, _ in narrow] == names and max(row for _, _, row in narrow) >= 1
    assert all(dx + 16 + metrics.horizontalAdvance(n) <= 300 for n, dx, _ in narrow)
    assert {row for _, _, row in legend_layout(names, metrics, 2000)} == {0}


def test_an_epd_answer_is_shown_after_the_end_of_its_prompt_which_it_continues():
    """A request's prompt is cut from the shipped text mid-word, so its answer alone read as noise ("icto.")."""
    from gui.techniques.phase_disaggregation.agent_run import PROMPT_TAIL_CHARS, answer_line

    prompt = "The secret of life is to be happy. Predicting the future is hard, pred"
    line = answer_line(3, prompt, " icto.A man who has a\n")
    assert line == f"#3 …{prompt[-PROMPT_TAIL_CHARS:]} ▸ icto.A man who has a"
    assert answer_line(0, "Love is", " the best policy.") == "#0 Love is ▸ the best policy."
    assert answer_line(1, "", " alone") == "#1 alone"  # a run without prompts (an older record)

"""Speculative decoding on the Run monitor: the tokens-per-trip plot appears once a run drafts,
counts each trip's committed tokens from the token events, and the timeline draws the draft and
rollback boxes in their own colours."""

from __future__ import annotations

import pytest

from agents.protocol import TimelineEvent, TokenEvent
from gui.screens.run_monitor import RunMonitorView
from gui.techniques.speculative import tokens_per_trip
from gui.timeline.items import KIND_CODE


def event(kind: str, device: str, stage: int, step: int, start: float, end: float, nbytes: int = 0) -> TimelineEvent:
    return TimelineEvent(device=device, stage=stage, kind=kind, phase="decode" if step else "prefill", step=step,
                         micro_batch=0, start_s=start, end_s=end, nbytes=nbytes)


def tokens(*per_trip: int) -> list[TokenEvent]:
    """Token events as a speculative source posts them: a trip's tokens share one arrival time."""
    out, step = [], 0
    for trip, n in enumerate(per_trip):
        for _ in range(n):
            out.append(TokenEvent(micro_batch=0, step=step, sequence_ids=(0,), token_ids=(7,), t_s=0.1 * (trip + 1)))
            step += 1
    return out


def test_tokens_per_trip_groups_a_trips_arrivals_and_leaves_out_the_prefills_token():
    assert tokens_per_trip(tokens(1, 4, 1, 2)) == [4, 1, 2]
    assert tokens_per_trip(tokens(1)) == []


def test_the_trip_plot_appears_with_a_drafting_run_and_counts_its_trips(qtbot):
    monitor = RunMonitorView()
    qtbot.addWidget(monitor)
    monitor.resize(1200, 700)
    monitor.show()
    monitor.reset(["a", "b"], ["p"])
    monitor.add_timeline_events([event("compute", "a", 0, 0, 0.0, 0.05), event("compute", "b", 1, 0, 0.05, 0.08)])
    monitor.flush()
    assert monitor.trips_plot.isHidden() and monitor.trips_label.isHidden()
    monitor.add_timeline_events([event("draft", "a", 0, 1, 0.1, 0.11, 3), event("compute", "a", 0, 1, 0.11, 0.12),
                                 event("rollback", "b", 1, 2, 0.2, 0.2005, 2), event("compute", "b", 1, 1, 0.12, 0.15)])
    monitor.add_token_events(tokens(1, 4, 2))
    monitor.flush()
    assert monitor.trips_plot.isVisible() and monitor.trips_plot.counts == [4, 2] and monitor.trips_plot.mean == 3.0
    drawn = monitor.timeline.measured_item.boxes.rows["kind"].tolist()
    assert KIND_CODE["draft"] in drawn and KIND_CODE["rollback"] in drawn
    monitor.reset(["a", "b"], ["p"])
    assert monitor.trips_plot.isHidden()


def test_a_recorded_speculative_run_replays_with_its_marks_and_trip_plot(qtbot, tmp_path):
    from core.sessions.recording import record_run
    from gui.studio_state import StudioState
    from tests.gui.screens.test_sessions import _open, _play_to_end, _sessions

    workspace = tmp_path / "ws.edgeshard"
    events = [event("compute", "a", 0, 0, 0.0, 0.05), event("compute", "b", 1, 0, 0.05, 0.08),
              event("draft", "a", 0, 1, 0.1, 0.11, 3), event("compute", "a", 0, 1, 0.11, 0.12),
              event("compute", "b", 1, 1, 0.12, 0.15), event("draft", "a", 0, 2, 0.2, 0.21, 3),
              event("rollback", "b", 1, 2, 0.22, 0.2205, 2), event("compute", "b", 1, 2, 0.2205, 0.25)]
    with record_run(workspace, model="demo-llama", mode="sequential",
                    settings={"prompts": ["p"], "lanes": ["a", "b"]}) as run:
        for e in events:
            run.recorder.on_event(e)
        for t in tokens(1, 4, 2):
            run.recorder.on_tokens(t)
        run.status = "completed"
    state = StudioState()
    state.set_workspace(str(workspace))
    panel = _sessions(qtbot, state)
    [(run_id, _)] = panel.run_items().items()
    _open(qtbot, panel, run_id)
    _play_to_end(qtbot, panel, 30_000)
    panel.monitor.flush()
    assert not panel.monitor.trips_plot.isHidden() and panel.monitor.trips_plot.counts == [4, 2]
    drawn = panel.monitor.timeline.measured_item.boxes.rows["kind"].tolist()
    assert KIND_CODE["draft"] in drawn and KIND_CODE["rollback"] in drawn
    assert "draft" in panel.monitor.timeline.legend_text() and "rollback" in panel.monitor.timeline.legend_text()
    panel.shutdown()


@pytest.fixture(scope="module")
def target_and_draft(tmp_path_factory):
    """A tiny Llama and its ``-draft`` beside it, with a stored acceptance rate of 0.8."""
    import json

    from core.models.checkpoints import ModelRecipe, make_model

    root = tmp_path_factory.mktemp("speculative-view")
    shape = dict(family="llama", hidden=64, heads=4, kv_heads=2, vocab=512)
    target = make_model(ModelRecipe(layers=2, seed=3, **shape), root / "tiny-llama")
    draft = make_model(ModelRecipe(layers=1, seed=5, **shape), root / "tiny-llama-draft")
    (draft / "speculation.json").write_text(json.dumps({"acceptance_rate": 0.8}))
    return target, draft


def test_the_run_screens_predicted_timeline_of_a_speculative_run_plays_its_trips(qtbot, tmp_path, target_and_draft):
    from gui.screens.run import RunPanel
    from gui.studio_state import StudioState
    from tests.gui.run_backends import simulated_run

    problem, plan, _, _ = simulated_run(generated_tokens=6, micro_batches=1)
    target, draft = target_and_draft
    state = StudioState()
    state.set_profile(problem.profile)
    state.set_problem(problem)
    state.set_plan(plan)
    state.set_workspace(str(tmp_path / "ws.sqlite"))
    panel = RunPanel(state, None)
    qtbot.addWidget(panel, before_close_func=lambda w: w.shutdown(5.0))
    panel.model_edit.setText(str(target))
    panel.prompts_edit.setPlainText("one prompt")
    panel.max_tokens_spin.setValue(12)
    panel.mode_combo.setCurrentText("sequential")
    panel.micro_batches_spin.setValue(1)

    def kinds():
        return set(panel.monitor.timeline.boxes(predicted=True)["kind"].tolist())

    qtbot.waitUntil(lambda: not panel.predict_runner.is_busy() and not panel._predict_timer.isActive()
                    and KIND_CODE["compute"] in kinds(), timeout=60_000)
    assert KIND_CODE["draft"] not in kinds()  # no draft: plain decoding's prediction
    panel.speculative_controls.apply(str(draft), 3)
    qtbot.waitUntil(lambda: KIND_CODE["draft"] in kinds(), timeout=60_000)
    assert "speculative, k 3" in panel.prediction_note.text() and not panel.prediction_note.isHidden()
    assert KIND_CODE["rollback"] in kinds()  # acceptance 0.8: some trips reject a proposal
    assert panel.shutdown(5.0)


def test_compare_on_the_plan_screen_adds_each_plans_speculative_row_with_the_models_draft(qtbot, target_and_draft):
    import msgspec

    from core.planning.cost import evaluate
    from core.planning.plan import plan_from_boundaries
    from core.planning.solvers.comparison import run_strategy
    from core.planning.speculation import DraftFigures, choose_k, draft_token_s
    from gui.studio_state import StudioState
    from gui.techniques.layer_sharding.editor import PlanEditorPanel
    from tests.gui.problems import make_problem

    target, draft = target_and_draft
    state = StudioState()
    editor = PlanEditorPanel(state)
    qtbot.addWidget(editor)
    problem = make_problem()
    state.set_model("tiny-llama", str(target))
    state.set_problem(problem)
    plans = [plan_from_boundaries("tiny-llama", 10, ["phone", "server"], [3]),
             plan_from_boundaries("tiny-llama", 10, ["phone", "laptop", "server"], [1, 4])]
    results = [msgspec.structs.replace(run_strategy(problem, "even", "latency"), strategy=f"s{i}", plan=p,
                                       cost=evaluate(problem, p)) for i, p in enumerate(plans)]
    editor.show_comparison(results)
    table = editor.compare_table
    assert table.rowCount() == 4 and table.cellWidget(2, 3) is None  # a speculative row is the plan above: no Adopt
    for i, plan in enumerate(plans):
        want = choose_k(problem, plan, DraftFigures(acceptance_rate=0.8, token_s=draft_token_s(problem, plan, 1)))
        name = table.item(2 + i, 0).text()
        assert name == (f"s{i} + draft, k {want.k}" if want.k else f"s{i} + draft: plain is faster")
        assert table.item(2 + i, 2).text() == f"{want.speculative_tokens_s:.1f}"
        assert "by proxy" in table.item(2 + i, 0).toolTip()
    state.set_model("tiny-llama", str(draft))  # a model with no draft beside it: the strategies alone
    editor.show_comparison(results)
    assert table.rowCount() == 2
    editor.shutdown()

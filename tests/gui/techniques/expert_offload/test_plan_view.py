"""The expert-offloading plan view: reachable from the Plan screen, Compare lists EdgeMoE and
the paper's baselines with their figures, and the scenario's controls change the plan."""

from __future__ import annotations

import pytest

from gui.techniques.expert_offload.plan_view import ExpertOffloadPlanView
from gui.screens.plan import PlanScreen
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


def _ready_state(tmp_path, family="mixtral"):
    from core.devices.cluster import Cluster, Device
    from core.models.checkpoints import ModelRecipe, make_model

    model = make_model(ModelRecipe(family=family, layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=2,
                                   **({"experts": 4} if family == "mixtral" else {})), tmp_path / f"tiny-{family}")
    state = StudioState()
    state.set_cluster(Cluster(devices=(Device(id="e0", memory_bytes=1 << 30),)))
    state.set_model(f"tiny-{family}", str(model))
    return state, model


def test_use_for_run_is_disabled_saying_why_until_a_model_and_agents_are_there(qtbot):
    view = ExpertOffloadPlanView(StudioState())
    qtbot.addWidget(view)
    assert not view.use_for_run.isEnabled() and "Mixtral checkpoint" in view.use_for_run.toolTip()


def test_use_for_run_makes_the_full_precision_plan_the_run_screens_plan(qtbot, tmp_path):
    import json

    state, model = _ready_state(tmp_path)
    view = ExpertOffloadPlanView(state)
    qtbot.addWidget(view)
    assert view.use_for_run.isEnabled()
    view.strategy.setCurrentText("io-exp")  # full precision: runs without quantised experts
    view.use_for_run.click()
    assert [(s.device, s.kind) for s in state.plan.stages] == [("e0", "expert-offload")]
    assert json.loads((model / "expert-offload.json").read_text())["policy"] == "lru"
    assert "runs tiny-mixtral on e0" in view.run_message.text()


def test_use_for_run_of_a_quantised_plan_or_a_dense_model_says_what_to_do(qtbot, tmp_path):
    state, _ = _ready_state(tmp_path)
    view = ExpertOffloadPlanView(state)
    qtbot.addWidget(view)
    view.strategy.setCurrentText("io-qexp")  # uniform INT4: needs the quantised experts first
    view.use_for_run.click()
    assert state.plan is None and "adapt-bits" in view.run_message.text()
    dense_state, _ = _ready_state(tmp_path, family="llama")
    dense = ExpertOffloadPlanView(dense_state)
    qtbot.addWidget(dense)
    dense.strategy.setCurrentText("io-exp")
    dense.use_for_run.click()
    assert dense_state.plan is None and "needs a Mixtral" in dense.run_message.text()


def test_the_studios_model_for_expert_offloading_is_the_views_checkpoint(qtbot, tmp_path):
    state, model = _ready_state(tmp_path)
    state.model_path = ""
    view = ExpertOffloadPlanView(state)
    qtbot.addWidget(view)
    assert not view.use_for_run.isEnabled()
    state.set_technique_models({"expert-offload": str(model)})  # the demo tour's models
    assert view._model() == str(model) and view.use_for_run.isEnabled()


def _run_screen_beside_the_view(qtbot, tmp_path):
    """A studio whose model is a Llama (layer sharding's) and an expert-offload view given a Mixtral,
    with the Run screen on the same state."""
    from core.models.checkpoints import ModelRecipe, make_model
    from gui.screens.run import RunPanel

    state, moe = _ready_state(tmp_path)
    llama = make_model(ModelRecipe(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=2),
                       tmp_path / "tiny-llama")
    state.set_model("tiny-llama", str(llama))
    run = RunPanel(state)
    qtbot.addWidget(run)
    run.model_edit.setText(str(llama))
    view = ExpertOffloadPlanView(state)
    qtbot.addWidget(view)
    view.set_model_dir(str(moe))
    view.strategy.setCurrentText("io-exp")
    return state, run, view, moe, llama


def test_use_for_run_switches_the_run_screens_model_to_the_views_mixtral(qtbot, tmp_path):
    state, run, view, moe, _llama = _run_screen_beside_the_view(qtbot, tmp_path)
    view.use_for_run.click()
    assert state.plan is not None and run.model_edit.text() == str(moe)


def test_back_on_a_layer_sharding_plan_the_run_screen_runs_its_model_again(qtbot, tmp_path):
    from core.planning.plan import plan_from_boundaries

    state, run, view, moe, llama = _run_screen_beside_the_view(qtbot, tmp_path)
    view.use_for_run.click()
    state.set_plan(plan_from_boundaries("tiny-llama", 2, ["e0"], []))
    assert run.model_edit.text() == str(llama)


def _settled_ghosts(qtbot, run):
    """The Run screen's predicted timeline once its worker has drawn it."""
    timeline = run.monitor.timeline
    qtbot.waitUntil(lambda: not run._predict_timer.isActive() and not run.predict_runner.is_busy()
                    and timeline.box_count(predicted=True) > 0, timeout=60_000)
    return timeline


def test_the_run_screens_ghosts_are_edgemoes_schedule_of_the_runs_batch_clipped_to_the_tokens_generated(
        qtbot, tmp_path):
    """They were layer sharding's prediction of the Llama's problem, then one sequence's whatever the run
    batched. Now: per step one compute box (the agent times its whole forward) and the expert reads of the
    run's 3 prompts on the storage lane: the prefill reads every expert its 3 x width prompt tokens pick (an
    empty buffer; width: the run's prompts padded, not the problem's 8), a decode step the distinct experts
    3 sequences pick (io-exp's LRU hits none)."""
    from agents.protocol import storage_lane
    from core.runs.generation import load_tokenizer
    from core.techniques.expert_offload.cost import distinct_experts, read_s

    state, run, view, moe, _llama = _run_screen_beside_the_view(qtbot, tmp_path)
    width = len(load_tokenizer(str(moe))(["one", "two", "three"], padding=True)["input_ids"][0])
    run.prompts_edit.setPlainText("one\ntwo\nthree")
    run.max_tokens_spin.setValue(6)
    view.use_for_run.click()
    timeline = _settled_ghosts(qtbot, run)
    problem = view.problem()
    plan = view.outcome()[0].plan
    m = problem.model
    assert plan.policy == "lru" and not m.decode_batch_sizes  # the what-if model: per-token times scaled by tokens
    assert timeline.box_count(device="e0", kind="compute", predicted=True) == 6
    ghosts = timeline.boxes(predicted=True)
    reads = [e for e in timeline._predicted_events if e.device == storage_lane("e0")]
    one_read = read_s(problem, plan)
    assert width != problem.prompt_tokens
    step_reads = [distinct_experts(m.experts, m.top_k, 3 * width)] + \
        [distinct_experts(m.experts, m.top_k, 3)] * 5
    assert sum(e.end_s - e.start_s for e in reads) == pytest.approx(m.layers * sum(step_reads) * one_read)
    tokens = [3 * width] + [3] * 5
    per_token = m.layer_compute_s + m.top_k * m.expert_compute_s
    end = sum(m.layers * (r * one_read + n * per_token) + n * m.head_s for r, n in zip(step_reads, tokens))
    assert ghosts["end_s"].max() == pytest.approx(end)
    state.use_technique("layer-sharding")
    state.use_technique("expert-offload")  # back on the Plan screen's technique: still EdgeMoE's prediction
    assert state.plan_origin(state.plan).plan.slots == plan.slots and state.plan_origin(state.plan).plan.device == "e0"
    ran = [e for e in timeline._predicted_events if e.step <= 1]  # the run stopped at EOS after 2 tokens
    timeline.append_events(ran)
    run._finish("done", "done")
    assert timeline.box_count(predicted=True) == len(ran)
    assert run.monitor.timeline.x_range()[1] <= max(e.end_s for e in ran) * 1.05
    run.shutdown(5.0)

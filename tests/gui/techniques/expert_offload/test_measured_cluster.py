"""Expert offloading planned from the measured cluster and run from the studio (pytest-qt, a real
agent process, a generated Mixtral): the plan view builds its problem from the agents' profile
(compute times, the agent's memory budget) and the measured storage, a strategy that does not fit
cannot be used, and the adopted plan runs on the Run screen with tokens equal to transformers'
own generate, its storage lane and heat map live, recorded and replayable."""

from __future__ import annotations

import json

import msgspec
import pytest

from core.devices.local_cluster import LocalCluster
from core.runs.coordinator import Coordinator
from core.runs.generation import load_tokenizer
from core.sessions.replay import Replay
from core.sessions.store import SessionStore
from core.techniques.expert_offload.on_agents import device_memory_bytes
from core.techniques.expert_offload.profiling import STORAGE_FILE
from core.techniques.expert_offload.simulator import simulate
from core.techniques.run_origin import replay_prediction
from gui.studio_state import StudioState
from gui.techniques.expert_offload.plan_view import MEASURED, WHAT_IF, ExpertOffloadPlanView
from gui.widgets import UNAVAILABLE
from tests.core.hf_reference import hf_greedy_new_tokens
from tests.gui.run_backends import cluster_run_panel

PROMPTS = ["the river and its banks", "hello there"]


def generate_texts(model_dir: str, new_tokens: int) -> list[str]:
    """transformers' own greedy generate of the unsplit model for ``PROMPTS`` (the reference)."""
    tok = load_tokenizer(model_dir)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    return [tok.decode([t for t in row if t != 2], skip_special_tokens=True)
            for row in hf_greedy_new_tokens(model_dir, enc, new_tokens)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(coordinator, Mixtral checkpoint, its profile measured on the agent)."""
    from core.devices.profiling import profile_cluster
    from core.models.checkpoints import ModelRecipe, make_model

    recipe = ModelRecipe(family="mixtral", layers=3, hidden=64, heads=4, kv_heads=2, vocab=512, seed=9, experts=8)
    model_dir = str(make_model(recipe, tmp_path_factory.mktemp("moe") / "tiny-mixtral"))
    lc = LocalCluster(tmp_path_factory.mktemp("moe-agents"), 1)
    lc.start()
    coordinator = Coordinator(lc.endpoints, lc.keys, request_timeout_s=60.0)
    coordinator.open()
    coordinator.wait_ready(30.0)
    config = json.loads(open(f"{model_dir}/config.json").read())
    profile = profile_cluster(coordinator, config, model_name="tiny-mixtral", batch_sizes=(1,), repeats=1,
                              prompt_tokens=8, network=False).profile
    yield coordinator, model_dir, profile
    coordinator.close()
    lc.stop()


@pytest.fixture
def view(qtbot, cluster):
    _, model_dir, profile = cluster
    state = StudioState()
    state.set_profile(profile)
    state.set_model("tiny-mixtral", model_dir)
    view = ExpertOffloadPlanView(state)
    qtbot.addWidget(view)
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=30_000)  # the storage measurement
    yield view
    view.shutdown()


def test_without_a_profile_the_view_plans_the_what_if_scenario_saying_what_measured_needs(qtbot):
    view = ExpertOffloadPlanView(StudioState())
    qtbot.addWidget(view)
    assert view.source.currentText() == WHAT_IF and "no model" in view.subtitle.text()


def test_the_problem_is_the_profiled_agents_with_its_budget_and_the_measured_storage(view, cluster):
    _, model_dir, profile = cluster
    assert view.source.currentText() == MEASURED and view.device.currentText() == "local-0"
    # the reads a run finds: page-cached (the agent just loaded this checkpoint), a fixed cost + bytes at a bandwidth
    measured = json.loads(open(f"{model_dir}/{STORAGE_FILE}").read())["warm"]
    problem = view.problem()
    assert problem.bandwidth_bps == pytest.approx(measured["bandwidth_bps"], rel=1e-3)
    assert problem.read_fixed_s == pytest.approx(measured["fixed_s"]) and "MB/s measured" in view.subtitle.text()
    m = problem.model
    half = m.resident_bytes + int(0.5 * m.layers * m.experts * m.expert_bytes)
    assert problem.memory_budget_bytes == min(device_memory_bytes(profile, "local-0"), half)
    assert m.layers == 3 and m.experts == 8 and m.expert_compute_s > 0  # the checkpoint's, timed on the agent


def test_a_strategy_that_does_not_fit_cannot_be_used_for_run(view):
    view.compare()
    rows = {view.table.item(r, 0).text(): r for r in range(view.table.rowCount())}
    assert view.table.item(rows["io-free"], 1).text() == "oom"  # every expert resident: over half of them
    view.table.setCurrentCell(rows["io-free"], 0)
    assert view.strategy.currentText() == "io-free"
    assert not view.use_for_run.isEnabled() and UNAVAILABLE + "io-free does not fit (oom" in view.use_for_run.toolTip()
    view.table.setCurrentCell(rows["edgemoe"], 0)
    assert view.use_for_run.isEnabled()


def test_profile_agents_plans_the_agents_own_problem_and_its_plan_runs_from_the_run_screen_equal_to_generate(
        cluster, qtbot, tmp_path):
    coordinator, model_dir, _ = cluster
    state = StudioState()  # the studio's profile is of no MoE: the view profiles the agents for its model
    state.set_agents(coordinator)
    view = ExpertOffloadPlanView(state)
    qtbot.addWidget(view)
    view.set_model_dir(model_dir)
    assert view.source.currentText() == WHAT_IF and "Profile agents" in view.subtitle.text()
    view.profile_button.click()
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=60_000)
    assert view.run_message.isHidden() or "Measuring failed" not in view.run_message.text()
    assert view.source.currentText() == MEASURED and view.device.currentText() == "local-0"
    view.auto_solve()
    view.use_for_run.click()
    plan = view.state.plan
    assert [(s.device, s.kind) for s in plan.stages] == [("local-0", "expert-offload")]
    assert plan.stages[0].options["slots"] < 3 * 8  # the buffer holds fewer experts than the model has: reads from storage
    state, panel = cluster_run_panel(qtbot, coordinator, plan, tmp_path / "ws.sqlite", model_dir, PROMPTS, 4)
    with qtbot.waitSignal(panel.run_finished, timeout=90_000) as done:
        panel.start_run()
    assert done.args == ["completed"], panel.message.text()
    monitor = panel.monitor
    monitor.flush()
    assert monitor.timeline.box_count("local-0:storage", "io") > 0 and not monitor.heat_map.isHidden()
    assert [monitor.text_of(i) for i in range(len(PROMPTS))] == generate_texts(model_dir, 4)
    assert panel.shutdown()
    view.shutdown()
    with SessionStore(state.workspace) as store:
        (run,) = store.runs()
        replay = Replay.from_store(store, run.id)
        assert run.status == "completed" and replay.duration_s > 0
        assert any(e.device == "local-0:storage" for e in store.events(run.id))


def test_run_on_agents_in_the_view_runs_the_plan_live_equal_to_generate_recorded_and_the_studios_plan_kept(
        view, cluster, qtbot, tmp_path):
    coordinator, model_dir, _ = cluster
    assert not view.run_box.run_button.isEnabled() and "no agents connected" in view.run_box.run_button.toolTip()
    view.state.set_agents(coordinator)
    view.state.set_workspace(str(tmp_path / "ws.sqlite"))
    view.auto_solve()
    assert view.run_box.run_button.isEnabled(), view.run_box.run_button.toolTip()
    view.run_box.prompts.setText(" | ".join(PROMPTS))
    view.run_box.max_tokens.setValue(4)
    view.run_box.run_button.click()
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=90_000)
    assert view.run_box.message.isHidden(), view.run_box.message.text()
    assert view.state.plan is None  # the studio's (layer-sharding) plan is not replaced
    box = view.run_box
    assert box.timeline.lanes() == ["local-0", "local-0:storage"] and box.timeline.box_count("local-0:storage", "io") > 0
    assert box.heat_map.activity.totals()["misses"] > 0
    assert box.last["texts"] == generate_texts(model_dir, 4)
    with SessionStore(view.state.workspace) as store:
        run = next(r for r in store.runs() if r.id == box.last["run_id"])
        assert run.status == "completed" and Replay.from_store(store, run.id).duration_s > 0
        assert any(e.device == "local-0:storage" for e in store.events(run.id))
        predicted, note = replay_prediction(run, store.problem_of(run.id), store.plan(run.plan_id),
                                            store.origin_of(run.id))
    # its replay's ghosts: EdgeMoE's simulate of the view's problem and plan, the run's batch and prompt width
    width = load_tokenizer(model_dir)(PROMPTS, return_tensors="pt", padding=True)["input_ids"].shape[1]
    plan = msgspec.structs.replace(view.outcome()[0].plan, device="local-0")
    expected = simulate(view.problem(), plan, "sequential", generated_tokens=4, micro_batch_sizes=(len(PROMPTS),),
                        prompt_tokens=width)
    assert predicted == expected.events and note == ""

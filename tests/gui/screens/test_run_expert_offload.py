"""The Run screen runs an expert-offloading plan on a real agent (the shared generate loads its
``expert-offload`` stage): text equal to HF generate, the expert reads on the storage lane and
the expert heat map filling in live, the run recorded with its expert events."""

from __future__ import annotations

import shutil
import threading

import pytest

from core.runs.generation import load_tokenizer
from core.sessions.store import SessionStore
from core.techniques import generation_for, technique_named
from core.techniques.expert_offload.activity import ExpertActivity
from core.techniques.expert_offload.problem import OffloadPlan
from tests.core.hf_reference import hf_greedy_new_tokens
from tests.core.in_process_agents import in_process_cluster
from tests.gui.run_backends import cluster_run_panel

PROMPTS = ["the river and its banks", "hello there"]


@pytest.fixture(scope="module")
def moe_cluster(tmp_path_factory):
    from core.models.checkpoints import ModelRecipe, make_model

    recipe = ModelRecipe(family="mixtral", layers=3, hidden=64, heads=4, kv_heads=2, vocab=512, seed=9, experts=8)
    model_dir = str(make_model(recipe, tmp_path_factory.mktemp("gui-moe") / "tiny-mixtral"))
    with in_process_cluster(["e0"]) as (coordinator, _):
        yield coordinator, model_dir


def test_the_run_screen_runs_an_expert_offload_plan_with_its_heat_map_live_and_recorded(qtbot, moe_cluster, tmp_path):
    coordinator, source = moe_cluster
    model_dir = str(tmp_path / "tiny-mixtral")
    shutil.copytree(source, model_dir)
    plan = technique_named("expert-offload").run_plan(OffloadPlan(device="e0", slots=3, preload=1), model_dir)
    assert generation_for(plan) is None  # the shared generate runs it
    state, panel = cluster_run_panel(qtbot, coordinator, plan, tmp_path / "ws.sqlite", model_dir, PROMPTS, 4)
    with qtbot.waitSignal(panel.run_finished, timeout=90_000) as done:
        panel.start_run()
    assert done.args == ["completed"], panel.message.text()
    monitor = panel.monitor
    monitor.flush()
    assert monitor.timeline.lanes() == ["e0", "e0:storage"]
    assert monitor.timeline.box_count("e0:storage", "io") > 0
    # the storage lane's bar is its share of the run reading experts (it never computes), not "0 %"
    reads = sum(e.end_s - e.start_s for e in monitor.metrics.events if e.device == "e0:storage" and e.kind == "io")
    share = min(1.0, reads / monitor.metrics.figures().duration_s)
    bar = monitor.util_bars["e0:storage"]
    assert bar.format() == f"reads {share * 100:.0f} %" and share > 0 and "reading experts" in bar.toolTip()
    heat = monitor.heat_map
    assert not heat.isHidden() and heat.blocks() == [0, 1, 2] and heat.activity.totals()["misses"] > 0
    tok = load_tokenizer(model_dir)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    for i, row in enumerate(hf_greedy_new_tokens(model_dir, enc, 4)):
        assert monitor.text_of(i) == tok.decode([t for t in row if t != 2], skip_special_tokens=True)
    qtbot.waitUntil(lambda: not [t for t in threading.enumerate() if t.name.startswith("edgeshard-run")],
                    timeout=30_000)
    assert panel.shutdown()
    with SessionStore(state.workspace) as store:
        (run,) = store.runs()
        recorded = ExpertActivity()
        recorded.add([i.event for i in store.timeline(run.id) if i.event is not None])
    assert run.status == "completed" and recorded.totals() == heat.activity.totals()


def test_on_failure_says_it_cannot_re_plan_a_plan_of_another_model_than_the_studios_profile(qtbot, moe_cluster,
                                                                                            tmp_path):
    from tests.gui.problems import make_problem

    coordinator, model_dir = moe_cluster
    plan = technique_named("expert-offload").run_plan(OffloadPlan(device="e0", slots=3, preload=1), model_dir)
    state, panel = cluster_run_panel(qtbot, coordinator, plan, tmp_path / "ws.sqlite", model_dir, PROMPTS, 4)
    assert panel.on_failure_combo.isEnabled()  # no studio problem: nothing says otherwise
    problem = make_problem()  # the studio's layer-sharding problem, of another model (the demo's Llama)
    state.set_problem(problem)
    assert not panel.on_failure_combo.isEnabled()
    tip = panel.on_failure_combo.toolTip()
    assert f"needs a profile of {plan.model}" in tip and problem.profile.model.name in tip and "stops this run" in tip


def test_a_run_of_another_checkpoint_than_the_studios_model_is_recorded_under_its_own_name(qtbot, moe_cluster,
                                                                                            tmp_path):
    coordinator, model_dir = moe_cluster
    plan = technique_named("expert-offload").run_plan(OffloadPlan(device="e0", slots=3, preload=1), model_dir)
    state, panel = cluster_run_panel(qtbot, coordinator, plan, tmp_path / "ws.sqlite", model_dir, PROMPTS[:1], 2)
    state.set_model("demo-llama", str(tmp_path / "demo-llama"))  # the studio's model (the demo's Llama)
    with qtbot.waitSignal(panel.run_finished, timeout=90_000) as done:
        panel.start_run()
    assert done.args == ["completed"], panel.message.text()
    qtbot.waitUntil(lambda: not [t for t in threading.enumerate() if t.name.startswith("edgeshard-run")],
                    timeout=30_000)
    assert panel.shutdown()
    with SessionStore(state.workspace) as store:
        (run,) = store.runs()
    assert run.model == "tiny-mixtral"  # was "demo-llama": the MoE's run replayed as the Llama's

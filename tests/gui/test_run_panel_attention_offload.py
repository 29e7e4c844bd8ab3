"""The Run screen runs an attention-offloading plan on real agents (Technique.run_generation
through core.techniques.generation_for): the dense stage on the compute agent, attention on the
other agents; the live timeline shows every lane, the text equals HF generate, the run is
recorded and replays."""

from __future__ import annotations

import threading

import pytest

from core.runs.generation import load_tokenizer
from core.sessions.store import SessionStore
from core.techniques import generation_for, technique_named
from core.techniques.attention_offload.problem import OffloadPlan
from tests.core.hf_reference import hf_greedy_new_tokens
from tests.core.in_process_agents import in_process_cluster
from tests.gui.run_backends import cluster_run_panel

DEVICES = ["c0", "m0", "m1"]
PROMPTS = ["the river and its banks", "hello there"]


@pytest.fixture(scope="module")
def offload_cluster(tmp_path_factory):
    from core.models.checkpoints import ModelRecipe, make_model

    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)
    model_dir = str(make_model(recipe, tmp_path_factory.mktemp("gui-offload") / "tiny-llama"))
    with in_process_cluster(DEVICES) as (coordinator, _):
        yield coordinator, model_dir


def test_the_run_screen_runs_an_attention_offload_plan_with_every_lane_live_and_recorded(
        qtbot, offload_cluster, tmp_path):
    coordinator, model_dir = offload_cluster
    technique = technique_named("attention-offload")
    plan = technique.run_plan(OffloadPlan(compute=("c0",), memory=("m0", "m1"), batch=2, in_flight=1), model_dir)
    assert generation_for(plan) is technique.run_generation
    state, panel = cluster_run_panel(qtbot, coordinator, plan, tmp_path / "ws.sqlite", model_dir, PROMPTS, 4)
    with qtbot.waitSignal(panel.run_finished, timeout=90_000) as done:
        panel.start_run()
    assert done.args == ["completed"], panel.message.text()
    timeline = panel.monitor.timeline
    timeline.flush()
    assert timeline.lanes() == DEVICES
    assert all(timeline.box_count(d, "compute") > 0 for d in DEVICES)
    tok = load_tokenizer(model_dir)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    for i, row in enumerate(hf_greedy_new_tokens(model_dir, enc, 4)):
        assert panel.monitor.text_of(i) == tok.decode([t for t in row if t != 2], skip_special_tokens=True)
    qtbot.waitUntil(lambda: not [t for t in threading.enumerate() if t.name.startswith("edgeshard-run")],
                    timeout=3000)
    assert panel.shutdown()
    with SessionStore(state.workspace) as store:
        (run,) = store.runs()
        assert run.status == "completed" and run.settings["lanes"] == DEVICES
        devices = {i.event.device for i in store.timeline(run.id) if i.event is not None}
        assert devices == set(DEVICES)

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
def offload_model(tmp_path_factory) -> str:
    from core.models.checkpoints import ModelRecipe, make_model

    recipe = ModelRecipe(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)
    return str(make_model(recipe, tmp_path_factory.mktemp("gui-offload") / "tiny-llama"))


@pytest.fixture(scope="module")
def offload_cluster(offload_model):
    with in_process_cluster(DEVICES) as (coordinator, _):
        yield coordinator, offload_model


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
                    timeout=30_000)
    assert panel.shutdown()
    with SessionStore(state.workspace) as store:
        (run,) = store.runs()
        assert run.status == "completed" and run.settings["lanes"] == DEVICES
        devices = {i.event.device for i in store.timeline(run.id) if i.event is not None}
        assert devices == set(DEVICES)


STAGGERED = ["c0", "c1", "m0", "m1"]
THREE = ["the river and its banks", "hello there", "a cat"]


@pytest.fixture(scope="module")
def staggered_cluster(offload_model):
    with in_process_cluster(STAGGERED) as (coordinator, _):
        yield coordinator, offload_model


@pytest.mark.parametrize("schedule", ["fixed", "rotational"])
def test_the_run_screen_runs_staggered_replicas_with_their_lanes_and_the_attention_lanes_recorded_and_replayed(
        qtbot, staggered_cluster, tmp_path, schedule):
    from core.reporting import NullReporter
    from gui.screens.run_monitor import RunMonitorView
    from gui.screens.sessions import load_run

    coordinator, model_dir = staggered_cluster
    plan = technique_named("attention-offload").run_plan(
        OffloadPlan(compute=("c0",), memory=("c1", "m0", "m1"), batch=1, in_flight=1), model_dir)
    state, panel = cluster_run_panel(qtbot, coordinator, plan, tmp_path / "ws.sqlite", model_dir, THREE, 3)
    state.set_agents(coordinator)
    # every agent but one memory agent may be a replica (3 of 4; a 3-agent demo: 2)
    assert not panel.offload_controls.isHidden() and panel.offload_controls.replicas.maximum() == 3
    panel.offload_controls.replicas.setValue(2)
    panel.offload_controls.schedule.setCurrentText(schedule)
    panel.micro_batches_spin.setValue(3)
    assert "compute: c0, c1 · memory (attention): m0, m1" in panel.offload_controls.roles.text()
    with qtbot.waitSignal(panel.run_finished, timeout=120_000) as done:
        panel.start_run()
    assert done.args == ["completed"], panel.message.text()
    timeline = panel.monitor.timeline
    timeline.flush()
    notes = ["c0 · compute 0", "c1 · compute 1", "m0 · attention", "m1 · attention"]
    assert timeline.lanes() == STAGGERED and timeline.lane_labels() == notes
    assert all(timeline.box_count(d, "compute") > 0 for d in STAGGERED)  # both replicas and both memory agents
    tok = load_tokenizer(model_dir)
    enc = tok(THREE, return_tensors="pt", padding=True)
    for i, row in enumerate(hf_greedy_new_tokens(model_dir, enc, 3)):
        assert panel.monitor.text_of(i) == tok.decode([t for t in row if t != 2], skip_special_tokens=True)
    assert panel.shutdown()
    with SessionStore(state.workspace) as store:
        (run,) = store.runs()
        assert run.status == "completed" and run.settings["technique_options"] == {
            "compute_replicas": 2, "schedule": schedule} and run.settings["micro_batches"] == 3
    loaded = load_run(NullReporter(), state.workspace, run.id)
    replay = RunMonitorView()
    qtbot.addWidget(replay)
    replay.reset(loaded.lanes, loaded.prompts, loaded.lane_notes)
    replay.add_timeline_events([i.event for i in loaded.items if i.event is not None])
    replay.timeline.flush()
    assert replay.timeline.lane_labels() == notes
    assert {d: replay.timeline.box_count(d, "compute") for d in STAGGERED} == \
        {d: timeline.box_count(d, "compute") for d in STAGGERED}
    assert replay.shutdown()


def _offload_panel_with_four_agents(qtbot, offload_model, tmp_path):
    """A Run screen on a one-compute, one-memory attention-offload plan, with four agents
    connected (room for a second compute replica)."""

    class Agents:
        endpoints = ("c0", "c1", "m0", "m1")

    plan = technique_named("attention-offload").run_plan(
        OffloadPlan(compute=("c0",), memory=("m0",), batch=1, in_flight=1), offload_model)
    state, panel = cluster_run_panel(qtbot, None, plan, tmp_path / "ws.sqlite", offload_model, THREE, 3)
    state.set_agents(Agents())
    return state, panel


def test_the_plan_screens_proposed_staggering_is_shown_on_the_run_screen_and_hidden_for_other_plans(
        qtbot, offload_model, tmp_path):
    from core.planning.plan import plan_from_boundaries

    state, panel = _offload_panel_with_four_agents(qtbot, offload_model, tmp_path)
    state.propose_run_options({"compute_replicas": 2, "schedule": "fixed"}, 3)
    s = panel.settings()
    assert s.technique_options == {"compute_replicas": 2, "schedule": "fixed"} and s.micro_batches == 3
    assert panel.offload_controls.lane_notes() == {"c0": "compute 0", "c1": "compute 1", "m0": "attention",
                                                   "m1": "attention"}
    state.set_plan(plan_from_boundaries("m", 6, ["c0", "m0"], [3]))  # a layer-sharding plan: no such options
    assert panel.offload_controls.isHidden() and panel.settings().technique_options == {}


def test_the_penalty_and_ngram_fields_are_disabled_saying_why_for_a_staggered_run_and_sent_off(
        qtbot, offload_model, tmp_path):
    from gui.widgets import UNAVAILABLE

    state, panel = _offload_panel_with_four_agents(qtbot, offload_model, tmp_path)
    panel.penalty_spin.setValue(1.3)
    panel.ngram_spin.setValue(3)
    state.propose_run_options({"compute_replicas": 1, "schedule": "rotational"}, 0)  # one replica: it samples as layers do
    assert panel.ngram_spin.isEnabled() and panel.penalty_spin.isEnabled()
    assert (panel.settings().repetition_penalty, panel.settings().no_repeat_ngram_size) == (1.3, 3)
    state.propose_run_options({"compute_replicas": 2, "schedule": "fixed"}, 3)  # staggered replicas
    for spin in (panel.penalty_spin, panel.ngram_spin):
        assert not spin.isEnabled() and UNAVAILABLE + "staggered attention offloading" in spin.toolTip()
    assert (panel.settings().repetition_penalty, panel.settings().no_repeat_ngram_size) == (1.0, 0)
    panel.offload_controls.replicas.setValue(1)
    assert not panel.ngram_spin.isEnabled()  # micro-batches alone stagger the run too
    panel.micro_batches_spin.setValue(0)
    assert panel.ngram_spin.isEnabled() and panel.settings().no_repeat_ngram_size == 3

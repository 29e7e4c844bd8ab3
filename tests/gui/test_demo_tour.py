"""The demo's tour: every technique offered with a model of its kind, layer sharding, spatial
partitioning, attention offloading and expert offloading planned from the demo cluster's measured
profile and run on its three agents from the studio, their output equal to an independent reference
(transformers' generate, one torch forward), recorded and replayed in Sessions under their names;
Compare puts two techniques' runs of the same prompts side by side (pytest-qt, real agents).

One demo cluster for the module (the three emulated devices of gui/demo_cluster.py), profiled once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gui import app as studio_app
from gui.main_window import MainWindow
from tests.gui.techniques.spatial_solving import solved
from tests.gui.widget_lifetimes import free_window

pytestmark = pytest.mark.slow

PROMPTS = ["The secret of life is", "You will", "Love is"]
MAX_NEW = 5
WAIT_MS = 240_000


@pytest.fixture(scope="module")
def tour(tmp_path_factory):
    """(window, demo, qtbot-free helpers): the demo started on DEMO_DEVICES, profiled for layers and CNNs."""
    from PySide6.QtCore import QSettings

    from gui.demo import DemoSession

    tmp = tmp_path_factory.mktemp("tour")
    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(tmp / "settings"))
    studio_app.create_app()
    window = MainWindow()
    demo = DemoSession(window.state, window=window, workspace=str(tmp / "demo.edgeshard"), workdir=str(tmp / "work"),
                       model_root=str(tmp / "models"), train=False,
                       profile_options=dict(prompt_tokens=8, batch_sizes=(1,), repeats=1, link_target_s=0.1))
    try:
        _wait(demo.ready, demo.start)
        profile = window.screens.profile
        _wait(window.state.profile_changed, profile.profile_button.click)
        profile.conv_sweep = dict(sizes=(8, 16), channels=(8,), repeats=1)  # a quick CNN profile
        _wait(window.state.spatial_fits_changed, profile.conv_button.click)
        yield window, demo
    finally:
        window.close()
        demo.stop()
        free_window(window, demo)


def _wait(signal, action, timeout_ms: int = WAIT_MS) -> None:
    """Do ``action`` and process events until ``signal`` fires (a module fixture has no qtbot)."""
    import time

    from PySide6.QtWidgets import QApplication

    fired = []
    signal.connect(lambda *args: fired.append(args))
    action()
    end = time.monotonic() + timeout_ms / 1000
    while not fired and time.monotonic() < end:
        QApplication.processEvents()
        time.sleep(0.01)
    assert fired, f"no {signal} within {timeout_ms} ms"


def test_the_demo_offers_all_five_techniques_each_with_a_model_of_its_kind(tour):
    window, _demo = tour
    models = window.state.technique_models
    assert set(models) == {"layer-sharding", "attention-offload", "expert-offload", "phase-disaggregation",
                           "spatial"}
    picker = window.screens.plan.picker
    assert sorted(picker.itemData(i) for i in range(picker.count())) == sorted(models)
    kinds = {t: json.loads((Path(p) / ("cnn.json" if t == "spatial" else "config.json")).read_text())
             for t, p in models.items()}
    assert kinds["expert-offload"]["model_type"] == "mixtral" and kinds["phase-disaggregation"]["model_type"] == "llava"
    assert kinds["layer-sharding"]["model_type"] == "llama" and kinds["spatial"]["classes"] == 10
    assert models["attention-offload"] == models["layer-sharding"] == window.state.model_path


def _tokens_of(workspace: str, run_id: int) -> dict[int, list[int]]:
    """The recorded run's generated tokens per prompt (its sequence ids)."""
    from core.sessions.store import SessionStore

    got: dict[int, list[int]] = {}
    with SessionStore(workspace) as store:
        for event in store.tokens(run_id):
            for seq, token in zip(event.sequence_ids, event.token_ids):
                got.setdefault(seq, []).append(token)
    return got


def _replays_in_sessions(window, qtbot, run_id: int) -> None:
    """Sessions lists the run under its technique's name, opens it and plays it to its end."""
    sessions = window.screens.sessions
    sessions.refresh()
    qtbot.waitUntil(lambda: run_id in sessions.run_items(), timeout=60_000)
    with qtbot.waitSignal(sessions.run_opened, timeout=60_000):
        sessions.open_run(run_id)
    sessions.set_speed(20.0)
    with qtbot.waitSignal(sessions.replay_finished, timeout=30_000):
        sessions.play()


def _live_ghosts(run, qtbot) -> tuple:
    """The predicted events the Run screen drew for its run (once its prediction worker has settled)."""
    qtbot.waitUntil(lambda: not run._predict_timer.isActive() and not run.predict_runner.is_busy(), timeout=60_000)
    return tuple(run.monitor.timeline._predicted_events)


def _in_order(events) -> list:
    """Events in one order (a recorded run's come back in arrival order)."""
    return sorted(events, key=lambda e: (e.start_s, e.device, e.kind, e.step, e.micro_batch))


def test_layer_sharding_auto_solves_the_measured_demo_agents_and_runs_from_the_studio_like_generate_replayed(
        tour, qtbot):
    from core.runs.generation import load_tokenizer
    from core.sessions.store import SessionStore
    from tests.core.hf_reference import hf_greedy_new_tokens

    window, demo = tour
    plan_screen, run = window.screens.plan, window.screens.run
    plan_screen.set_technique("layer-sharding")
    editor = plan_screen.view
    with qtbot.waitSignal(editor._solve_runner.task_finished, timeout=WAIT_MS):
        editor.solve_button.click()  # the exact solver on the Profile screen's measured profile
    plan = window.state.plan
    assert window.state.problem.profile.source == "measured"
    assert [s.device for s in plan.stages] == ["edge-a", "edge-b", "edge-c"]  # the model fits no fast device alone
    run.prompts_edit.setPlainText("\n".join(PROMPTS))
    run.max_tokens_spin.setValue(MAX_NEW)
    with qtbot.waitSignal(run.run_finished, timeout=WAIT_MS) as done:
        run.start_run()
    assert done.args == ["completed"], run.message.text()
    penalty = run.settings().repetition_penalty  # the demo's (1.30) unless the operator changed it
    model_dir = str(demo.parts.model_dir)
    tokenizer = load_tokenizer(model_dir)
    with SessionStore(window.state.workspace) as store:
        ran = store.runs()[-1]
    assert ran.status == "completed" and ran.settings.get("technique", "layer-sharding") == "layer-sharding"
    got = _tokens_of(window.state.workspace, ran.id)
    options = {"repetition_penalty": penalty} if penalty != 1.0 else {}
    for i, prompt in enumerate(PROMPTS):  # each prompt alone, unpadded: transformers' own generate
        (want,) = hf_greedy_new_tokens(model_dir, tokenizer([prompt], return_tensors="pt"), MAX_NEW, **options)
        assert tuple(got[i]) == want, prompt
    _replays_in_sessions(window, qtbot, ran.id)
    sessions = window.screens.sessions
    assert sessions.run_items()[ran.id].text(0) == f"Layer sharding #{ran.id}"
    assert sessions.monitor.timeline.lanes() == ["edge-a", "edge-b", "edge-c"]
    assert [sessions.monitor.text_of(i) for i in range(len(PROMPTS))] == \
        [run.monitor.text_of(i) for i in range(len(PROMPTS))]


def test_expert_offloading_plans_the_measured_demo_agents_and_runs_from_the_studio_like_generate_replayed(
        tour, qtbot):
    from core.runs.generation import load_tokenizer
    from core.sessions.store import SessionStore
    from core.techniques.expert_offload.activity import ExpertActivity
    from core.techniques.expert_offload.on_agents import device_memory_bytes
    from gui.techniques.expert_offload.plan_view import MEASURED, ExpertOffloadPlanView
    from tests.core.hf_reference import hf_greedy_new_tokens

    window, demo = tour
    moe = window.state.technique_models["expert-offload"]
    window.screens.plan.set_technique("expert-offload")
    view = window.screens.plan.view
    assert isinstance(view, ExpertOffloadPlanView) and view._model() == moe
    if view.measured_blocker():  # the demo's profile is of its Llama: the agents are profiled for the MoE
        assert view.profile_button.isEnabled(), view.profile_button.toolTip()
        view.profile_button.click()
        qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
    assert view.source.currentText() == MEASURED, view.subtitle.text()
    profiled = view.measured_profile()
    assert [t.device for t in profiled.times] == ["edge-a", "edge-b", "edge-c"]
    assert view.device.currentText() == "edge-a"  # the demo's source device
    problem = view.problem()
    budget = device_memory_bytes(window.state.profile, "edge-a")  # the emulated budget the Profile screen measured
    m = problem.model
    whole = m.resident_bytes + m.layers * m.experts * m.expert_bytes
    assert problem.memory_budget_bytes <= budget < whole  # the MoE does not fit edge-a whole
    view.auto_solve()
    assert view.use_for_run.isEnabled(), view.use_for_run.toolTip()
    slots = view.outcome()[0].plan.slots
    assert slots < problem.model.layers * problem.model.experts  # experts are read from storage
    view.use_for_run.click()
    plan = window.state.plan
    assert [(s.device, s.kind) for s in plan.stages] == [("edge-a", "expert-offload")]
    run = window.screens.run
    assert run.model_edit.text() == moe  # the Run screen's model follows the plan's technique
    run.prompts_edit.setPlainText("\n".join(PROMPTS[:2]))
    run.max_tokens_spin.setValue(MAX_NEW)
    with qtbot.waitSignal(run.run_finished, timeout=WAIT_MS) as done:
        run.start_run()
    assert done.args == ["completed"], run.message.text()
    run.monitor.flush()
    assert run.monitor.timeline.box_count("edge-a:storage", "io") > 0 and not run.monitor.heat_map.isHidden()
    penalty = run.settings().repetition_penalty
    tokenizer = load_tokenizer(moe)
    with SessionStore(window.state.workspace) as store:
        ran = store.runs()[-1]
        recorded = ExpertActivity()
        recorded.add([i.event for i in store.timeline(ran.id) if i.event is not None])
    assert ran.settings["technique"] == "expert-offload" and ran.status == "completed"
    got = _tokens_of(window.state.workspace, ran.id)
    for i, prompt in enumerate(PROMPTS[:2]):  # each prompt alone: transformers' own generate of the MoE
        options = {"repetition_penalty": penalty} if penalty != 1.0 else {}
        (want,) = hf_greedy_new_tokens(moe, tokenizer([prompt], return_tensors="pt"), MAX_NEW, **options)
        assert tuple(got[i]) == want, prompt
    ghosts = _live_ghosts(run, qtbot)
    _replays_in_sessions(window, qtbot, ran.id)
    sessions = window.screens.sessions
    assert sessions.run_items()[ran.id].text(0) == f"MoE expert offloading #{ran.id}"
    assert ghosts and sessions.loaded.predicted == ghosts  # the replay's prediction: the live run's ghosts
    assert "edge-a:storage" in sessions.monitor.timeline.lanes()
    assert sessions.monitor.heat_map.activity.totals() == recorded.totals() and recorded.totals()["misses"] > 0


def test_spatial_plans_the_measured_cluster_and_labels_the_digits_on_the_agents_like_one_forward(tour, qtbot):
    from core.sessions.replay import Replay
    from core.sessions.store import SessionStore
    from core.techniques.spatial.digits import label_of_file
    from core.techniques.spatial.images import load_images

    window, _demo = tour
    window.screens.plan.set_technique("spatial")
    view = window.screens.plan.view
    fits = window.state.spatial_fits
    # the fits of the three agents arrived: the view planned them by itself, with the profile's links
    assert view.source == "measured" and view.problem.gateway == "edge-a"
    assert [d.id for d in view.problem.devices] == ["edge-a", "edge-b", "edge-c"]
    assert {d.id: d.time for d in view.problem.devices} == {f.device: f.conv for f in fits.devices}
    link = next(x for x in window.state.profile.cluster.links if (x.src, x.dst) == ("edge-a", "edge-c"))
    assert view.problem.device("edge-c").bandwidth_Bps == pytest.approx(link.bandwidth_mbit_s * 1e6 / 8)
    assert view.problem.model == view.own_model and view.own_model.weights  # the trained digit CNN
    solved(qtbot, view).auto_solve()  # the fused planner on the measured figures (a 32-pixel CNN may stay on the gateway)
    assert solved(qtbot, view).plan is not None and set(view.plan.devices) <= {"edge-a", "edge-b", "edge-c"}
    view.strategy.setCurrentText("even")  # strips on all three agents
    assert len(solved(qtbot, view).plan.devices) == 3 and view.run_button.isEnabled(), view.run_button.toolTip()
    files = list(view.image_files)
    assert len(files) == 10
    view.run_button.click()
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
    assert view.run_message.isHidden(), view.run_message.text()
    shown = [view.image_table.item(r, 2).text() for r in range(view.image_table.rowCount())]
    reference = view.own_model.build().forward(load_images(files, view.own_model.image)).argmax(1).tolist()
    assert shown == [str(c) for c in reference] == [str(label_of_file(f)) for f in files]
    with SessionStore(window.state.workspace) as store:
        measured = next(r for r in store.runs() if r.kind == "measured" and r.settings.get("technique") == "spatial")
        assert measured.status == "completed" and len(store.tokens(measured.id)) == 10
        assert [t.token_ids[0] for t in store.tokens(measured.id)] == reference
        replay = Replay.from_store(store, measured.id)
        assert replay.duration_s > 0
        assert {i.event.device for i in replay.items if i.event is not None} == {"edge-a", "edge-b", "edge-c"}
        beside = store.events(next(r.id for r in store.runs(measured.session_id) if r.kind == "predicted"))
    _replays_in_sessions(window, qtbot, measured.id)
    assert beside and _in_order(window.screens.sessions.loaded.predicted) == _in_order(beside)
    from gui.screens.run_names import technique_label

    sessions = window.screens.sessions
    assert sessions.run_items()[measured.id].text(0) == f"{technique_label('spatial')} #{measured.id}"
    assert set(sessions.monitor.timeline.lanes()) >= {"edge-a", "edge-b", "edge-c"}


def test_attention_offloading_plans_the_measured_cluster_and_runs_staggered_from_the_studio_like_generate(
        tour, qtbot):
    from core.sessions.store import SessionStore
    from core.runs.generation import load_tokenizer
    from gui.techniques.attention_offload import MEASURED
    from tests.core.hf_reference import hf_greedy_new_tokens

    window, demo = tour
    window.screens.plan.set_technique("attention-offload")
    view = window.screens.plan.view
    profile = window.state.profile
    assert view.scenario.currentText() == MEASURED
    assert {d.id: d.memory_bytes for d in view.problem.devices} == {d.id: d.memory_bytes
                                                                     for d in profile.cluster.devices}
    view.auto_solve()
    # only edge-c's budget holds every layer's dense weights: the one compute replica, the others memory
    assert view.plan.compute == ("edge-c",) and set(view.plan.memory) <= {"edge-a", "edge-b"}
    assert view.plan.in_flight > 1 and "planned on the measured agents" in view.run_where.text()
    run = window.screens.run
    run.prompts_edit.setPlainText("\n".join(PROMPTS))
    run.max_tokens_spin.setValue(MAX_NEW)
    with qtbot.waitSignal(run.run_finished, timeout=WAIT_MS) as done:
        view.run_button.click()
    assert done.args == ["completed"], run.message.text()
    assert run.micro_batches_spin.value() == view.plan.in_flight  # staggered: the plan's batches in flight
    # a second replica would hold the whole dense model too: only edge-c's budget can, and the Run screen says so
    replicas = run.offload_controls.replicas
    assert replicas.maximum() == 1 and "edge-a (" in replicas.toolTip() and "edge-b (" in replicas.toolTip()
    model_dir = str(demo.parts.model_dir)
    tokenizer = load_tokenizer(model_dir)
    with SessionStore(window.state.workspace) as store:
        ran = store.runs()[-1]
        got: dict[int, list[int]] = {}
        for event in store.tokens(ran.id):
            for seq, token in zip(event.sequence_ids, event.token_ids):
                got.setdefault(seq, []).append(token)
    for i, prompt in enumerate(PROMPTS):  # each prompt alone, unpadded: transformers' own generate
        (want,) = hf_greedy_new_tokens(model_dir, tokenizer([prompt], return_tensors="pt"), MAX_NEW)
        assert tuple(got[i]) == want, prompt
    lanes = run.monitor.timeline.lanes()
    assert set(lanes) == {"edge-a", "edge-b", "edge-c"}
    assert all(run.monitor.timeline.box_count(d, "compute") > 0 for d in ("edge-c", *view.plan.memory))
    ghosts = _live_ghosts(run, qtbot)
    _replays_in_sessions(window, qtbot, ran.id)
    sessions = window.screens.sessions
    assert sessions.run_items()[ran.id].text(0) == f"Attention offloading #{ran.id}"
    assert ghosts and sessions.loaded.predicted == ghosts  # Lamina's staggering, as the Run screen drew it
    replayed = sessions.monitor.timeline
    replayed.flush()
    assert {d: replayed.box_count(d, "compute") for d in lanes} == \
        {d: run.monitor.timeline.box_count(d, "compute") for d in lanes}


def test_compare_puts_a_layer_sharding_and_an_attention_offloading_run_of_the_same_prompts_side_by_side(tour, qtbot):
    window, _demo = tour
    plan_screen, run, sessions = window.screens.plan, window.screens.run, window.screens.sessions
    prompts = PROMPTS[:2]
    plan_screen.set_technique("layer-sharding")
    editor = plan_screen.view
    with qtbot.waitSignal(editor._solve_runner.task_finished, timeout=WAIT_MS):
        editor.solve_button.click()
    run.prompts_edit.setPlainText("\n".join(prompts))
    run.max_tokens_spin.setValue(MAX_NEW)
    run.penalty_spin.setValue(1.0)  # greedy as the staggered attention-offload run (it samples without history)
    with qtbot.waitSignal(run.run_finished, timeout=WAIT_MS) as done:
        run.start_run()
    assert done.args == ["completed"], run.message.text()
    sharded = [run.monitor.text_of(i) for i in range(len(prompts))]
    plan_screen.set_technique("attention-offload")
    plan_screen.view.auto_solve()
    with qtbot.waitSignal(run.run_finished, timeout=WAIT_MS) as done:
        plan_screen.view.run_button.click()
    assert done.args == ["completed"], run.message.text()
    offloaded = [run.monitor.text_of(i) for i in range(len(prompts))]
    from core.sessions.store import SessionStore

    with SessionStore(window.state.workspace) as store:
        a, b = [r.id for r in store.runs()[-2:]]
    sessions.refresh()
    qtbot.waitUntil(lambda: {a, b} <= set(sessions.run_items()), timeout=60_000)
    items = sessions.run_items()
    assert (items[a].text(0), items[b].text(0)) == (f"Layer sharding #{a}", f"Attention offloading #{b}")
    items[a].setSelected(True)
    items[b].setSelected(True)
    with qtbot.waitSignal(sessions.runs_compared, timeout=60_000):
        sessions.compare_button.click()
    view = sessions.comparison
    assert sessions.right_stack.currentWidget() is view
    assert view.title_label.text().startswith(f"A: Layer sharding #{a}") and f"B: Attention offloading #{b}" in \
        view.title_label.text()
    assert set(view.timeline_a.lanes()) == set(view.timeline_b.lanes()) == {"edge-a", "edge-b", "edge-c"}
    assert view.timeline_a.box_count() > 0 and view.timeline_b.box_count() > 0
    assert view.table_rows()[0] == ("Technique", "Layer sharding", "Attention offloading")
    # the same prompts, each run's own text beside the other's: greedy both, the same text
    assert view.output_rows() == [(p, s, o) for p, s, o in zip(prompts, sharded, offloaded)]
    assert sharded == offloaded and all(sharded)
    view.back_button.click()


def test_epd_plans_the_demo_clusters_measured_phases_and_serves_its_pick_from_the_studio_like_llava_generate(
        tour, qtbot):
    from core.sessions.store import SessionStore
    from core.techniques.phase_disaggregation.runtime import prepare_requests, reference_tokens
    from gui.demo_cluster import DEMO_DEVICES
    from gui.techniques.phase_disaggregation.agent_run import MEASURED

    window, _demo = tour
    window.screens.plan.set_technique("phase-disaggregation")
    view = window.screens.plan.view
    llava = window.state.technique_models["phase-disaggregation"]
    assert view.model_dir == llava and view.agent_names() == list(DEMO_DEVICES)
    view.requests.setValue(4)
    view.source.setCurrentText(MEASURED)  # the measured source: nothing runs until the operator measures
    assert not view.runner.is_busy()
    view.measure_button.click()  # every phase timed on each demo agent
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
    assert view.message.isHidden(), view.message.text()
    costs = view.measured_costs
    # each agent timed for its own speeds; they are not compared here: edge-a's time is its wall time,
    # which a busy host stretched past the emulated 8x-slower edge-c's at load 18 (bench/epd_device_costs.py)
    assert [d.device for d in costs.devices] == list(DEMO_DEVICES)
    view.trials.setValue(6)
    view.auto_solve()
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
    assert view.last_problem.devices == DEMO_DEVICES and view.last_problem.costs.devices == costs.devices
    assert view.run_button.isEnabled(), view.run_button.toolTip()
    view.table.setCurrentCell(0, 0)  # the search's pick
    view.run_button.click()
    qtbot.waitUntil(lambda: not view.runner.is_busy(), timeout=WAIT_MS)
    assert view.message.isHidden(), view.message.text()
    run = view.run_tab.last
    assert run.pools == view.result.top[0].config and len(run.metrics) == 4
    # LlavaForConditionalGeneration.generate on each request's tiles and prompt, in one process
    assert run.tokens == reference_tokens(llava, prepare_requests(llava, view.last_problem.workload))
    shown = {(view.run_tab.fit_table.item(r, 0).text(), view.run_tab.fit_table.item(r, 1).text().split("/")[0])
             for r in range(view.run_tab.fit_table.rowCount())}
    assert shown == {(f.device, f.phase) for f in run.fit} and {d for d, _ in shown} <= set(run.pools.devices)
    with SessionStore(window.state.workspace) as store:
        recorded = {r.id: r for r in store.runs()}[run.run_id]
        assert recorded.kind == "measured" and recorded.settings["technique"] == "phase-disaggregation"
        assert recorded.settings["slo"]["ttft_s"] == pytest.approx(view.last_problem.slo.ttft_s)
        beside = store.events(run.predicted_id)
        computed = {e.device for e in store.events(run.run_id) if e.kind == "compute"}
    sessions = window.screens.sessions
    with qtbot.waitSignal(sessions.run_opened, timeout=WAIT_MS):
        sessions.open_run(run.run_id)
    sessions.set_speed(20.0)
    with qtbot.waitSignal(sessions.replay_finished, timeout=WAIT_MS):
        sessions.play()
    monitor = sessions.monitor
    assert beside and _in_order(sessions.loaded.predicted) == _in_order(beside)  # the pools' simulation
    assert not monitor.requests_panel.isHidden() and len(monitor.requests_panel.timeline.metrics) == 4
    assert monitor.requests_panel.figures.text().startswith(f"TTFT p50 {run.measured.ttft_p50_s * 1e3:.0f} ms")
    import re

    shown_text = monitor.text_edit.toPlainText()  # the answers, not "[335][86]…" token ids
    assert not re.search(r"\[\d+\]", shown_text) and run.texts[0].strip()[:8] in shown_text
    # every device the run recorded computing, and only pool devices: a pool's requests go to whichever of
    # its devices is free first, so a quiet run's suite once left edge-c with none of the four requests
    assert {d for d in monitor.timeline.lanes() if monitor.timeline.box_count(d, "compute") > 0} == computed
    assert computed and computed <= set(run.pools.devices)

"""The attention-offload plan view: a real PlanScreen with the technique chosen (pytest-qt)."""

from __future__ import annotations

import pytest

from core.techniques.attention_offload import planner, scenarios
from gui.techniques.attention_offload import AttentionOffloadPlanView, placement_rows
from gui.screens.plan import PlanScreen
from gui.studio_state import StudioState
from tests.agents.conftest import tiny_llama_dir, tiny_model_dirs  # noqa: F401  (the tiny checkpoints)


@pytest.fixture
def view(qtbot):
    screen = PlanScreen(StudioState())
    qtbot.addWidget(screen)
    screen.set_technique("attention-offload")
    yield screen.view
    screen.shutdown()


def test_the_view_is_offered_and_shows_the_exact_plan_of_the_papers_scenario(view):
    assert isinstance(view, AttentionOffloadPlanView)
    view.auto_solve()
    assert view.strategy.currentText() == "exact" and view.plan.memory
    assert "tokens/s per k$" in view.summary.text() and "paper" in view.summary.text()


def test_compare_lists_the_exact_search_lamina_rule_and_both_baselines(view):
    view.compare()
    assert [view.table.item(r, 0).text() for r in range(view.table.rowCount())] == [
        "exact", "lamina-rule", "homogeneous", "layer-sharding"]
    assert view.table.item(0, 5).text() == "optimal"


def test_the_placement_gives_each_memory_device_its_heads_and_compute_devices_the_dense_layers():
    p = scenarios.paper()
    plan = planner.exact(p, "throughput")
    rows = {r[0]: r for r in placement_rows(p, plan)}
    kv = sorted((rows[d] for d in plan.memory), key=lambda r: r[2])
    assert kv[0][2] == 0.0 and kv[-1][3] == 1.0 and all(a[3] == b[2] for a, b in zip(kv, kv[1:]))
    assert all(rows[d][1] == "dense" and "no KV" in rows[d][4] for d in plan.compute)
    unused = set(rows) - set(plan.memory) - set(plan.compute)
    assert all(rows[d][1] == "unused" for d in unused)


def test_a_layer_sharding_baseline_shows_contiguous_layer_ranges_covering_the_model(view):
    view.strategy.setCurrentText("layer-sharding")
    rows = [r for r in view.canvas.rows if r[1] == "layers"]
    assert rows[0][2] == 0.0 and rows[-1][3] == 1.0 and all(a[3] == b[2] for a, b in zip(rows, rows[1:]))


def test_fewer_memory_devices_change_the_plan_on_screen(view):
    view.memory_devices.setValue(1)
    devices = [r[0] for r in view.canvas.rows]
    assert [d for d in devices if d.startswith("h20")] == ["h20-0"]
    assert view.plan is not None and set(view.plan.memory) <= set(devices)


class _Agents:
    """The connected agents as the view sees them (their names)."""

    endpoints = ("c0", "m0", "m1")


def _ready_to_run(qtbot, model_dir, agents=None):
    """The Plan screen on attention offloading with the exact plan, ``agents`` (default ``_Agents``) connected
    and ``model_dir`` chosen: Run is enabled; (state, screen, view)."""
    state = StudioState()
    screen = PlanScreen(state)
    qtbot.addWidget(screen)
    screen.set_technique("attention-offload")
    screen.view.auto_solve()
    state.set_agents(agents or _Agents())
    state.set_model("tiny-llama", path=model_dir)
    return state, screen, screen.view


def test_run_on_agents_says_why_it_cannot_start_until_agents_and_a_checkpoint_are_there(view):
    view.auto_solve()
    assert not view.run_button.isEnabled() and "no agents connected" in view.run_button.toolTip()
    view.state.set_agents(_Agents())
    assert not view.run_button.isEnabled() and "model checkpoint" in view.run_button.toolTip()
    view.strategy.setCurrentText("homogeneous")
    assert "not a baseline" in view.run_blocker()


def test_run_on_agents_puts_the_split_of_the_connected_agents_in_the_state_and_asks_the_screen_to_run(
        qtbot, tiny_llama_dir):
    from agents.techniques.attention_offload.heads import DENSE_KIND

    state, screen, view = _ready_to_run(qtbot, tiny_llama_dir)
    assert view.run_button.isEnabled() and "compute: c0 · memory: m0, m1" in view.run_where.text()
    proposed = []
    state.run_options_proposed.connect(lambda options, batches: proposed.append((options, batches)))
    with qtbot.waitSignal(screen.run_requested, timeout=30_000):
        view.run_button.click()
    (stage,) = state.plan.stages
    assert (stage.device, stage.kind) == ("c0", DENSE_KIND)
    assert proposed == [({"compute_replicas": 1, "schedule": view.plan.schedule}, 0)]


def test_a_plan_with_two_compute_devices_runs_as_two_staggered_replicas_on_the_agents(qtbot, tiny_llama_dir):
    from core.techniques.attention_offload.problem import OffloadPlan

    state = StudioState()
    screen = PlanScreen(state)
    qtbot.addWidget(screen)
    screen.set_technique("attention-offload")
    view = screen.view
    state.set_agents(_Agents())
    state.set_model("tiny-llama", path=tiny_llama_dir)
    view.plan = OffloadPlan(compute=("h0", "h1"), memory=("x0", "x1"), batch=2, in_flight=3, schedule="fixed")
    view.update_run_controls()
    assert "compute: c0, m0 · memory: m1, fixed staggering of 3 batches" in view.run_where.text()
    proposed = []
    state.run_options_proposed.connect(lambda options, batches: proposed.append((options, batches)))
    with qtbot.waitSignal(screen.run_requested, timeout=30_000):
        view.run_button.click()
    assert state.plan.stages[0].device == "c0"
    assert proposed == [({"compute_replicas": 2, "schedule": "fixed"}, 3)]


def _profiled_budgets(state, budgets: dict[str, int]) -> None:
    """A profile of the connected agents whose memory budgets are ``budgets``."""
    import msgspec

    from tests.gui.problems import make_problem

    profile = make_problem().profile
    devices = tuple(msgspec.structs.replace(d, memory_bytes=budgets[d.id]) for d in profile.cluster.devices)
    state.set_profile(msgspec.structs.replace(profile, cluster=msgspec.structs.replace(profile.cluster,
                                                                                        devices=devices)))


class _Lab:
    endpoints = ("phone", "laptop", "server")


def _lab_view(qtbot, model_dir):
    """The attention-offload view with the exact plan, the _Lab agents connected and ``model_dir``
    chosen; (state, screen, view, the bytes of its dense part)."""
    from core.techniques.attention_offload.run import dense_weight_bytes

    return (*_ready_to_run(qtbot, model_dir, _Lab()), dense_weight_bytes(model_dir))


def test_run_on_agents_makes_the_agent_whose_profiled_budget_holds_the_dense_part_the_compute_agent(
        qtbot, tiny_llama_dir):
    state, screen, view, need = _lab_view(qtbot, tiny_llama_dir)
    _profiled_budgets(state, {"phone": need // 2, "laptop": need // 2, "server": 2 * need})
    assert view.run_where.text().startswith("compute: server · memory: phone, laptop")
    with qtbot.waitSignal(screen.run_requested, timeout=30_000):
        view.run_button.click()
    assert state.plan.stages[0].device == "server"


def test_when_no_agent_holds_the_dense_part_run_on_agents_says_which_budgets_and_how_much_would(
        qtbot, tiny_llama_dir):
    state, screen, view, need = _lab_view(qtbot, tiny_llama_dir)
    _profiled_budgets(state, {"phone": need // 2, "laptop": need // 3, "server": need // 4})
    assert not view.run_button.isEnabled()
    why = view.run_button.toolTip()
    assert "no connected agent can be attention offloading's compute agent" in why
    assert f"phone {need / 2 / 2**20:.1f} MiB" in why and f"at least {-(-need * 10 // 2**20) / 10:.1f} MiB" in why


def test_a_measured_profile_and_a_checkpoint_give_the_measured_cluster_re_planned_when_the_profile_changes(
        qtbot, tiny_llama_dir):
    import msgspec

    from gui.techniques.attention_offload import MEASURED
    from tests.gui.problems import make_problem

    state, screen, view, need = _lab_view(qtbot, tiny_llama_dir)
    assert view.scenario.currentText() == "paper"  # a synthetic profile is no measurement
    profile = msgspec.structs.replace(make_problem().profile, source="measured")
    state.set_profile(profile)
    assert view.scenario.currentText() == MEASURED and not view.accelerators.isEnabled()
    assert {d.id: d.memory_bytes for d in view.problem.devices} == {d.id: d.memory_bytes
                                                                     for d in profile.cluster.devices}
    view.auto_solve()
    assert set(view.plan.compute) | set(view.plan.memory) <= {"phone", "laptop", "server"}
    cluster = msgspec.structs.replace(profile.cluster, devices=tuple(
        msgspec.structs.replace(d, memory_bytes=need // 2) if d.id != "laptop" else d for d in profile.cluster.devices))
    state.set_profile(msgspec.structs.replace(profile, cluster=cluster))  # only the laptop holds the dense part now
    view.auto_solve()
    assert view.plan.compute == ("laptop",) and "planned on the measured agents" in view.run_where.text()


def test_the_run_options_offer_only_agents_whose_budget_holds_the_dense_part_as_replicas_and_say_why(qtbot):
    from core.planning.plan import ShardPlan, Stage
    from core.techniques.attention_offload import DENSE_KIND
    from gui.techniques.attention_offload import OffloadRunControls

    mib = 2**20
    plan = ShardPlan(model="m", num_units=6, stages=[Stage(device="edge-c", start=0, end=6, kind=DENSE_KIND)])
    controls = OffloadRunControls()
    qtbot.addWidget(controls)
    demo = {"edge-a": int(3.8 * mib), "edge-b": int(3.4 * mib), "edge-c": int(10.6 * mib)}
    controls.show_for(plan, ["edge-a", "edge-b", "edge-c"], demo, int(8.5 * mib))
    assert controls.replicas.maximum() == 1  # the demo: only edge-c holds a replica
    tip = controls.replicas.toolTip()
    assert "at most 1" in tip and "edge-a (3.8 MiB), edge-b (3.4 MiB)" in tip and "8.5 MiB" in tip
    # four agents, the next in order (c1) too small: the replicas are the agents that hold it
    budgets = {"c0": 10 * mib, "c1": 2 * mib, "m0": 10 * mib, "m1": 0}  # m1: not profiled, decides at load
    plan = ShardPlan(model="m", num_units=6, stages=[Stage(device="c0", start=0, end=6, kind=DENSE_KIND)])
    controls.show_for(plan, ["c0", "c1", "m0", "m1"], budgets, 9 * mib)
    assert controls.replicas.maximum() == 3
    controls.replicas.setValue(2)
    assert controls.options() == {"compute_replicas": 2, "schedule": "rotational", "compute": ["c0", "m0"],
                                  "memory": ["c1", "m1"]}
    controls.show_for(plan, ["c0", "c1", "m0", "m1"])  # no profile: any agent may be one, in order
    assert controls.replicas.maximum() == 3 and "compute" not in controls.options()


def test_the_run_screens_ghosts_are_laminas_schedule_of_the_measured_plan_not_layer_sharding_s(qtbot, tiny_llama_dir):
    """They were layer sharding's (one stage on the compute agent); now the memory agents' attention
    too, as the technique's simulator (called here on the view's problem and plan) has them."""
    import msgspec

    from core.techniques.attention_offload.simulator import simulate
    from gui.screens.run import RunPanel
    from gui.techniques.attention_probe import Same
    from tests.gui.problems import make_problem

    state, screen, view, _need = _lab_view(qtbot, tiny_llama_dir)
    state.set_profile(msgspec.structs.replace(make_problem().profile, source="measured"))
    view.auto_solve()
    run = RunPanel(state)
    qtbot.addWidget(run, before_close_func=lambda w: w.shutdown(5.0))
    run.max_tokens_spin.setValue(4)
    run.prompts_edit.setPlainText("the river\nhello there\nlove is")
    with qtbot.waitSignal(screen.run_requested, timeout=30_000):
        view.run_button.click()
    timeline = run.monitor.timeline
    qtbot.waitUntil(lambda: not run._predict_timer.isActive() and not run.predict_runner.is_busy()
                    and timeline.box_count(predicted=True) > 0, timeout=60_000)
    compute, memory = view.agent_split()
    # the run's 3 prompts over the plan's batches in flight (planned for a throughput-sized batch)
    in_flight = min(3, run.micro_batches_spin.value() or state.plan.micro_batches)
    batch = -(-3 // in_flight)
    # and their prompts' width (padded as the run pads them), not the profile's prompt length
    from core.runs.generation import load_tokenizer

    width = len(load_tokenizer(tiny_llama_dir)(["the river", "hello there", "love is"], padding=True)["input_ids"][0])
    assert width != view.problem.workload.prompt_tokens
    problem = msgspec.structs.replace(view.problem, workload=msgspec.structs.replace(view.problem.workload,
                                                                                    prompt_tokens=width))
    expected = simulate(problem, msgspec.structs.replace(view.plan, batch=batch, in_flight=in_flight),
                        generated_tokens=4).events
    assert all(timeline.box_count(device=m, kind="compute", predicted=True) > 0 for m in memory)
    assert timeline.box_count(predicted=True) == len(expected)
    assert timeline.boxes(predicted=True)["end_s"].max() == pytest.approx(max(e.end_s for e in expected))
    assert set(compute) | set(memory) >= {e.device for e in expected}


def test_a_measured_plan_s_ghosts_are_of_its_probed_memory_agents_attention(qtbot, tiny_llama_dir):
    """Run on agents predicts on the problem its probe fitted (kept per profile, checkpoint and roles):
    the memory lanes' ghosts are the probed attention, the technique's simulator on the fitted problem."""
    import msgspec

    from core.techniques.attention_offload.probe import ProbeFit
    from core.techniques.attention_offload.simulator import simulate
    from gui.screens.run import RunPanel
    from gui.techniques.attention_probe import Same
    from tests.gui.problems import make_problem

    state, screen, view, _need = _lab_view(qtbot, tiny_llama_dir)
    state.set_profile(msgspec.structs.replace(make_problem().profile, source="measured"))
    view.auto_solve()
    compute, memory = view.agent_split()
    fitted = msgspec.structs.replace(view.problem, devices=tuple(
        msgspec.structs.replace(d, frame_s=0.25) if d.id in memory else d for d in view.problem.devices))
    key = (Same(state.profile), state.model_path, tuple(compute), tuple(memory))
    view.probe.fits[key] = ProbeFit(problem=fitted, attention_s={m: 0.5 for m in memory})
    run = RunPanel(state)
    qtbot.addWidget(run, before_close_func=lambda w: w.shutdown(5.0))
    run.max_tokens_spin.setValue(3)
    run.prompts_edit.setPlainText("the river\nhello there")
    with qtbot.waitSignal(screen.run_requested, timeout=2000):
        view.run_button.click()  # the kept probe: no probe run, at once
    timeline = run.monitor.timeline
    qtbot.waitUntil(lambda: not run._predict_timer.isActive() and not run.predict_runner.is_busy()
                    and timeline.box_count(predicted=True) > 0, timeout=60_000)
    in_flight = min(2, run.micro_batches_spin.value() or state.plan.micro_batches)
    plan = msgspec.structs.replace(view.plan, batch=-(-2 // in_flight), in_flight=in_flight)
    from core.runs.generation import load_tokenizer  # the run's prompts' width, padded as the run pads them

    width = len(load_tokenizer(tiny_llama_dir)(["the river", "hello there"], padding=True)["input_ids"][0])
    fitted = msgspec.structs.replace(fitted, workload=msgspec.structs.replace(fitted.workload, prompt_tokens=width))
    expected = simulate(fitted, plan, generated_tokens=3).events
    assert timeline.boxes(predicted=True)["end_s"].max() == pytest.approx(max(e.end_s for e in expected))
    assert all(timeline.box_count(device=m, kind="compute", predicted=True) > 0 for m in memory)
    unprobed = simulate(view.problem, plan, generated_tokens=3).events  # the memory lanes' KV reads alone
    assert max(e.end_s for e in unprobed) + 0.5 < max(e.end_s for e in expected)


def test_run_on_agents_reads_the_checkpoints_geometry_without_transformers_on_the_gui_thread(
        qtbot, tiny_llama_dir, monkeypatch):
    """Pressing Run read the checkpoint through ``load_config`` (AutoConfig) on the GUI thread: the
    first time, a transformers import froze the studio (1.4-3.2 s at load 16); it is read as JSON."""
    import threading

    from transformers import AutoConfig

    from agents.techniques.attention_offload import heads

    threads = []
    real = heads.load_config
    monkeypatch.setattr(heads, "load_config", lambda model_dir: threads.append(threading.current_thread())
                        or real(model_dir))
    state, screen, view = _ready_to_run(qtbot, tiny_llama_dir)
    with qtbot.waitSignal(screen.run_requested, timeout=30_000):
        view.run_button.click()
    assert threading.main_thread() not in threads
    layers = AutoConfig.from_pretrained(tiny_llama_dir, local_files_only=True).num_hidden_layers
    assert state.plan.num_units == layers + 2  # embedding, every block, head: on the dense agent

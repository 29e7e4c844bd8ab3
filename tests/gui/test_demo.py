"""The demo: real local agents and a real small model, driven through the studio's screens."""

from __future__ import annotations

import contextlib
import os

import pytest

from agents.protocol import AgentState
from agents.zygote import ForkedAgent
from core.planning.plan import plan_from_boundaries
from gui import app as studio_app
from gui.main_window import MainWindow
from gui.screens.devices import COLUMNS

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("demo-models")


def test_demo_lists_agents_and_runs_a_plan_with_a_live_timeline(qtbot, tmp_path, model_root, monkeypatch):
    from PySide6.QtCore import QSettings

    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(tmp_path / "settings"))
    from gui.demo import DemoSession

    studio_app.create_app()
    window = MainWindow()
    qtbot.addWidget(window)
    demo = DemoSession(window.state, window=window, workspace=str(tmp_path / "demo.edgeshard"),
                       workdir=str(tmp_path / "work"), model_root=str(model_root),
                       devices=("dev-a", "dev-b"), train=False,  # names outside DEMO_DEVICE_SHAPES: unshaped
                       profile_options=dict(prompt_tokens=8, batch_sizes=(1,), repeats=1, link_target_s=0.1))
    logged: list[str] = []
    window.state.log_added.connect(lambda _level, text: logged.append(text))
    try:
        with qtbot.waitSignal(demo.ready, timeout=120_000):
            demo.start()
        # the setup worker has ended; the agents live on, and a dead one would be noticed within 6 s
        assert demo.runner.alive_threads() == []
        co = demo.parts.coordinator
        from gui.demo_cluster import DEMO_HEARTBEAT_TIMEOUT_S

        assert co.heartbeat_timeout_s == DEMO_HEARTBEAT_TIMEOUT_S  # a busy agent is not lost at once
        assert co.heartbeat_timeout_s + co.heartbeat_interval_s <= 6.0
        assert {s.state for s in co.status().values()} == {AgentState.IDLE}
        devices = window.screens.devices
        assert sorted(devices.registry.records) == ["dev-a", "dev-b"]
        assert {r.status for r in devices.registry.records.values()} == {"running"}
        assert window.connection_label.text() == "● demo cluster: 2 agents on 127.0.0.1"
        assert window.workspace_label.text() == "Workspace: demo.edgeshard"

        # profile the agents from the Profile screen, then auto-solve on the Plan screen
        profile = window.screens.profile
        assert profile.profile_button.isEnabled()
        with qtbot.waitSignal(window.state.profile_changed, timeout=120_000):
            profile.profile_button.click()
        assert sorted(t.device for t in window.state.profile.times) == ["dev-a", "dev-b"]
        assert len(window.state.profile.cluster.links) == 2
        # kept for the next launch of this very demo (same model units, devices, options, agent code)
        from core.devices.profile_cache import load_cached_profile
        from gui.demo_cluster import demo_profile_key, profile_cache_dir

        key = demo_profile_key(demo.parts.model_dir, demo.devices, demo.parts.cluster.emulation, demo.profile_options)
        assert load_cached_profile(profile_cache_dir(model_root), key).profile == window.state.profile
        assert {r.status for r in devices.registry.records.values()} == {"profiled"}
        plan_editor = window.screens.plan.view
        with qtbot.waitSignal(plan_editor._solve_runner.task_finished, timeout=60_000):
            plan_editor.solve_button.click()
        assert plan_editor.cost is not None and plan_editor.cost.feasible
        # a two-stage plan over the agents (the optimum may use one), then a real run from the Run screen
        n = window.state.profile.model.num_units
        plan_editor.push_plan(plan_from_boundaries("demo-llama", n, ["dev-a", "dev-b"], [4]), "2 stages")
        assert plan_editor.cost.feasible, plan_editor.cost.violations
        run = window.screens.run
        with qtbot.waitSignal(run.run_finished, timeout=120_000) as finished:
            assert demo.run_once(window, max_new_tokens=6)
        assert finished.args == ["completed"], run.message.text()
        figures = run.monitor.figures()
        assert figures.tokens > 0
        # every stage computed, in prefill and decode, and the text streamed
        assert {e.device for e in run.monitor.events if e.kind == "compute"} == {"dev-a", "dev-b"}
        assert {e.phase for e in run.monitor.events} == {"prefill", "decode"}
        run.monitor.timeline.flush()
        assert run.monitor.timeline.box_count("dev-b", "compute") > 0
        assert run.monitor.text_of(0) != ""
        assert os.path.exists(tmp_path / "demo.edgeshard")
        # the agents that served it were forked from one zygote: their processes, and it, end with the demo
        cluster = demo.parts.cluster
        assert all(isinstance(p.popen, ForkedAgent) for p in cluster._procs)
        pids = [p.popen.pid for p in cluster._procs] + [cluster._zygote.pid]
        assert any("forked from a zygote" in text for text in logged)
    finally:
        window.close()
        demo.stop()
    assert demo.parts.cluster is None and demo.parts.coordinator is None
    assert not any(_alive(pid) for pid in pids)


def test_a_demo_that_cannot_start_says_so_and_leaves_nothing_running(qtbot, tmp_path, monkeypatch):
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QMessageBox

    from core.errors import DeployError
    from gui import demo_model
    from gui.demo import DemoSession

    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(tmp_path / "settings"))

    def no_model(reporter, root=None):
        raise DeployError("demo", "cannot write the demo model", hint="free some disk space")

    monkeypatch.setattr(demo_model, "ensure_demo_model", no_model)
    import agents.zygote

    zygotes = []  # started before the model: the failure must end it too
    start = agents.zygote.ZygoteClient.start
    monkeypatch.setattr(agents.zygote.ZygoteClient, "start", lambda self: (zygotes.append(self), start(self))[1])
    studio_app.create_app()
    window = MainWindow()
    qtbot.addWidget(window)
    demo = DemoSession(window.state, window=window, workspace=str(tmp_path / "w.edgeshard"),
                       workdir=str(tmp_path / "work"))
    try:
        with qtbot.waitSignal(demo.failed, timeout=60_000):
            demo.start()
        box = window.findChild(QMessageBox, "errorDialog")
        assert box is not None and "cannot write the demo model" in box.text() and "free some disk space" in box.text()
        assert window.connection_label.text() == "● demo cluster failed"
        box.close()
    finally:
        window.close()
        demo.stop()
    assert demo.parts.cluster is None and demo.runner.alive_threads() == []
    assert len(zygotes) == 1 and zygotes[0].popen.poll() is not None


def _window_and_demo(qtbot, tmp_path, model_root, **kwargs):
    from PySide6.QtCore import QSettings

    from gui.demo import DemoSession

    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(tmp_path / "settings"))
    studio_app.create_app()
    window = MainWindow()
    qtbot.addWidget(window)
    demo = DemoSession(window.state, window=window, workspace=str(tmp_path / "demo.edgeshard"),
                       workdir=str(tmp_path / "work"), model_root=str(model_root), **kwargs)
    return window, demo


def test_the_demo_cluster_shards_over_all_three_and_runs_attention_offloading_with_the_same_text(qtbot, tmp_path,
                                                                                                 model_root):
    from core.errors import ShardOverBudget
    from core.runs.generation import GenerationSettings, generate
    from gui.demo import DEMO_REPETITION_PENALTY
    from gui.demo_cluster import DEMO_DEVICES

    window, demo = _window_and_demo(qtbot, tmp_path, model_root, train=False,
                                    profile_options=dict(prompt_tokens=8, batch_sizes=(1, 2), repeats=1,
                                                         link_target_s=0.1))
    try:
        with qtbot.waitSignal(demo.ready, timeout=120_000):
            demo.start()
        devices = window.screens.devices
        records = devices.registry.records
        assert "MiB budget" in records["edge-b"].detail and "slower compute" in records["edge-c"].detail
        memory = [devices.table.item(r, COLUMNS.index("Memory")).text() for r in range(devices.table.rowCount())]
        assert all(m.endswith("MiB budget (emulated)") for m in memory), memory  # where memory is shown
        # an agent refuses the whole model (its budget is a share of it), naming itself
        n = 8
        with pytest.raises(ShardOverBudget, match="edge-a"):
            demo.parts.coordinator.load(plan_from_boundaries("demo-llama", n, ["edge-a"], []),
                                        str(demo.parts.model_dir), timeout_s=60)
        with qtbot.waitSignal(window.state.profile_changed, timeout=180_000):
            window.screens.profile.profile_button.click()
        budgets = {d.id: d.memory_bytes for d in window.state.profile.cluster.devices}
        weights = window.state.profile.model.param_bytes
        assert budgets["edge-a"] > budgets["edge-b"] and budgets["edge-a"] + budgets["edge-b"] < weights
        assert budgets["edge-c"] > weights  # the slow one holds it all: attention offloading's compute agent
        plan_editor = window.screens.plan.view
        with qtbot.waitSignal(plan_editor._solve_runner.task_finished, timeout=60_000):
            plan_editor.solve_button.click()
        plan = window.state.plan
        assert plan is not None and [s.device for s in plan.stages][0] == "edge-a"
        assert sorted(plan.devices()) == sorted(DEMO_DEVICES)
        # the solved plan loads on the agents and runs pipelined: two micro-batches overlap in time
        events = []

        class Sink:
            on_event = staticmethod(events.append)
            on_tokens = staticmethod(lambda tokens: None)

        prompts = ["The secret of life is", "A wise man"]
        sharded = generate(demo.parts.coordinator, plan, str(demo.parts.model_dir), prompts,
                           GenerationSettings(max_new_tokens=4, mode="no-bubbles", micro_batches=2,
                                              repetition_penalty=DEMO_REPETITION_PENALTY), sink=Sink())
        computes = [e for e in events if e.kind == "compute"]
        busy = {(e.device, e.micro_batch): (e.start_s, e.end_s) for e in computes}
        assert {mb for _d, mb in busy} == {0, 1}
        spans = {mb: (min(e.start_s for e in computes if e.micro_batch == mb),
                      max(e.end_s for e in computes if e.micro_batch == mb)) for mb in (0, 1)}
        assert spans[1][0] < spans[0][1]  # micro-batch 1 started before micro-batch 0 finished
        # attention offloading on the same demo: Run on agents picks edge-c (its budget holds the dense part)
        # and the Run screen runs it for real, with layer sharding's text
        run = window.screens.run
        run.prompts_edit.setPlainText("\n".join(prompts))
        run.max_tokens_spin.setValue(4)
        window.screens.plan.set_technique("attention-offload")
        offload = window.screens.plan.view
        # a what-if mapped onto the agents: one replica (the measured cluster's own plan: test_demo_tour.py)
        offload.pick_source("paper")
        offload.auto_solve()
        assert offload.run_button.isEnabled(), offload.run_button.toolTip()
        assert offload.run_where.text().startswith("compute: edge-c · memory: edge-a, edge-b")
        with qtbot.waitSignal(run.run_finished, timeout=180_000) as done:
            offload.run_button.click()
        assert done.args == ["completed"], run.message.text()
        assert window.state.plan.stages[0].device == "edge-c"
        assert run.settings().repetition_penalty == DEMO_REPETITION_PENALTY  # one replica: allowed, and used
        assert [run.monitor.text_of(i) for i in range(2)] == list(sharded.texts)
    finally:
        window.close()
        demo.stop()


@contextlib.contextmanager
def _started_demo_with_log(qtbot, tmp_path, model_root):
    """A one-agent demo started on ``model_root``'s models, with the studio log collected; closed after."""
    window, demo = _window_and_demo(qtbot, tmp_path, model_root, devices=("dev-a",))
    logged: list[str] = []
    window.state.log_added.connect(lambda level, text: logged.append(f"{level}: {text}"))
    try:
        with qtbot.waitSignal(demo.ready, timeout=120_000):
            demo.start()
        yield window, demo, logged
    finally:
        window.close()
        demo.stop()


def test_without_a_trained_model_the_demo_starts_untrained_says_so_then_trains_and_switches(qtbot, tmp_path,
                                                                                           monkeypatch):
    from gui import demo_model
    from core.models.training import TrainingSettings
    from core.reporting import NullReporter

    # full priority: niced, the child can starve for minutes on a loaded test machine
    monkeypatch.setattr(demo_model, "DEMO_TRAINING", TrainingSettings(steps=6, batch=2, seq_len=16, niceness=0))
    monkeypatch.setattr(demo_model, "DEMO_ENOUGH_STEPS", 6)  # one round is enough
    root = tmp_path / "models"
    with _started_demo_with_log(qtbot, tmp_path, root) as (window, demo, logged):
        assert window.state.model_path == str(root / "demo-llama")  # at once, with the untrained model
        assert any(line.startswith("warning: demo model: UNTRAINED") for line in logged)
        assert demo.training_bar is not None
        with qtbot.waitSignal(demo.trained, timeout=180_000) as trained:
            pass
        assert trained.args == [str(root / "demo-llama-trained")]
        assert window.state.model_path == str(root / "demo-llama-trained")
        assert demo.training_bar is None
    # the next launch uses the trained model at once
    assert demo_model.ensure_demo_model(NullReporter(), root) == root / "demo-llama-trained"


def test_the_demo_window_opened_as_the_cli_does_starts_agents_first_and_attaches_them(qtbot, tmp_path, model_root):
    """``edgeshard studio --demo`` starts the agents before building the window (their start-up
    overlaps it); once ready the window shows them as any demo does."""
    from PySide6.QtCore import QSettings

    from gui.launch import open_demo_window

    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(tmp_path / "settings"))
    studio_app.create_app()
    window, demo = open_demo_window(str(tmp_path / "demo.edgeshard"), workdir=str(tmp_path / "work"),
                                    model_root=str(model_root), devices=("dev-a", "dev-b"), train=False)
    qtbot.addWidget(window)
    try:
        assert demo.runner.is_busy()  # started before the window was built
        assert demo.window is window and window.state is demo.state
        with qtbot.waitSignal(demo.ready, timeout=120_000):
            pass
        # the agents were forked from the zygote started first thing, before the GUI's imports
        zygote = demo.parts.cluster._zygote
        assert zygote is not None and zygote.cwd == str(tmp_path / "work" / "cluster")
        times = demo.parts.phases
        assert times["zygote_started"] < times["setup_started"] < times["model_ready"] < times["agents_up"]
        assert times["zygote_ready"] < times["agents_up"] < times["agents_answering"] < times["attached"]
        assert sorted(window.screens.devices.registry.records) == ["dev-a", "dev-b"]
        assert window.connection_label.text() == "● demo cluster: 2 agents on 127.0.0.1"
        assert {r.status for r in window.screens.devices.registry.records.values()} == {"running"}
        assert demo.agents_bar is None
        from gui.demo import DEMO_PROMPTS, DEMO_REPETITION_PENALTY

        assert window.screens.run.prompts_edit.toPlainText() == "\n".join(DEMO_PROMPTS)  # openings it learnt
        assert window.screens.run.settings().repetition_penalty == DEMO_REPETITION_PENALTY  # its text does not loop
        settings = window.screens.run.settings()  # pipelined: the micro-batches overlap on the timeline
        assert (settings.mode, settings.micro_batches) == ("no-bubbles", 2)
    finally:
        window.close()
        demo.stop()


def test_the_demo_window_is_usable_before_its_agents_are_up_and_lists_them_as_starting(qtbot, tmp_path, model_root):
    """The window does not wait for the agents (each imports torch): it opens at once with the
    agents listed as starting and their progress in the status bar."""
    from PySide6.QtCore import QSettings

    from gui.launch import open_demo_window

    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(tmp_path / "settings"))
    window, demo = open_demo_window(str(tmp_path / "demo.edgeshard"), workdir=str(tmp_path / "work"),
                                    model_root=str(model_root), devices=("dev-a", "dev-b"), train=False)
    qtbot.addWidget(window)
    try:
        # nothing from the setup worker is delivered before the event loop runs: this is the first look
        records = window.screens.devices.registry.records
        assert sorted(records) == ["dev-a", "dev-b"] and {r.status for r in records.values()} == {"starting"}
        assert demo.agents_bar is not None and demo.agents_bar.format() == "demo agents %v/%m up"
        assert (demo.agents_bar.value(), demo.agents_bar.maximum()) == (0, 2)
        up: list[tuple[str, str, int]] = []
        demo.runner.partial_result_reported.connect(
            lambda _t, device: up.append((device, window.screens.devices.registry.records[device].detail,
                                          demo.agents_bar.value())))
        with qtbot.waitSignal(demo.ready, timeout=120_000):
            pass
        assert up == [("dev-a", "agent up, attaching", 1), ("dev-b", "agent up, attaching", 2)]  # as each came up
        records = window.screens.devices.registry.records
        assert demo.agents_bar is None and {r.status for r in records.values()} == {"running"}
    finally:
        window.close()
        demo.stop()


def test_a_demo_model_cached_with_another_recipe_is_not_reused(tmp_path):
    """A checkpoint an older studio cached (another size) would not match the trained one's units."""
    import json

    from core.models.checkpoints import build_config
    from core.reporting import NullReporter
    from gui.demo_model import demo_recipe, ensure_demo_model, has_trained_model, holds_demo_recipe, trained_model_dir

    trained = trained_model_dir(tmp_path)
    trained.mkdir(parents=True)
    (trained / "model.safetensors").write_bytes(b"")
    (trained / "training.json").write_text("{}")
    build_config(demo_recipe()).to_json_file(str(trained / "config.json"))
    assert holds_demo_recipe(trained) and has_trained_model(tmp_path)
    config = json.loads((trained / "config.json").read_text())
    (trained / "config.json").write_text(json.dumps(dict(config, hidden_size=192)))
    assert not holds_demo_recipe(trained) and not has_trained_model(tmp_path)
    assert ensure_demo_model(NullReporter(), tmp_path) == tmp_path / "demo-llama"  # the untrained one, made anew


def test_a_trained_model_cut_short_by_a_busy_machine_is_used_and_its_training_continues(qtbot, tmp_path,
                                                                                       monkeypatch):
    from gui import demo_model
    from core.models.training import TrainingSettings, fortune_lines, train_model, trained_steps

    short = TrainingSettings(steps=3, batch=2, seq_len=16, niceness=0, threads=1)
    root = tmp_path / "models"
    cached = train_model(demo_model.demo_recipe(), fortune_lines()[:300], demo_model.trained_model_dir(root),
                         settings=short)
    monkeypatch.setattr(demo_model, "DEMO_ENOUGH_STEPS", 6)  # the one round continued from the 3 steps is enough
    assert demo_model.needs_more_training(root)
    monkeypatch.setattr(demo_model, "DEMO_TRAINING", short)
    with _started_demo_with_log(qtbot, tmp_path, root) as (window, demo, logged):
        assert window.state.model_path == str(cached)  # the short-trained model at once, not the untrained one
        assert any(line.startswith("warning: demo model: trained for only 3 steps") for line in logged)
        with qtbot.waitSignal(demo.trained, timeout=180_000):
            pass
        assert trained_steps(cached) == 6  # continued from its 3 steps, not started again


PROFILE_OPTIONS = dict(prompt_tokens=8, batch_sizes=(1,), repeats=1, link_target_s=0.1)


def _demo_config(model_root, into):
    """A folder holding the demo model's config.json (what a profile's key reads of the model)."""
    import shutil

    from core.reporting import NullReporter
    from gui.demo_model import ensure_demo_model

    into.mkdir(parents=True, exist_ok=True)
    shutil.copy(ensure_demo_model(NullReporter(), model_root) / "config.json", into / "config.json")
    return into


def test_a_profile_measured_on_the_demo_s_agents_is_kept_for_the_next_launch(tmp_path, model_root):
    from types import SimpleNamespace

    from core.devices.profile_cache import load_cached_profile
    from core.planning.scenarios import random_problem
    from gui.demo import DemoSession
    from gui.demo_cluster import demo_emulation, demo_profile_key, profile_cache_dir
    from gui.studio_state import StudioState

    model_dir = _demo_config(model_root, tmp_path / "root" / "m")
    demo = DemoSession(StudioState(), workdir=str(tmp_path / "work"), devices=("d0", "d1"),
                       model_root=str(tmp_path / "root"), profile_options=PROFILE_OPTIONS, train=False)
    demo.parts.cluster = SimpleNamespace(emulation=demo_emulation(demo.devices, model_dir))
    key = demo_profile_key(model_dir, demo.devices, demo.parts.cluster.emulation, PROFILE_OPTIONS)
    measured = random_problem(1, devices=2).profile  # devices d0, d1
    demo._keep_profile(measured, str(model_dir))
    assert load_cached_profile(profile_cache_dir(tmp_path / "root"), key).profile == measured
    demo._keep_profile(random_problem(2, devices=3).profile, str(model_dir))  # not the demo's agents (a Connect)
    assert load_cached_profile(profile_cache_dir(tmp_path / "root"), key).profile == measured


def test_a_profile_kept_from_an_earlier_launch_is_offered_when_ready_saying_when(qtbot, tmp_path, model_root):
    """The second launch need not profile before it can plan: the kept profile is the studio's,
    and the Profile screen says when it was measured and that Profile cluster measures again
    (one click), on agents forked with the model code imported (the first Start waits for no import)."""
    from PySide6.QtCore import QSettings

    from core.devices.profile_cache import save_cached_profile
    from core.planning.scenarios import random_problem
    from core.reporting import NullReporter
    from gui.demo import DemoSession
    from gui.demo_cluster import demo_emulation, demo_profile_key, profile_cache_dir
    from gui.demo_model import ensure_demo_model

    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(tmp_path / "settings"))
    devices = ("d0", "d1")
    model_dir = ensure_demo_model(NullReporter(), model_root)
    kept = random_problem(1, devices=2).profile
    key = demo_profile_key(model_dir, devices, demo_emulation(devices, model_dir), PROFILE_OPTIONS)
    save_cached_profile(profile_cache_dir(model_root), key, kept)
    studio_app.create_app()
    window = MainWindow()
    qtbot.addWidget(window)
    demo = DemoSession(window.state, window=window, workspace=str(tmp_path / "demo.edgeshard"),
                       workdir=str(tmp_path / "work"), model_root=str(model_root), devices=devices, train=False,
                       profile_options=PROFILE_OPTIONS)
    try:
        assert window.state.profile is None
        with qtbot.waitSignal(demo.ready, timeout=120_000):
            demo.start()
        assert window.state.profile.times == kept.times and window.state.profile.model == kept.model
        text = window.screens.profile.workload_label.text()
        assert "profile from " in text and "Profile cluster re-profiles" in text
        # the first Start need not wait for each agent's own import of the model code: the zygote
        # imported it before forking them, kept profile or not; profiling again works on them
        assert demo.parts.cluster._zygote.report["model_code_imported"]
        assert "imported torch and transformers once" in demo.parts.cluster.launch_note
        with qtbot.waitSignal(window.state.profile_changed, timeout=120_000):
            window.screens.profile.profile_button.click()
        assert sorted(t.device for t in window.state.profile.times) == ["d0", "d1"]
        assert "profile from" not in window.state.profile.notes
    finally:
        window.close()
        demo.stop()


def _fake_training(monkeypatch, gains):
    """``train_demo_model`` replaced by one that adds ``gains[i]`` steps to training.json in round i
    (no process, no torch); returns the list of each round's ``resume``."""
    import json

    from gui import demo_model
    from core.models.training import trained_steps

    rounds: list[bool] = []

    def fake(reporter, root=None, resume=False):
        out = demo_model.trained_model_dir(root)
        out.mkdir(parents=True, exist_ok=True)
        before = trained_steps(out) if resume else 0
        (out / "training.json").write_text(json.dumps({"steps": before + gains[len(rounds)]}))
        rounds.append(resume)
        return out

    monkeypatch.setattr(demo_model, "train_demo_model", fake)
    return rounds


def _demo_without_agents(qtbot, tmp_path):
    from gui.demo import DemoSession

    studio_app.create_app()
    window = MainWindow()
    qtbot.addWidget(window)
    demo = DemoSession(window.state, window=window, workspace=str(tmp_path / "demo.edgeshard"),
                       workdir=str(tmp_path / "work"), model_root=str(tmp_path / "models"))
    logged: list[str] = []
    window.state.log_added.connect(lambda level, text: logged.append(f"{level}: {text}"))
    return window, demo, logged


def test_a_training_round_cut_short_by_a_busy_machine_goes_on_in_the_same_session_until_enough_steps(
        qtbot, tmp_path, monkeypatch):
    """A first launch on a busy machine trained 34 of 500 steps in its budget; the model then
    answered "." and stayed so until the studio was started again. Now training continues while
    the studio is open, each round's model used by the next run."""
    from gui import demo_model
    from core.models.training import trained_steps

    monkeypatch.setattr(demo_model, "DEMO_ENOUGH_STEPS", 7)
    rounds = _fake_training(monkeypatch, gains=[3, 3, 3, 3])
    window, demo, logged = _demo_without_agents(qtbot, tmp_path)
    trained: list[str] = []
    demo.trained.connect(trained.append)
    try:
        demo._start_training()
        qtbot.waitUntil(lambda: len(trained) == 3 and not demo.trainer.is_busy(), timeout=60_000)
        qtbot.wait(50)
        assert rounds == [False, True, True]  # 3, 6, then 9 >= 7 steps: no fourth round
        assert trained_steps(demo_model.trained_model_dir(tmp_path / "models")) == 9
        assert window.state.model_path == trained[-1]
        assert sum("trained for 3 of 7 steps so far" in line for line in logged) == 1
        assert demo.training_bar is None
    finally:
        window.close()
        demo.stop()


def test_a_training_round_that_added_no_steps_does_not_start_another(qtbot, tmp_path, monkeypatch):
    from gui import demo_model

    monkeypatch.setattr(demo_model, "DEMO_ENOUGH_STEPS", 500)
    rounds = _fake_training(monkeypatch, gains=[3, 0, 0])
    window, demo, _logged = _demo_without_agents(qtbot, tmp_path)
    try:
        demo._start_training()
        qtbot.waitUntil(lambda: len(rounds) == 2 and not demo.trainer.is_busy(), timeout=60_000)
        qtbot.wait(50)
        assert rounds == [False, True] and demo.training_bar is None
    finally:
        window.close()
        demo.stop()


def test_the_training_bar_reads_0_percent_before_the_first_progress_report(qtbot, tmp_path, monkeypatch):
    """The tokenizer and the first steps took ~50 s on a busy machine before the first report:
    the bar was blank meanwhile."""
    import threading

    from gui import demo_model

    release = threading.Event()

    def slow(reporter, root=None, resume=False):
        release.wait(10)
        raise RuntimeError("not trained")

    monkeypatch.setattr(demo_model, "train_demo_model", slow)
    window, demo, _logged = _demo_without_agents(qtbot, tmp_path)
    try:
        demo._start_training()
        assert demo.training_bar.text() == "training the demo model 0%"
    finally:
        release.set()
        window.close()
        demo.stop()

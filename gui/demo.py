"""``edgeshard studio --demo``: a local cluster of agents and a small model, ready to use.

Setup runs in a worker: the demo checkpoint, agents as local processes from
``core.devices.local_cluster`` (started in parallel, no root), and a ``Coordinator``
connected to them. Then the studio is wired to it: the Devices screen lists the agents, the
Profile screen can measure them, the Run screen runs on them, and runs are recorded in the
demo workspace. ``stop()`` ends every process it started. The cluster and its start are in
``gui.demo_cluster``, the model and its training in ``gui.demo_model``.

**A demo that shards.** The agents emulate three different edge devices
(agents/emulation.py): each has a memory budget it enforces (a share of the model's
weights), a compute slowdown and its own link. The two fast ones (edge-a, the source, and
edge-b) together cannot hold the model; edge-c can hold all of it but computes 8× slower,
so auto-solve gives it as little as it can and uses all three devices (the cost model
prices a two-stage plan on edge-a and edge-c about a third slower), the strategies in
Compare differ, and a pipelined run overlaps micro-batches on the timeline.

**Attention offloading runs on it too**: its compute agent holds every layer's dense
weights (the whole model but no KV cache), which only edge-c's budget allows; the Plan
screen's *Run on agents* picks edge-c from the profiled budgets, and edge-a and edge-b hold
the KV cache and attention.

**A demo model that speaks.** The model is trained briefly on English quotations
(Debian's ``fortunes``, core/models/training.py) and shipped in the repository
(``resources/demo_models``), so the first launch's text reads as phrases at once. Without the
shipped one (or with a ``model_root`` of its own, as tests use) it is trained at first use, in a
child process, and cached in the user's data folder; until then the demo starts at once with
the untrained checkpoint of the same recipe (same units and sizes, so a profile or plan stays
valid when the trained one replaces it) and says so.

**A tour of five techniques.** The studio state's ``technique_models`` give every technique a
model of its kind (``demo_model.demo_checkpoints``: the Llama, a small MoE and a small Llava
trained on the same text, a digit CNN), so the Plan screen's picker offers all five on the same
three agents, and each plans from their measured profile and runs on them.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from core.devices.registry import DeviceRecord
from gui import demo_model
from gui.demo_cluster import (DEMO_DEVICES, DEMO_LINK_LATENCY_MS, DEMO_PROFILE_OPTIONS, DemoParts, LocalAgentControl,
                              demo_profile_key, demo_shape, profile_cache_dir, setup_demo)
from gui.studio_state import StudioState
from gui.workers import TaskRunner

DEMO_PROMPTS = ("The secret of life is", "You will")
"""Openings of the quotations it learnt ("You will" opens 77 of them, the third most common). At 713
training steps, greedy with DEMO_REPETITION_PENALTY: "The secret of life is to be." and "You will be
a man of the world."; the earlier "A wise man once said" gave ", and a good thing as if you can't get
out of them." (bench/demo_text.py prints these)."""
DEMO_REPETITION_PENALTY = 1.3
"""The Run screen's repetition penalty in the demo (HF's; the Run screen's default is off): the
small demo model's greedy text loops without one ("not the man who -- not the man who")."""
DEMO_RUN_MODE = ("no-bubbles", 2)
"""The Run screen's mode and micro-batches in the demo: the two prompts as two micro-batches
that overlap on the timeline (the screen's default, sequential with the plan's one micro-batch,
showed one box at a time, the pipeline never full)."""
DEMO_MENU_STEPS = (("Devices", "Profile cluster"), ("Plan", "Auto-solve"), ("Run", "Start"))
"""The hint the demo logs when ready: menu paths that exist in the window (a test checks them)."""

def warm_run_path(model_dir: str) -> threading.Thread:
    """Read the model's tokenizer for the first run, on a daemon thread, from the moment the demo is
    ready (while the presenter profiles). Through ``tokenizers`` alone (``core.runs.run_tokenizer``):
    0.06 s of CPU where transformers' took 3.9 s (it imports torch), which the agents being profiled
    on the same cores lost. Not earlier than ready: started once the window was painted, transformers'
    import competed with the agents' start (ready 9.2 -> 13.7 s at load 10-13). A run started before
    it ends waits on the same import lock, never imports twice."""
    def warm() -> None:
        from core.runs.generation import load_run_tokenizer

        try:
            load_run_tokenizer(model_dir)
        except Exception:  # noqa: BLE001 — only a warm-up: the run says what is wrong with the model
            pass

    thread = threading.Thread(target=warm, name="warm-run-path", daemon=True)
    thread.start()
    return thread


class DemoSession(QObject):
    ready = Signal()
    failed = Signal(str)
    trained = Signal(str)
    """The trained demo model is ready at this path (and is now the studio's model)."""

    def __init__(self, state: StudioState, window=None, workspace: str | None = None, workdir: str | None = None,
                 devices=DEMO_DEVICES, model_root: str | None = None, profile_options: dict | None = None,
                 train: bool = True, zygote=None, own_workdir: bool = False, parent: QObject | None = None) -> None:
        """``zygote``: the agents' fork server, already started in ``workdir/cluster``
        (``agents.zygote.start_early_zygote``), which the demo then owns; ``own_workdir``: remove
        the given ``workdir`` when stopped (as the one it makes when none is given)."""
        super().__init__(parent)
        self.profile_options = profile_options or dict(DEMO_PROFILE_OPTIONS)
        """Keyword arguments for ``core.devices.profiling.profile_cluster`` (a quick profile by default)."""
        self.state = state
        self.window = window
        self.devices = tuple(devices)
        self.model_root = Path(model_root) if model_root else None
        self._own_workdir = workdir is None or own_workdir
        self.parts = DemoParts(workdir=Path(workdir or tempfile.mkdtemp(prefix="edgeshard-demo-")), zygote=zygote)
        self.workspace = workspace or str(demo_model.ensure_dir(demo_model.cache_dir()) / "demo.edgeshard")
        self.runner = TaskRunner(self, name="demo")
        self.runner.task_finished.connect(self._on_setup_finished)
        self.runner.task_failed.connect(self._on_setup_failed)
        self.runner.status_reported.connect(lambda _t, s: self.state.log(f"demo: {s}"))
        self.runner.partial_result_reported.connect(self._on_agent_up)
        self.agents_bar = None
        """The status bar's "agents n/3" while the demo's agents start (the window is usable meanwhile)."""
        self._ready = False
        self.error = ""
        self._run_done = threading.Event()
        self._stopped = False
        self.train = train
        """Train the demo model in the background when no trained one is cached."""
        self.trainer = TaskRunner(self, name="demo-training")
        self.trainer.task_finished.connect(self._on_training_finished)
        self.trainer.task_failed.connect(self._on_training_failed)
        self.trainer.status_reported.connect(lambda _t, s: self.state.log(f"demo model: {s}"))
        self.trainer.progress_reported.connect(self._on_training_progress)
        self.training_bar = None
        self._steps_before_training = 0
        """The cached model's steps when the current training round started (a round that added
        none does not start another)."""

    # lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.state.set_connection("starting the demo cluster…")
        self.state.set_workspace(self.workspace)
        self.runner.start(setup_demo, self.parts, self.devices, self.model_root, self.profile_options)

    def show_starting(self, window) -> None:
        """The window is up before the agents (each imports torch, seconds): list them as
        starting on the Devices screen and show their progress in the status bar, so the
        window is usable at once and says what it is waiting for."""
        from PySide6.QtWidgets import QProgressBar

        self.window = window
        if self._ready or self.error:
            return
        window.screens.devices.upsert_many([DeviceRecord(id=device, address="127.0.0.1", ssh=False, status="starting",
                                                         origin="local cluster", detail="demo agent starting")
                                            for device in self.devices])
        bar = self.agents_bar = QProgressBar()
        bar.setObjectName("demoAgentsBar")
        bar.setRange(0, len(self.devices))
        bar.setValue(0)
        bar.setFormat("demo agents %v/%m up")
        bar.setToolTip("The demo's agents are starting (each loads PyTorch); the planning screens work meanwhile")
        bar.setMaximumWidth(200)
        window.statusBar().addPermanentWidget(bar)

    def _on_agent_up(self, _task: int, device) -> None:
        if self.agents_bar is not None:
            self.agents_bar.setValue(self.agents_bar.value() + 1)
        if self.window is not None:
            self.window.screens.devices.set_status(str(device), "starting", "agent up, attaching")

    def _drop_agents_bar(self) -> None:
        if self.agents_bar is not None:
            self.agents_bar.hide()
            self.agents_bar.deleteLater()
            self.agents_bar = None

    def is_ready(self) -> bool:
        return self._ready or bool(self.error)

    def describe(self) -> str:
        return self.error or ("ready" if self._ready else "starting")

    def _on_setup_finished(self, _task: int, parts: DemoParts) -> None:
        self._drop_agents_bar()
        st = self.state
        st.set_model(demo_model.DEMO_MODEL_NAME, path=str(parts.model_dir))
        st.set_technique_models(demo_model.demo_checkpoints(parts.model_dir))  # the tour: a model per technique
        st.set_connection(f"demo cluster: {len(self.devices)} agents on 127.0.0.1")
        if self.window is not None:
            from gui.connection.attach import attach

            emulation = parts.cluster.emulation
            detail = {d: f"emulates {emulation[d].describe()}, link {demo_shape(d).link_mbit:.0f} Mbit/s + "
                         f"{DEMO_LINK_LATENCY_MS:.0f} ms" for d in self.devices}
            attach(
                self.window, parts.coordinator, parts.statuses or {}, origin="local cluster",
                detail=detail, emulated_budgets={d: emulation[d].memory_budget_bytes for d in self.devices},
                profile_options=self.profile_options, model_name=demo_model.DEMO_MODEL_NAME,
                agent_control=LocalAgentControl(parts), on_profiled=self._keep_profile,
            )
            from gui.screens.run import DEFAULT_PROMPTS

            run = self.window.screens.run
            if run.prompts_edit.toPlainText() == "\n".join(DEFAULT_PROMPTS):  # not the operator's own
                run.prompts_edit.setPlainText("\n".join(DEMO_PROMPTS))  # openings like the quotations it learnt
            if run.penalty_spin.value() == 1.0:  # off: not the operator's own choice
                run.penalty_spin.setValue(DEMO_REPETITION_PENALTY)
            if run.mode_combo.currentText() == "sequential" and run.micro_batches_spin.value() == 0:  # defaults
                run.mode_combo.setCurrentText(DEMO_RUN_MODE[0])
                run.micro_batches_spin.setValue(DEMO_RUN_MODE[1])
        if parts.kept_profile is not None:
            self._use_kept_profile(parts.kept_profile)
        warm_run_path(str(parts.model_dir))
        parts.mark("attached")
        st.log("demo ready: " + ", then ".join(" ▸ ".join(step) for step in DEMO_MENU_STEPS))
        if demo_model.needs_more_training(self.model_root):  # a cached trained model, cut short
            from core.models.training import trained_steps

            steps = trained_steps(demo_model.trained_model_dir(self.model_root))
            st.log(f"demo model: trained for only {steps} steps (the machine was busy), so its text is still "
                   "rough" + ("; training continues from it now (progress in the status bar), the demo switches "
                              "to it when done" if self.train else ""), "warning")
            if self.train:
                self._start_training(resume=True)
        elif demo_model.has_trained_model(self.model_root):
            st.log("demo model: trained on English quotations (Debian fortunes); generations read as phrases")
        else:
            st.log("demo model: UNTRAINED (random weights) — its text is gibberish"
                   + ("; training it on English quotations now (about 3 minutes, progress in the status bar); "
                      "the demo switches to it when done" if self.train else ""), "warning")
            if self.train:
                self._start_training()
        self._ready = True
        self.ready.emit()

    # the kept profile ------------------------------------------------------------------------
    def _use_kept_profile(self, kept) -> None:
        """Offer the profile an earlier launch measured for this very demo, saying when."""
        from msgspec.structs import replace

        from core.devices.profile_cache import describe_age

        when = describe_age(kept.measured_at)
        note = (f"profile from {when}, kept from an earlier launch (same model units, devices and agent code on "
                "this machine): Profile cluster re-profiles")
        self.state.set_profile(replace(kept.profile, notes="; ".join(n for n in (kept.profile.notes, note) if n)))
        self.state.log(f"demo: {note}")

    def _keep_profile(self, profile, model_dir: str) -> None:
        """Worker thread, after a profile of the demo's agents: keep it for the next launch."""
        from core.devices.profile_cache import save_cached_profile

        if self.parts.cluster is None or sorted(t.device for t in profile.times) != sorted(self.devices):
            return  # not this demo's agents (a Connect replaced them)
        key = demo_profile_key(Path(model_dir), self.devices, self.parts.cluster.emulation, self.profile_options)
        try:
            save_cached_profile(profile_cache_dir(self.model_root), key, profile)
        except OSError as err:  # a full disk must not fail the profile the operator asked for
            self.state.log(f"demo: could not keep the profile for the next launch ({err.strerror or err})", "warning")

    # the trained model -----------------------------------------------------------------------
    def _start_training(self, resume: bool = False) -> None:
        from core.models.training import trained_steps

        self._steps_before_training = trained_steps(demo_model.trained_model_dir(self.model_root)) if resume else 0
        if self.window is not None and self.training_bar is None:
            from PySide6.QtWidgets import QProgressBar

            bar = self.training_bar = QProgressBar()
            bar.setObjectName("demoTrainingBar")
            bar.setFormat("training the demo model %p%")
            bar.setToolTip("The demo model is being trained on English quotations in a separate process")
            bar.setMaximumWidth(240)
            self.window.statusBar().addPermanentWidget(bar)
        if self.training_bar is not None:
            # "0%" from the start of each round: a bar without a value is blank, and the tokenizer and
            # the first steps took ~50 s on a busy machine before the first progress report
            self.training_bar.setRange(0, 1000)
            self.training_bar.setValue(0)
        self.trainer.start(demo_model.train_demo_model, self.model_root, resume)

    def _continue_training(self) -> None:
        if not self._stopped:
            self._start_training(resume=True)

    def _on_training_progress(self, _task: int, done: float, total: float) -> None:
        if self.training_bar is not None and total > 0:
            self.training_bar.setRange(0, 1000)
            self.training_bar.setValue(int(1000 * done / total))

    def _drop_training_bar(self) -> None:
        if self.training_bar is not None:
            self.training_bar.hide()
            self.training_bar.deleteLater()
            self.training_bar = None

    def _on_training_finished(self, _task: int, path) -> None:
        from core.models.training import trained_steps

        self.parts.model_dir = Path(path)
        self.state.set_model(demo_model.DEMO_MODEL_NAME, path=str(path))
        self.state.set_technique_models(demo_model.demo_checkpoints(path))
        if self.window is not None:
            self.window.screens.run.model_edit.setText(str(path))
        steps = trained_steps(path)
        if self.train and not self._stopped and self._steps_before_training < steps < demo_model.DEMO_ENOUGH_STEPS:
            # a busy machine ended the round short: training goes on now, while the studio is open (not
            # only at the next launch), and each round's better model is used by the next run
            self.state.log(f"demo model: trained for {steps} of {demo_model.DEMO_ENOUGH_STEPS} steps so far (the "
                           "machine is busy), so its text is still rough; the next run uses it, and training continues",
                           "warning")
            self.trained.emit(str(path))
            from PySide6.QtCore import QTimer

            QTimer.singleShot(0, self._continue_training)  # after the runner has finished this round
            return
        self._drop_training_bar()
        self.state.log(f"demo model: trained ({path}, {steps} steps); the next run uses it — same units, the "
                       "profile and plan still hold")
        self.trained.emit(str(path))

    def _on_training_failed(self, _task: int, message: str) -> None:
        self._drop_training_bar()
        self.state.log(f"demo model: training failed, staying with the untrained model: {message}", "warning")

    def _on_setup_failed(self, _task: int, message: str) -> None:
        self._drop_agents_bar()
        self.error = message
        self.state.set_connection("demo cluster failed")
        self.state.log(f"demo could not start: {message}", "error")
        self.failed.emit(message)
        self._cleanup()
        if self.window is not None:
            for device in self.devices:  # the rows show_starting added
                self.window.screens.devices.set_status(device, "offline", "the demo cluster could not start")
            from gui.widgets import show_error

            show_error(self.window, "The demo cluster could not start", message,
                       "The planning screens still work with a loaded profile (File ▸ Load profile…). "
                       "To run models, start agents with `edgeshard cluster local` and use File ▸ Connect to agents….")

    # scripted use (screenshots, tests) --------------------------------------------------------
    def run_once(self, window=None, prompts=DEMO_PROMPTS, max_new_tokens: int = 12) -> bool:
        """Start a run on the Run screen with the demo prompts (as a user would)."""
        target = window or self.window
        if target is None:
            return False
        run = target.screens.run
        run.prompts_edit.setPlainText("\n".join(prompts))
        run.max_tokens_spin.setValue(max_new_tokens)
        self._run_done.clear()
        run.run_finished.connect(lambda *_: self._run_done.set())
        run.start_run()
        return True

    def run_finished(self) -> bool:
        return self._run_done.is_set()

    def stop(self) -> None:
        """End every process and thread the demo started (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        if self.parts.coordinator is not None:
            if self.state.agents is self.parts.coordinator:
                self.state.set_agents(None)
            self.parts.coordinator.close()
            self.parts.coordinator = None
        self.trainer.shutdown(timeout_s=5.0)  # cancelling kills the training process at once
        self.runner.shutdown(timeout_s=60.0)
        self._cleanup()

    def _cleanup(self) -> None:
        p = self.parts
        if p.zygote is not None:  # setup failed before the cluster took it over
            p.zygote.close()
            p.zygote = None
        if p.coordinator is not None:
            try:
                p.coordinator.close()
            finally:
                p.coordinator = None
        if p.cluster is not None:
            try:
                p.cluster.stop()
            finally:
                p.cluster = None
        if self._own_workdir and self._stopped:
            shutil.rmtree(p.workdir, ignore_errors=True)

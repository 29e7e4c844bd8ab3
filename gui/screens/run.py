"""The Run screen: settings, Start/Stop, and the live run (timeline, figures, text).

A run is long, blocking work, so it runs on a ``TaskRunner`` worker thread; the backend's
events and tokens cross into Qt only through the ``EventBridge`` (batched, queued), and
the same callbacks feed a ``RunRecorder`` so the workspace keeps exactly what was seen
live (the Sessions screen replays it). Stop cancels the worker's reporter and asks the
backend to stop at once; the panel never waits for the worker on the GUI thread.
"""

from __future__ import annotations

import os

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (QApplication, QCheckBox, QComboBox, QFileDialog, QFormLayout, QHBoxLayout, QLabel, QLineEdit,
                               QPlainTextEdit, QProgressBar, QPushButton, QSpinBox, QSplitter,
                               QVBoxLayout, QWidget)

from gui.screens.run_job import (DEFAULT_PROMPTS, MODE_HELP, MODES, NO_REPEAT_NGRAM_RANGE,  # noqa: F401 (re-exported)
                                  REPETITION_PENALTY_RANGE, RunBackend, RunSettings, lane_notes, run_and_record,
                                  start_refusals)
from gui.timeline.event_bridge import EventBridge
from gui.screens.run_names import run_model_name
from gui.screens.run_sampling import SamplingFields
from gui.screens.serve_panel import ServePanel
from gui.techniques.speculative import speculative_refusals
from gui.screens.run_monitor import RunMonitorView
from gui.widgets import InlineMessage, borderless_scroll, browse_button, panel_header, row, say_why_disabled
from gui.workers import TaskRunner, shutdown_together

PREDICT_DEBOUNCE_MS = 200


class RunPanel(QWidget):
    """Settings and Start/Stop on the left, the live ``RunMonitorView`` on the right."""

    run_started = Signal()
    run_finished = Signal(str)
    """"completed", "stopped" or "failed"."""
    run_recorded = Signal(int, int)
    """(session_id, run_id) of the run being recorded in the workspace."""

    def __init__(self, state=None, backend: RunBackend | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.state = state
        self.backend = backend
        self.session_id: int | None = None
        self._session_workspace = ""
        self.last_outcome = ""
        self._start_when_solved = False  # Start pressed while a new profile's plan was being solved
        self._technique = "layer-sharding"
        self._technique_settings: dict[str, tuple[int, dict, str]] = {}
        """Each other technique's (micro-batches, technique options), kept while its plan is not the one shown."""
        self.setAccessibleName("Run screen")

        self.bridge = EventBridge(self)
        self.runner = TaskRunner(self, name="run")
        self.monitor = RunMonitorView()
        self.bridge.timeline_events_arrived.connect(self.monitor.add_timeline_events)
        self.bridge.token_events_arrived.connect(self.monitor.add_token_events)
        self.runner.task_finished.connect(self._on_runner_task_finished)
        self.runner.task_failed.connect(self._on_runner_task_failed)
        self.runner.task_cancelled.connect(self._on_runner_task_cancelled)
        self.runner.status_reported.connect(self._on_runner_status_reported)
        self.runner.progress_reported.connect(self._on_runner_progress_reported)
        self.runner.partial_result_reported.connect(self._on_runner_partial_result_reported)
        # The prediction (core.runs.prediction) runs on its own worker after a short pause in
        # the edits: a big plan takes seconds to simulate and must never block the GUI.
        self.predict_runner = TaskRunner(self, name="predict")
        self.predict_runner.task_finished.connect(self._on_predict_runner_task_finished)
        self.predict_runner.task_failed.connect(self._on_predict_runner_task_failed)
        self._predict_timer = QTimer(self)
        self._predict_timer.setSingleShot(True)
        self._predict_timer.setInterval(PREDICT_DEBOUNCE_MS)
        self._predict_timer.timeout.connect(self._update_prediction)
        self.prediction_note = QLabel("")
        self.prediction_note.setAccessibleName("Prediction note")
        self.prediction_note.setWordWrap(True)
        self.prediction_note.setVisible(False)

        self.model_edit = QLineEdit()
        self.model_edit.setAccessibleName("Model directory")
        self.model_edit.setToolTip("Checkpoint directory of the model to run (config.json, safetensors, tokenizer)")
        self.model_edit.setPlaceholderText("checkpoint directory")
        # "…" (Browse): at 1024x700 "Browse…" left the field ~70 px, the model's name cut ("mo-llama");
        # the field's tooltip gives the whole path
        self.model_edit.textChanged.connect(lambda text: self.model_edit.setToolTip(
            text or "Checkpoint directory of the model to run (config.json, safetensors, tokenizer)"))
        self.browse_button = browse_button("Browse for model directory", "Browse: choose the model's checkpoint directory")
        self.browse_button.clicked.connect(self._on_browse_clicked)
        model_row = QHBoxLayout()
        model_row.addWidget(self.model_edit, 1)
        model_row.addWidget(self.browse_button)

        self.prompts_edit = QPlainTextEdit()
        self.prompts_edit.setAccessibleName("Prompts")
        self.prompts_edit.setToolTip("One prompt per line; each line is one sequence of the batch")
        self.prompts_edit.setPlaceholderText("One prompt per line")
        self.prompts_edit.setPlainText("\n".join(DEFAULT_PROMPTS))
        self.prompts_edit.setMaximumHeight(110)

        self.max_tokens_spin = QSpinBox()
        self.max_tokens_spin.setRange(1, 4096)
        self.max_tokens_spin.setValue(32)
        self.max_tokens_spin.setAccessibleName("Max new tokens")
        self.max_tokens_spin.setToolTip("How many tokens to generate per prompt (at most)")
        self.pace_check = QCheckBox("every token, past EOS")
        self.pace_check.setAccessibleName("Presenter pace")
        self.pace_check.setToolTip("Generate every one of Max new tokens, past the end-of-text token, so a demo "
                                   "run lasts long enough to watch the pipeline (the tokens are the model's own; "
                                   "recorded with the run)")

        self.mode_combo = QComboBox()
        for mode in MODES:
            self.mode_combo.addItem(mode)
            self.mode_combo.setItemData(self.mode_combo.count() - 1, MODE_HELP[mode], Qt.ItemDataRole.ToolTipRole)
        self.mode_combo.setAccessibleName("Pipeline mode")
        self.mode_combo.setToolTip("How micro-batches move through the pipeline (EdgeShard §IV-C)")
        self.mode_combo.currentTextChanged.connect(self._on_settings_changed)

        # 0 is "the plan's count" (shown as such): the plan is where micro-batching is decided,
        # a number here is an override, recorded with the run.
        self.micro_batches_spin = QSpinBox()
        self.micro_batches_spin.setRange(0, 64)
        self.micro_batches_spin.setValue(0)
        self.micro_batches_spin.setAccessibleName("Micro-batches")
        self.micro_batches_spin.setToolTip("Split the prompts into this many micro-batches (every mode). "
                                           "Lowest value: the plan's count; any other value overrides it "
                                           "and is recorded with the run")
        self.micro_batches_spin.valueChanged.connect(self._on_settings_changed)
        self.max_tokens_spin.valueChanged.connect(self._on_settings_changed)
        self.sampling = SamplingFields(self)  # repetition penalty, n-gram ban, OpenAI's two penalties
        self.penalty_spin, self.ngram_spin = self.sampling.penalty_spin, self.sampling.ngram_spin
        self.sampling.changed.connect(self._on_settings_changed)
        self.micro_batches_spin.valueChanged.connect(lambda _v: self._apply_technique_limits())
        self.send_weights_check = QCheckBox("Send stage weights")
        self.send_weights_check.setAccessibleName("Send stage weights")
        self.send_weights_check.setToolTip(
            "Send each device only its stage's weights over the encrypted channel before loading "
            "(checksummed, resumed, kept on the device by content hash: a plan change re-sends only "
            "what moved). Off: each device loads the checkpoint from the same path on its own disk")

        self.on_failure_combo = QComboBox()
        for value, label, tip in (
                ("replan", "Re-plan and resume", "Re-plan over the surviving devices with the exact solver, "
                 "load the new shards and resume with the same tokens (needs the plan's planning problem)"),
                ("stop", "Stop the run", "End the run with an error naming the lost device")):
            self.on_failure_combo.addItem(label, value)
            self.on_failure_combo.setItemData(self.on_failure_combo.count() - 1, tip, Qt.ItemDataRole.ToolTipRole)
        self.on_failure_combo.setAccessibleName("On device failure")

        from gui.techniques.attention_offload import OffloadRunControls

        self.offload_controls = OffloadRunControls()  # shown for an attention-offload plan only
        from gui.techniques.speculative import SpeculativeRunControls

        self.speculative_controls = SpeculativeRunControls(self)  # its two rows: a layer-sharding plan only
        self.speculative_controls.changed.connect(self._on_settings_changed)
        self.model_edit.textChanged.connect(self.speculative_controls.offer_for)
        self.offload_controls.changed.connect(self._on_settings_changed)
        self.offload_controls.changed.connect(self._apply_technique_limits)
        self.on_failure_combo.setToolTip("What the run does when one of its devices dies mid-run "
                                         "(the timeline shows the failure, the re-plan and the reload)")

        self.start_button = QPushButton("Start")
        self.start_button.setAccessibleName("Start run")
        self.start_button.setToolTip("Run the model over the cluster with the current plan (Ctrl+Return)")
        self.start_button.setProperty("role", "primary")
        self.start_button.clicked.connect(self.start_run)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setAccessibleName("Stop run")
        self.stop_button.setToolTip("Stop the run (Esc); what was produced so far is kept")
        self.stop_button.setEnabled(False)
        self.stop_button.clicked.connect(self.stop_run)
        say_why_disabled({self.stop_button: "no run in progress"})
        # Ctrl+Return is the window's Run ▸ Start (from any screen); a second shortcut here would make
        # both ambiguous, and neither would fire
        QShortcut(QKeySequence("Escape"), self, activated=self.stop_run)

        self.status_label = QLabel("Ready.")
        self.status_label.setAccessibleName("Run status")
        self.status_label.setWordWrap(True)
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Run progress")
        self.progress.setRange(0, 1000)
        self.progress.setValue(0)
        self.progress.setTextVisible(False)
        self.progress.setMaximumHeight(8)
        self.message = InlineMessage()

        form = QFormLayout()
        form.addRow("Model", model_row)
        form.addRow("Prompts", self.prompts_edit)
        # Presenter pace beside it (one row): the OpenAI penalties' row kept the column unscrolled at 1024x700
        form.addRow("Max new tokens", row(self.max_tokens_spin, self.pace_check, stretch_last=True))
        form.addRow("Mode", self.mode_combo)
        form.addRow("Micro-batches", self.micro_batches_spin)
        self.sampling.add_rows(form)
        form.addRow("Weights", self.send_weights_check)
        form.addRow("On failure", self.on_failure_combo)
        form.addRow("Draft model", self.speculative_controls.draft_row)
        form.addRow("Speculate k, seed", self.speculative_controls.k_row)
        form.setVerticalSpacing(4)  # twelve rows, the Start row and the Serve toggle fit 1024x700 unscrolled
        self.form = form
        buttons = QHBoxLayout()
        buttons.addWidget(self.start_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)

        settings = QWidget()
        settings.setMaximumWidth(400)
        s_layout = QVBoxLayout(settings)
        s_layout.setContentsMargins(0, 0, 8, 0)
        s_layout.addLayout(form)
        s_layout.addWidget(self.offload_controls)
        s_layout.addLayout(buttons)
        s_layout.addWidget(self.progress)
        s_layout.addWidget(self.status_label)
        s_layout.addWidget(self.message)
        s_layout.addWidget(self.prediction_note)
        s_layout.addStretch(1)

        # the column scrolls rather than setting the page's minimum height: at 1024x700 a refusal's
        # message made the page scroll and the Serve row below it left the screen
        self.settings_scroll = borderless_scroll(settings)
        self.settings_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.settings_scroll.setMaximumWidth(400 + self.settings_scroll.verticalScrollBar().sizeHint().width())
        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.setChildrenCollapsible(False)
        splitter.addWidget(self.settings_scroll)
        splitter.addWidget(self.monitor)
        splitter.setStretchFactor(1, 1)
        self.monitor.stack_below_width = 720  # figures under the timeline where beside it they squeeze it
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 12, 16, 12)
        layout.addWidget(panel_header(
            "Run", "Run the model over the cluster with the current plan and watch the pipeline live."))
        layout.addWidget(splitter, 1)
        self.serve_panel = ServePanel(state, beside=splitter)  # the Serve toggle (s5: gui/screens/serve_panel.py)
        layout.addWidget(self.serve_panel, 0)

        if state is not None:
            state.model_changed.connect(self._on_state_model_changed)
            state.plan_changed.connect(self._on_settings_changed)
            state.plan_changed.connect(self._on_state_plan_changed)
            state.problem_changed.connect(self._on_settings_changed)
            state.problem_changed.connect(self._on_state_problem_changed)
            state.agents_changed.connect(self._on_state_plan_changed)
            state.run_options_proposed.connect(self._on_state_run_options_proposed)
            state.plan_solving_changed.connect(self._on_state_plan_solving_changed)
            self._on_state_model_changed(state.model_name)
        self._on_state_plan_changed()
        self._predict_timer.start()
        app = QApplication.instance()
        if app is not None:
            app.aboutToQuit.connect(self.shutdown)  # never leave a run thread behind

    # -- public API ----------------------------------------------------------------------
    def set_backend(self, backend: RunBackend | None) -> None:
        if backend is not None and not self.is_running():
            self.message.show_lines([])  # "No cluster to run on" no longer holds
        self.backend = backend

    def settings(self) -> RunSettings:
        prompts = tuple(line.strip() for line in self.prompts_edit.toPlainText().splitlines() if line.strip())
        refused = bool(self.history_sampling_refusal())  # the run gets them off, as it runs (and is recorded)
        return RunSettings(model_dir=self.model_edit.text().strip(), prompts=prompts,
                           max_new_tokens=self.max_tokens_spin.value(), mode=self.mode_combo.currentText(),
                           micro_batches=self.micro_batches_spin.value() or None,
                           send_weights=self.send_weights_check.isChecked(),
                           on_failure=self.on_failure_combo.currentData(),
                           technique_options={} if self.offload_controls.isHidden()
                           else self.offload_controls.options(),
                           **self.sampling.values(refused),
                           presenter_pace=self.pace_check.isChecked(),
                           **self._speculative_settings())

    def apply_settings(self, settings: RunSettings) -> None:
        """Show ``settings`` in the controls (the last workspace's, restored at launch)."""
        self.model_edit.setText(settings.model_dir)
        self.prompts_edit.setPlainText("\n".join(settings.prompts))
        self.max_tokens_spin.setValue(settings.max_new_tokens)
        self.mode_combo.setCurrentText(settings.mode)
        self.micro_batches_spin.setValue(settings.micro_batches or 0)
        self.send_weights_check.setChecked(settings.send_weights)
        self.on_failure_combo.setCurrentIndex(max(0, self.on_failure_combo.findData(settings.on_failure)))
        self.offload_controls.apply(settings.technique_options)
        self.sampling.apply(settings)
        self.pace_check.setChecked(settings.presenter_pace)
        self.speculative_controls.apply(settings.draft_dir, settings.speculate_k, settings.speculate_seed)

    def is_running(self) -> bool:
        return self.runner.is_busy()

    def start_run(self) -> None:
        if self.runner.is_busy():
            return
        if getattr(self.state, "plan_solving", False) and self.backend is not None:  # a new profile's plan
            self._start_when_solved = True  # lands within the second: run it then (Start right after profiling)
            self.message.show_lines([])
            self.status_label.setText("Waiting for the new profile's plan (being solved); the run starts then…")
            return
        settings = self.settings()
        problems = []
        if not settings.prompts:
            problems.append("Enter at least one prompt (one per line).")
        if self.backend is None:
            problems.append("No cluster to run on: start the demo cluster or deploy agents on the Devices "
                            "screen, then make a plan.")
        if settings.model_dir and not os.path.isdir(settings.model_dir):
            problems.append(f"Model directory {settings.model_dir} does not exist: choose the checkpoint "
                            "directory with … (Browse) beside the field.")
        if self.backend is not None and self.state is not None:  # what the Plan screen flags never starts
            problems += start_refusals(self.state.problem, self.state.plan, self.state.offline_devices)
        problems += self.sampling.problems()
        problems += speculative_refusals(settings, getattr(self.state, "problem", None), getattr(self.state, "plan", None))
        if problems:
            self._show_problems(problems, "Cannot start the run:")
            return
        self.message.show_lines([])
        lanes = list(self.backend.lanes())
        self.monitor.reset(lanes, settings.prompts, lane_notes(self.backend, settings))
        self._update_prediction()
        workspace = self.state.workspace if self.state is not None else ""
        if workspace != self._session_workspace:
            self.session_id, self._session_workspace = None, workspace
        plan = getattr(self.state, "plan", None)
        problem = getattr(self.state, "problem", None)
        self.last_outcome = ""
        model_name = run_model_name(self.state, settings.model_dir)
        origin = self.state.plan_origin(plan) if plan is not None and hasattr(self.state, "plan_origin") else None
        self.runner.start(run_and_record, self.backend, settings, self.bridge, workspace, self.session_id,
                          plan, problem, model_name, origin)
        self._set_running(True)
        self.status_label.setText(f"Running {settings.mode} with {len(settings.prompts)} prompt(s)…")
        self.run_started.emit()

    def stop_run(self) -> None:
        if not self.runner.is_busy():
            return
        self.status_label.setText("Stopping…")
        self.stop_button.setEnabled(False)
        self.runner.request_stop()  # task_cancelled arrives when the worker has ended
        if self.backend is not None:
            self.backend.stop()

    def shutdown(self, timeout_s: float = 10.0) -> bool:
        """Stop any run and join its thread (window close, tests)."""
        if self.backend is not None and self.runner.is_busy():
            self.backend.stop()
        self._predict_timer.stop()
        ok = shutdown_together((self.predict_runner, self.runner), timeout_s)
        self.bridge.flush()
        return self.monitor.shutdown(timeout_s) and ok

    # -- runner signals (GUI thread) -----------------------------------------------------
    def _finish(self, outcome: str, text: str, log: str = "") -> None:
        """End a run: ``text`` on the status line, ``log`` (default ``text``) in the log."""
        self.bridge.flush()
        self.monitor.flush()
        self.monitor.timeline.clip_predicted_to_run()  # no ghosts of tokens never generated
        self.monitor.timeline.show_whole_run()
        self._set_running(False)
        self.last_outcome = outcome
        if self.state is not None:
            self.state.live_run_ids.discard(getattr(self, "_recording_run_id", None))
            self.state.set_last_run(self.monitor.events, self.monitor.tokens)
        self.status_label.setText(text)
        if self.state is not None:
            self.state.log(log or text, "error" if outcome == "failed" else "info")
        self.run_finished.emit(outcome)

    def _on_runner_task_finished(self, task_id: int, result: object) -> None:
        self.progress.setValue(1000)
        self.bridge.flush()
        self.monitor.flush()
        fig = self.monitor.figures()
        recovered = result.get("recoveries", []) if isinstance(result, dict) else []
        self.monitor.set_wire(result.get("wire") if isinstance(result, dict) else None)
        self._finish("completed", f"Run completed: {fig.tokens} tokens in {fig.duration_s:.2f} s."
                     + "".join(f" Recovered: {r}." for r in recovered))
        new_plan = result.get("recovered_plan") if isinstance(result, dict) else None
        if new_plan is not None and self.state is not None:
            # The old plan names the lost device, so the next run would be refused: the plan the
            # run finished on becomes the current one (the Plan screen shows it; auto-solve redoes it).
            self.state.set_plan(new_plan)
            self.state.log("The plan the run recovered onto is now the current plan.", "info")

    def _on_runner_task_failed(self, task_id: int, message: str) -> None:
        self._show_problems([message], "The run failed:")
        # the log (and the status bar, on whatever screen is shown) say why, not only that it failed
        self._finish("failed", "Run failed.", log=f"Run failed: {message}")

    def _show_problems(self, lines: list[str], heading: str) -> None:
        self.message.show_lines(lines, heading)  # the column scrolls to it once laid out
        QTimer.singleShot(0, lambda: self.settings_scroll.ensureWidgetVisible(self.message))

    def _on_runner_task_cancelled(self, task_id: int) -> None:
        self._finish("stopped", "Run stopped; what arrived so far is kept.")

    def _on_runner_status_reported(self, task_id: int, text: str) -> None:
        self.status_label.setText(text)

    def _on_runner_progress_reported(self, task_id: int, done: float, total: float) -> None:
        self.progress.setValue(int(1000 * done / total) if total > 0 else 0)

    def _on_runner_partial_result_reported(self, task_id: int, value: object) -> None:
        if isinstance(value, dict) and "run_id" in value:
            self.session_id = value["session_id"]
            if self.state is not None:
                self.state.live_run_ids.add(value["run_id"])
            self._recording_run_id = value["run_id"]
            self.run_recorded.emit(value["session_id"], value["run_id"])

    # -- other handlers ------------------------------------------------------------------
    def _on_browse_clicked(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Model checkpoint directory", self.model_edit.text())
        if path:
            self.model_edit.setText(path)

    def _on_state_model_changed(self, name: str) -> None:
        path = getattr(self.state, "model_path", "")
        if path and not self.model_edit.text():
            self.model_edit.setText(path)

    def _on_state_plan_changed(self, *_args) -> None:
        plan = getattr(self.state, "plan", None)
        self._keep_technique_settings(plan)
        if plan is not None and not self.is_running():
            self.message.show_lines([])  # a banner about the last attempt ("no plan", a failed run) is stale now
        self.micro_batches_spin.setSpecialValueText(
            f"Plan's ({plan.micro_batches})" if plan is not None else "Plan's")
        agents = getattr(self.state, "agents", None)
        offline = set(getattr(self.state, "offline_devices", ()))
        self.offload_controls.show_for(plan, [] if agents is None else [a for a in agents.endpoints
                                                                          if a not in offline],
                                       *self._replica_limits(plan))
        from core.techniques import technique_of_plan

        sharded = plan is None or technique_of_plan(plan) == "layer-sharding"
        for w in (self.speculative_controls.draft_row, self.speculative_controls.k_row):
            self.form.setRowVisible(w, sharded)
        self._apply_technique_limits()

    def _keep_technique_settings(self, plan) -> None:
        """Each technique keeps its own run settings (micro-batches, its own options): a plan of
        another technique stores the shown ones under the old technique and shows its own."""
        from core.techniques import technique_of_plan

        technique = technique_of_plan(plan) if plan is not None else self._technique
        if technique == self._technique:
            return
        self._technique_settings[self._technique] = (self.micro_batches_spin.value(), self.offload_controls.options(),
                                                     self.model_edit.text())
        micro_batches, options, model_dir = self._technique_settings.get(technique, (0, {}, ""))
        self._technique = technique
        self.micro_batches_spin.setValue(micro_batches)
        if options:
            self.offload_controls.apply(options)
        # the technique's own checkpoint (a MoE for expert offloading): its plan runs on no other model
        model_dir = getattr(self.state, "technique_models", {}).get(technique, "") or model_dir
        if model_dir:
            self.model_edit.setText(model_dir)

    def _replica_limits(self, plan) -> tuple[dict[str, int], int]:
        """(profiled budgets, a replica's dense bytes) for the attention-offload replicas' limit; none known: ({}, 0)."""
        from core.techniques import technique_of_plan

        profile = getattr(self.state, "profile", None)
        model_dir = self.model_edit.text().strip() or getattr(self.state, "model_path", "")
        if plan is None or profile is None or not model_dir or technique_of_plan(plan) != "attention-offload":
            return {}, 0
        from core.errors import EdgeShardError
        from core.techniques.attention_offload.run import dense_weight_bytes

        try:
            dense = dense_weight_bytes(model_dir)
        except (OSError, ValueError, EdgeShardError):  # not a checkpoint (yet): the run says so
            return {}, 0
        return {d.id: d.memory_bytes for d in profile.cluster.devices}, dense

    def _on_state_problem_changed(self, _problem) -> None:
        self._apply_technique_limits()

    def _apply_technique_limits(self) -> None:
        """An attention-offload run has its own schedule (the staggering) and loads its own parts:
        the pipeline mode, sent weights and re-planning do not apply, and say so."""
        offload = not self.offload_controls.isHidden()
        self.mode_combo.setEnabled(not offload and not self.runner.is_busy())
        for w in (self.send_weights_check, self.on_failure_combo):
            w.setEnabled(not offload)
        why = ("an attention-offload run follows its staggering (below); it loads its own parts and a lost "
               "memory agent ends it") if offload else "a run is in progress"
        say_why_disabled({w: why for w in (self.mode_combo, self.send_weights_check, self.on_failure_combo)})
        plan, problem = getattr(self.state, "plan", None), getattr(self.state, "problem", None)
        if not offload and plan is not None and problem is not None and plan.model != problem.profile.model.name:
            # re-planning needs the plan's own problem (ClusterRunBackend uses none of another model)
            self.on_failure_combo.setEnabled(False)
            say_why_disabled({self.on_failure_combo: (
                f"re-planning needs a profile of {plan.model}; the studio's is of {problem.profile.model.name} "
                f"(Profile cluster with {plan.model} to re-plan): a lost device stops this run")})
        self.sampling.set_usable(self.history_sampling_refusal(), self.runner.is_busy())

    def _speculative_settings(self) -> dict:
        """The draft and k shown (a layer-sharding plan's; none for another technique's)."""
        if not self.speculative_controls.draft_row.isVisibleTo(self):
            return {}
        draft, k = self.speculative_controls.options()
        return {"draft_dir": draft, "speculate_k": k, "speculate_seed": self.speculative_controls.sample_seed()}

    def history_sampling_refusal(self) -> str:
        """Why the repetition penalty and the n-gram ban cannot be used for the current plan and
        settings ("" when they can): staggered attention offloading (several compute replicas, or
        micro-batches) samples on any replica, without the token history they need."""
        if self.offload_controls.isHidden():
            return ""
        from core.techniques.attention_offload.run import HISTORY_SAMPLING_REFUSED, OffloadRunOptions, is_staggered

        options = OffloadRunOptions.of(self.offload_controls.options())
        return HISTORY_SAMPLING_REFUSED if is_staggered(options, self.micro_batches_spin.value() or None) else ""

    def _on_state_plan_solving_changed(self, solving: bool) -> None:
        if not solving and self._start_when_solved:
            self._start_when_solved = False
            self.start_run()

    def _on_state_run_options_proposed(self, options: dict, micro_batches: int) -> None:
        """The Plan screen's split proposes how to run it (Run on agents): shown before it starts."""
        self.offload_controls.apply(options)
        self.micro_batches_spin.setValue(micro_batches)

    def _on_settings_changed(self, *_args) -> None:
        if not self.runner.is_busy():
            self._predict_timer.start()  # restarts: one prediction after the edits pause

    def _set_running(self, running: bool) -> None:
        self.start_button.setEnabled(not running)
        self.stop_button.setEnabled(running)
        for w in (self.model_edit, self.browse_button, self.prompts_edit, self.max_tokens_spin, self.pace_check,
                  self.mode_combo, self.micro_batches_spin, self.offload_controls, *self.sampling.widgets(),
                  self.speculative_controls.draft_row):
            w.setEnabled(not running)
        self._apply_technique_limits()
        if running:
            self.progress.setValue(0)

    def _update_prediction(self) -> None:
        """Start predicting the timeline for the current plan and settings (on a worker; a
        newer prediction supersedes an older one); it is drawn under the measured one."""
        from core.runs.prediction import predict_run_task

        self._predict_timer.stop()
        plan = getattr(self.state, "plan", None)
        # the plan's technique predicts it with its own simulator (its view set the origin with the plan)
        origin = self.state.plan_origin(plan) if plan is not None and hasattr(self.state, "plan_origin") else None
        if origin is None:
            self.predict_runner.cancel()
            self._show_prediction(None)
            return
        from gui.techniques.speculative import predicted_speculation

        s = self.settings()
        speculation = predicted_speculation(s, origin.problem, plan) if origin.plan == plan else None
        self.predict_runner.start(predict_run_task, origin, plan, s.mode, len(s.prompts), s.micro_batches,
                                  s.max_new_tokens, speculation=speculation, prompts_of=(s.model_dir, s.prompts))

    def _show_prediction(self, prediction) -> None:
        self.monitor.set_predicted(prediction.result.events if prediction is not None else [])
        note = prediction.note if prediction is not None else ""
        self.prediction_note.setText(note)
        self.prediction_note.setVisible(bool(note))

    def _on_predict_runner_task_finished(self, _task_id: int, prediction: object) -> None:
        self._show_prediction(prediction)

    def _on_predict_runner_task_failed(self, _task_id: int, _message: str) -> None:
        self._show_prediction(None)  # a plan the simulator refuses has no predicted timeline


"""The plan editor: edit a shard plan by hand and see its predicted cost at once.

Every edit (drag a boundary, pick a stage's device, add or remove a stage, adopt a
solver's plan, load a file) is a ``QUndoCommand``; every plan or problem change is
re-evaluated with ``core.planning.cost.evaluate`` (cheap, so on the GUI thread), and every
violation is listed in red with its reason. Auto-solve and Compare run the solvers in a
``TaskRunner`` worker, so a big instance never freezes the window.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeySequence, QUndoCommand, QUndoStack
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QVBoxLayout,
    QWidget,
)

from core import formats
from core.planning.cost import PlanCost, evaluate
from core.errors import EdgeShardError, PlanInvalid
from core.planning.plan import ShardPlan
from core.planning.edits import add_stage, move_boundary, remove_stage, set_stage_device, single_device_plan
from core.planning.problem import PlanningProblem, without_offline
from core.planning.solvers.comparison import StrategyOutcome
from gui.techniques.layer_sharding import planning_tasks
from gui.techniques.layer_sharding.comparison import StrategyComparison
from gui.techniques.layer_sharding.stages import STAGE_COLUMN_TIPS, STAGE_COLUMNS, StageTable, fmt_s
from gui.app import style_plot, theme_colors
from gui.studio_state import StudioState
from gui.widgets.unit_strip import UnitStripView
from gui.widgets import InlineMessage, MetricCard, panel_header, say_why_disabled, show_error
from gui.workers import TaskRunner


TECHNIQUE = "layer-sharding"
"""The technique whose plan this editor edits (``StudioState.plan_for``): another technique's plan
being run (attention offloading's one dense stage) is never shown or edited here."""


class PlanChange(QUndoCommand):
    """One undoable edit: the plan before and after."""

    def __init__(self, editor: "PlanEditorPanel", before: ShardPlan | None, after: ShardPlan, text: str) -> None:
        super().__init__(text)
        self._editor, self._before, self._after = editor, before, after

    def redo(self) -> None:
        self._editor.state.set_plan(self._after)

    def undo(self) -> None:
        if self._before is None:
            self._editor.state.clear_plan(TECHNIQUE)
        else:
            self._editor.state.set_plan(self._before)


class PlanEditorPanel(StrategyComparison, StageTable, QWidget):
    cost_changed = Signal(object)
    """PlanCost | None, after every re-evaluation."""

    def __init__(self, state: StudioState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.undo_stack = QUndoStack(self)
        self.cost: PlanCost | None = None
        self.comparison: list[StrategyOutcome] = []
        self.compare_hint: pg.LabelItem | None = None
        """What the chart says before a comparison (None once one is drawn)."""
        self._compared_problem: PlanningProblem | None = None
        """The problem the comparison was computed for: a different one makes it stale (no Adopt)."""
        self._solve_runner = TaskRunner(self, name="solve")
        self._solve_kind = ""
        self._placeholder: ShardPlan | None = None
        """The one-device plan a new profile starts with; a solve of a profile it does not fit replaces it."""
        self._described_plan: ShardPlan | None = None
        """The plan ``solve_status`` describes (cleared with it once another plan is shown)."""
        self._updating = False
        self._build()
        state.problem_changed.connect(self._on_state_problem_changed)
        state.plan_changed.connect(self._on_state_plan_changed)
        state.offline_changed.connect(lambda _devices: self.refresh())
        self._solve_runner.task_finished.connect(self._on_solver_finished)
        self._solve_runner.task_failed.connect(self._on_solver_failed)
        self._solve_runner.status_reported.connect(lambda _i, t: self.solve_status.setText(t))
        self._solve_runner.busy_changed.connect(self._on_solver_busy_changed)
        self._on_state_problem_changed(state.problem)

    # construction ---------------------------------------------------------------
    def _build(self) -> None:
        root = QVBoxLayout(self)
        root.setContentsMargins(16, 8, 16, 8)
        root.addWidget(panel_header("Plan", "Which device runs which units. Drag a boundary, pick devices, or Auto-solve; "
                                    "every edit is re-predicted with the cost model."))
        tools = QHBoxLayout()
        self.undo_action = self.undo_stack.createUndoAction(self, "Undo")
        self.undo_action.setShortcut(QKeySequence.Undo)
        self.redo_action = self.undo_stack.createRedoAction(self, "Redo")
        self.redo_action.setShortcut(QKeySequence.Redo)
        self.addActions([self.undo_action, self.redo_action])
        self.undo_button = self._button("Undo", "Undo the last plan edit (Ctrl+Z)", self.undo_stack.undo)
        self.redo_button = self._button("Redo", "Redo (Ctrl+Shift+Z)", self.undo_stack.redo)
        self.undo_stack.canUndoChanged.connect(self.undo_button.setEnabled)
        self.undo_stack.canRedoChanged.connect(self.redo_button.setEnabled)
        self.undo_button.setEnabled(False)
        self.redo_button.setEnabled(False)
        self.add_button = self._button("Add stage", "Split the largest stage; the new half runs on an unused device",
                                       self.add_stage)
        self.remove_button = self._button("Remove stage", "Remove the selected stage; its units join the stage before",
                                          self.remove_selected_stage)
        self.load_button = self._button("Load…", "Load a plan file (edgeshard.plan JSON)", self._on_load_clicked)
        self.save_button = self._button("Save…", "Save this plan to a file for `edgeshard run --plan`", self._on_save_clicked)
        for b in (self.undo_button, self.redo_button):
            tools.addWidget(b)
        tools.addSpacing(16)
        tools.addWidget(self.add_button)
        tools.addWidget(self.remove_button)
        tools.addSpacing(16)
        tools.addWidget(self.load_button)
        tools.addWidget(self.save_button)
        tools.addStretch(1)
        self.strategy_label = QLabel("")
        self.strategy_label.setProperty("role", "subtitle")
        tools.addWidget(self.strategy_label)
        root.addLayout(tools)

        # The plan (figures, strip, stages, comparison) on the left and the solver's settings
        # on the right, side by side from the figures down: the screen fits 1024x700.
        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(0, 0, 0, 0)
        cards = QHBoxLayout()
        self.latency_card = MetricCard("Latency / token", "One decode step for the workload's batch through every stage and back")
        self.prefill_card = MetricCard("Prefill", "Time to process the prompt and return the first token")
        self.throughput_card = MetricCard("Throughput", "Pipelined tokens per second with the plan's micro-batches (no bubbles)")
        self.status_card = MetricCard("Constraints", "Whether every rule holds: coverage, source device, memory, links")
        for c in (self.latency_card, self.prefill_card, self.throughput_card, self.status_card):
            cards.addWidget(c)
        ll.addLayout(cards)

        self.strip = UnitStripView()
        self.strip.boundary_moved.connect(self._on_strip_boundary_moved)
        self.strip.stage_clicked.connect(lambda j: self.stage_table.selectRow(j))
        ll.addWidget(self.strip)
        self.violations = InlineMessage()
        ll.addWidget(self.violations)

        split = QSplitter(Qt.Horizontal)
        split.setChildrenCollapsible(False)
        self.stage_table = QTableWidget(0, len(STAGE_COLUMNS))
        self.stage_table.setHorizontalHeaderLabels(STAGE_COLUMNS)
        for column, tip in STAGE_COLUMN_TIPS.items():
            self.stage_table.horizontalHeaderItem(column).setToolTip(tip)
        self.stage_table.setAccessibleName("Stages")
        self.stage_table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.stage_table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.stage_table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.stage_table.verticalHeader().hide()
        hh = self.stage_table.horizontalHeader()
        hh.setSectionResizeMode(QHeaderView.ResizeToContents)
        # the memory bars fill the rest of the width but never shrink below their text (``_fill``
        # sizes the column): a Stretch column was squeezed to ~40 px at 1024x700 ("3.83 M");
        # where the table is too narrow it scrolls instead
        hh.setSectionResizeMode(len(STAGE_COLUMNS) - 1, QHeaderView.Interactive)
        hh.setStretchLastSection(True)
        self.stage_table.setHorizontalScrollMode(QAbstractItemView.ScrollPerPixel)
        self.stage_table.horizontalScrollBar().rangeChanged.connect(lambda *_: self._fit_stage_table())
        ll.addWidget(self.stage_table)
        compare = QSplitter(Qt.Horizontal)
        compare.setChildrenCollapsible(False)
        self.compare_plot = pg.GraphicsLayoutWidget()
        self.compare_plot.setAccessibleName("Strategy comparison chart")
        self.compare_plot.setToolTip("Compare strategies draws every strategy's predicted latency and throughput here")
        compare.addWidget(self._build_compare_chart())
        compare.addWidget(self._build_compare_table())
        compare.setStretchFactor(0, 1)  # the table (strategy names, Adopt) as wide as the chart
        compare.setStretchFactor(1, 1)
        ll.addWidget(compare, 1)
        split.addWidget(left)
        split.addWidget(self._build_solver_box())
        split.setStretchFactor(0, 4)
        split.setStretchFactor(1, 1)
        root.addWidget(split, 1)

    def _button(self, text: str, tip: str, slot) -> QPushButton:
        b = QPushButton(text)
        b.setToolTip(tip)
        b.setAccessibleName(text.rstrip("…"))
        b.clicked.connect(slot)
        return b

    def _build_solver_box(self) -> QWidget:
        box = QGroupBox("Auto-solve")
        form = QFormLayout(box)
        self.objective_combo = QComboBox()
        self.objective_combo.addItem("Minimum latency", "latency")
        self.objective_combo.addItem("Maximum throughput", "throughput")
        self.objective_combo.currentIndexChanged.connect(lambda *_: self.comparison and self._draw_comparison())
        self.objective_combo.setToolTip("What the exact solver optimises")
        self.objective_combo.setAccessibleName("Objective")
        form.addRow("Objective", self.objective_combo)
        self.source_combo = QComboBox()
        self.source_combo.setToolTip("The device holding the prompt: stage 0 runs there")
        self.source_combo.setAccessibleName("Source device")
        self.source_combo.currentIndexChanged.connect(self._on_constraints_edited)
        form.addRow("Source", self.source_combo)  # the device holding the prompt (tooltip)
        self.excluded_list = QListWidget()
        self.excluded_list.setToolTip("Checked devices are never used (privacy, maintenance)")
        self.excluded_list.setAccessibleName("Excluded devices")
        self.excluded_list.setMaximumHeight(60)
        self.excluded_list.itemChanged.connect(self._on_constraints_edited)
        form.addRow("Exclude", self.excluded_list)
        self.headroom_spin = QDoubleSpinBox()
        self.headroom_spin.setRange(0, 90)
        self.headroom_spin.setSuffix(" %")
        self.headroom_spin.setDecimals(0)
        self.headroom_spin.setToolTip("Memory kept free on every device")
        self.headroom_spin.setAccessibleName("Memory headroom")
        self.headroom_spin.valueChanged.connect(self._on_constraints_edited)
        self.prompt_spin = QSpinBox()
        self.prompt_spin.setRange(1, 1_000_000)
        self.prompt_spin.setAccessibleName("Prompt tokens")
        self.prompt_spin.setToolTip("Prompt length the plan is predicted for")
        self.gen_spin = QSpinBox()
        self.gen_spin.setRange(1, 1_000_000)
        self.gen_spin.setAccessibleName("Generated tokens")
        self.gen_spin.setToolTip("Tokens generated per sequence (sets the KV cache size)")
        self.batch_spin = QSpinBox()
        self.batch_spin.setRange(1, 4096)
        self.batch_spin.setAccessibleName("Batch size")
        self.batch_spin.setToolTip("Sequences served together")
        for s in (self.prompt_spin, self.gen_spin, self.batch_spin):
            s.valueChanged.connect(self._on_constraints_edited)
        # two figures a row (memory headroom and batch; prompt and generated tokens), the two
        # buttons on one row: the Plan screen fits a 1024x700 window without scrolling
        memory_row = QHBoxLayout()
        memory_row.addWidget(self.headroom_spin, 1)
        memory_row.addWidget(QLabel("Batch"))
        memory_row.addWidget(self.batch_spin, 1)
        form.addRow("Headroom", memory_row)
        self.quality_spin = QDoubleSpinBox()  # the quality bound: off (every stage fp) at its minimum
        self.quality_spin.setRange(-0.5, 100)
        self.quality_spin.setDecimals(1)
        self.quality_spin.setSuffix(" % perplexity")
        self.quality_spin.setSpecialValueText("fp weights only")
        self.quality_spin.setAccessibleName("Quality bound")
        self.quality_spin.valueChanged.connect(self._on_constraints_edited)
        form.addRow("Quality", self.quality_spin)
        tokens_row = QHBoxLayout()
        tokens_row.setSpacing(4)
        tokens_row.addWidget(self.prompt_spin, 1)
        tokens_row.addWidget(QLabel("→"))  # prompt tokens → generated tokens (their tooltips say so)
        tokens_row.addWidget(self.gen_spin, 1)
        form.addRow("Tokens", tokens_row)
        self.solve_button = QPushButton("Auto-solve")
        self.solve_button.setProperty("role", "primary")
        self.solve_button.setToolTip("Find the optimal plan for the objective and constraints (Ctrl+R)")
        self.solve_button.setAccessibleName("Auto-solve")
        self.solve_button.clicked.connect(self.auto_solve)
        self.compare_button = QPushButton("Compare strategies")
        self.compare_button.setToolTip("Solve with every strategy (exact solvers and baselines) and chart them side by side")
        self.compare_button.setAccessibleName("Compare strategies")
        self.compare_button.clicked.connect(self.compare)
        buttons = QHBoxLayout()
        buttons.addWidget(self.solve_button)
        buttons.addWidget(self.compare_button)
        form.addRow(buttons)
        no_profile = "no profile yet: Devices ▸ Profile cluster (Ctrl+P) or File ▸ Load profile…"
        say_why_disabled({self.solve_button: no_profile, self.compare_button: no_profile,
                          self.add_button: no_profile + "; or every device already runs a stage",
                          self.remove_button: "select a stage (click it in the strip); the first stage stays",
                          self.load_button: no_profile, self.save_button: "no plan yet: Auto-solve or load one",
                          self.undo_button: "nothing to undo", self.redo_button: "nothing to redo"})
        self.solve_progress = QProgressBar()
        self.solve_progress.setRange(0, 0)
        self.solve_progress.setMaximumHeight(10)
        self.solve_progress.setTextVisible(False)
        self.solve_progress.hide()
        form.addRow(self.solve_progress)
        self.solve_status = QLabel("")
        self.solve_status.setWordWrap(True)
        self.solve_status.setProperty("role", "subtitle")
        form.addRow(self.solve_status)
        box.setMaximumWidth(400)
        return box

    @property
    def own_plan(self) -> ShardPlan | None:
        """The layer-sharding plan (not necessarily the one last run: ``StudioState.plan``)."""
        return self.state.plan_for(TECHNIQUE)

    # state -> view ----------------------------------------------------------------
    def _on_state_problem_changed(self, problem: PlanningProblem | None) -> None:
        self._updating = True
        try:
            ids = problem.profile.cluster.device_ids() if problem else ()
            if tuple(self.source_combo.itemData(i) for i in range(self.source_combo.count())) != ids:
                self.source_combo.clear()
                self.excluded_list.clear()
                for d in ids:
                    self.source_combo.addItem(d, d)
                    it = QListWidgetItem(d)
                    it.setFlags(it.flags() | Qt.ItemIsUserCheckable)
                    it.setCheckState(Qt.Unchecked)
                    self.excluded_list.addItem(it)
            if problem is not None:
                self.source_combo.setCurrentIndex(max(0, self.source_combo.findData(problem.source)))
                for i in range(self.excluded_list.count()):
                    it = self.excluded_list.item(i)
                    it.setCheckState(Qt.Checked if it.text() in problem.excluded_devices else Qt.Unchecked)
                self.headroom_spin.setValue(round(problem.memory_headroom * 100))
                bound = problem.max_perplexity_increase
                self.quality_spin.setValue(-0.5 if bound is None else bound * 100)
                measured = bool(problem.profile.weight_quality)
                self.quality_spin.setEnabled(measured or bound is not None)
                self.quality_spin.setToolTip(
                    "Devices may hold int8/int4 weights whose measured perplexity is at most this much above fp's"
                    if measured else "This profile has no perplexity per weight precision: `edgeshard measure-precision`")
                self.prompt_spin.setValue(problem.workload.prompt_tokens)
                self.gen_spin.setValue(problem.workload.generated_tokens)
                self.batch_spin.setValue(problem.workload.batch_size)
        finally:
            self._updating = False
        for w in (self.solve_button, self.compare_button, self.add_button, self.load_button):
            w.setEnabled(problem is not None)
        if self.comparison and problem is not self._compared_problem:
            self._mark_comparison_stale()
        plan = self.own_plan
        if problem is not None and (plan is None or plan.model != problem.profile.model.name):
            self.undo_stack.clear()
            first = single_device_plan(problem.profile.model.name, problem.profile.model.num_units, problem.source)
            self.state.set_plan(first)
            self._placeholder = first
            if evaluate(problem, first).violations:  # the model does not fit its source: solve at once
                self._start_solve("first", planning_tasks.solve, problem)
        self.refresh()

    def _on_state_plan_changed(self, _plan) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Re-evaluate the current plan against the current problem and redraw everything."""
        problem, plan = self.state.problem, self.own_plan
        self.cost = evaluate(problem, plan) if problem is not None and plan is not None else None
        cost = self.cost
        model = problem.profile.model if problem else None
        bad = self._bad_stages(plan, cost)
        self.strip.set_plan(model, plan, bad)
        self.save_button.setEnabled(plan is not None)
        self.remove_button.setEnabled(plan is not None and len(plan.stages) > 1)
        self.strategy_label.setText(f"strategy: {plan.strategy}" if plan else "")
        if self._described_plan is not None and plan != self._described_plan:
            self._described_plan = None  # the solver's line described another plan: never contradict this one
            self.solve_status.setText("")
        if cost is None:
            for c in (self.latency_card, self.prefill_card, self.throughput_card, self.status_card):
                c.set_value("—")
            self.violations.show_lines([])
        else:
            self.latency_card.set_value(fmt_s(cost.latency_per_token_s), math.isinf(cost.latency_per_token_s))
            self.prefill_card.set_value(fmt_s(cost.prefill_s), math.isinf(cost.prefill_s))
            batching = (f"  ({cost.micro_batches} × {cost.micro_batch_size})"
                        if cost.micro_batches > 1 or cost.micro_batch_size > 1 else "")
            self.throughput_card.set_value(f"{cost.throughput_tokens_s:.1f} tok/s{batching}")
            self.throughput_card.setToolTip("Pipelined tokens per second with the plan's micro-batches "
                                            f"({cost.micro_batches} in flight of {cost.micro_batch_size} sequence(s))")
            violations = self._plan_problems(plan, cost)
            n = len(violations)
            self.status_card.set_value("all satisfied" if n == 0 else f"{n} violated", n > 0)
            self.violations.show_lines(violations, "This plan cannot run as it is:")
        self._fill_stage_table(problem, plan, cost)
        self.cost_changed.emit(cost)
        style_plot(self.compare_plot)
        if self.comparison:
            self._draw_comparison()
        else:
            self.compare_plot.clear()
            self.compare_plot.setMinimumHeight(80)
            self.compare_plot.setToolTip("Compare strategies draws every strategy's predicted latency and throughput here")
            self.compare_legend.setText("")
            # in short lines: the chart is ~200 px wide on a 1024 px screen
            self.compare_hint = self.compare_plot.addLabel(
                "Compare strategies<br>(Ctrl+Shift+C) charts<br>every strategy's latency<br>and throughput here",
                color=theme_colors()["muted"])

    # edits -------------------------------------------------------------------------
    def push_plan(self, plan: ShardPlan, text: str) -> None:
        """Make ``plan`` current through the undo stack."""
        if plan == self.own_plan:
            return
        self.undo_stack.push(PlanChange(self, self.own_plan, plan, text))

    def _edit(self, fn, text: str, *args) -> None:
        plan = self.own_plan
        if plan is None:
            return
        try:
            self.push_plan(fn(plan, *args), text)
        except EdgeShardError as err:
            self.solve_status.setText(str(err))
            self.state.log(str(err), "warning")

    def _on_strip_boundary_moved(self, stage: int, new_start: int) -> None:
        self._edit(move_boundary, f"Move stage {stage} to start at unit {new_start}", stage, new_start)

    def set_stage_device(self, stage: int, device: str) -> None:
        plan = self.own_plan
        if plan is None or stage >= len(plan.stages) or plan.stages[stage].device == device:
            return
        self._edit(set_stage_device, f"Run stage {stage} on {device}", stage, device)

    def add_stage(self) -> None:
        problem, plan = self.state.problem, self.own_plan
        if problem is None or plan is None:
            return
        used = set(plan.devices())
        free = [d for d in problem.profile.cluster.device_ids() if d not in used and d not in problem.excluded_devices]
        if not free:
            self.solve_status.setText("Every device already runs a stage: add a device to the cluster first.")
            return
        self._edit(add_stage, f"Add a stage on {free[0]}", free[0])

    def remove_selected_stage(self) -> None:
        plan = self.own_plan
        if plan is None:
            return
        j = self.stage_table.currentRow()
        if j < 0:
            j = len(plan.stages) - 1
        self._edit(remove_stage, f"Remove stage {j}", j)

    def _on_constraints_edited(self, *_a) -> None:
        if self._updating or self.state.problem is None:
            return
        p = self.state.problem
        excluded = tuple(
            self.excluded_list.item(i).text()
            for i in range(self.excluded_list.count())
            if self.excluded_list.item(i).checkState() == Qt.Checked
        )
        workload = msgspec.structs.replace(
            p.workload, prompt_tokens=self.prompt_spin.value(), generated_tokens=self.gen_spin.value(),
            batch_size=self.batch_spin.value(),
        )
        try:
            self.state.update_problem(
                source=self.source_combo.currentData() or p.source, excluded_devices=excluded,
                memory_headroom=self.headroom_spin.value() / 100.0, workload=workload,
                max_perplexity_increase=None if self.quality_spin.value() < 0 else self.quality_spin.value() / 100.0,
            )
        except EdgeShardError as err:  # e.g. a batch smaller than the fixed micro-batch size
            self.violations.show_lines([str(err)], "The constraints were not applied:")

    # files ------------------------------------------------------------------------
    def load_plan_file(self, path: str) -> None:
        """Load a plan file; a wrong file or another model's plan is an inline message."""
        problem = self.state.problem
        try:
            plan = formats.load(path, ShardPlan)
        except EdgeShardError as err:
            show_error(self, "Cannot load plan", err, "Choose a file saved by `edgeshard plan` or this editor.")
            return
        if problem is not None and plan.model != problem.profile.model.name:
            show_error(self, "Plan is for another model",
                       f"{path} is a plan for {plan.model!r}, but the profile is of {problem.profile.model.name!r}.",
                       "Load the matching profile first, or choose a plan made for this model.")
            return
        self.push_plan(plan, f"Load {Path(path).name}")

    def save_plan_file(self, path: str) -> None:
        if self.own_plan is None:
            return
        try:
            formats.save(path, self.own_plan)
        except OSError as err:
            show_error(self, "Cannot save plan", f"{path}: {err.strerror or err}", "Choose a folder you can write to.")
            return
        self.state.log(f"saved plan to {path}")

    def _on_load_clicked(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Load plan", "", "Plan files (*.json);;All files (*)")
        if path:
            self.load_plan_file(path)

    def _on_save_clicked(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save plan", "plan.json", "Plan files (*.json)")
        if path:
            self.save_plan_file(path)

    # solving -----------------------------------------------------------------------
    def auto_solve(self) -> None:
        problem = self.state.problem
        if problem is None:
            self._say_no_problem("auto-solve")
            return
        problem = self._online_only(problem)
        if problem is None:
            return
        self.solve_status.setText("Solving…" + self._leaving_out())
        self._start_solve("solve", planning_tasks.solve, problem)

    def compare(self) -> None:
        problem = self.state.problem
        if problem is None:
            self._say_no_problem("compare strategies")
            return
        problem = self._online_only(problem)
        if problem is None:
            return
        self.solve_status.setText("Comparing strategies…" + self._leaving_out())
        self._start_solve("compare", planning_tasks.compare_strategies, problem)

    def _start_solve(self, kind: str, task, problem: PlanningProblem) -> None:
        """``kind``: "solve" (Auto-solve: undoable), "compare", or "first" (a profile whose source
        cannot hold the model: its solved plan replaces the placeholder, with nothing to undo)."""
        self._solve_kind = kind
        if kind == "first":
            problem = self._online_only(problem)
            if problem is None:
                return
            self.solve_status.setText("The model does not fit its source alone: solving…")
        self._solve_runner.start(task, problem, self.objective_combo.currentData())

    def _online_only(self, problem):
        """The problem the solvers get: offline devices left out (None, said why, when the source is one)."""
        try:
            return without_offline(problem, self.state.offline_devices)
        except PlanInvalid as err:
            text = "Cannot solve: " + "; ".join(err.violations)
            self.solve_status.setText(text)
            self.state.log(text, "warning")
            return None

    def _leaving_out(self) -> str:
        known = set(self.state.problem.profile.cluster.device_ids()) if self.state.problem else set()
        down = [d for d in self.state.offline_devices if d in known]
        return f" (leaving out offline {', '.join(down)})" if down else ""

    def _say_no_problem(self, what: str) -> None:
        """A shortcut pressed before profiling says what is missing instead of doing nothing."""
        text = (f"Cannot {what} yet: no profile. Profile the cluster first (Devices ▸ Profile cluster, Ctrl+P) "
                "or load one (File ▸ Load profile…).")
        self.solve_status.setText(text)
        self.state.log(text, "warning")

    def _on_solver_busy_changed(self, busy: bool) -> None:
        self.state.set_plan_solving(busy and self._solve_kind == "first")  # Start waits (task_finished came first)
        self.solve_progress.setVisible(busy)
        self.solve_button.setEnabled(not busy and self.state.problem is not None)
        self.compare_button.setEnabled(not busy and self.state.problem is not None)

    def _on_solver_finished(self, _task: int, result) -> None:
        if isinstance(result, StrategyOutcome):
            summary = planning_tasks.summary(result)
            self._described_plan = result.plan
            if self._solve_kind == "first":
                if self.own_plan != self._placeholder:  # a plan was restored, loaded or edited meanwhile
                    return
                self.undo_stack.clear()
                self.state.set_plan(result.plan)
            else:
                self.push_plan(result.plan, f"Auto-solve ({result.strategy})")
            self.solve_status.setText(summary)
            self.state.log(f"auto-solve: {summary}")
        else:
            self.show_comparison(list(result))

    def _on_solver_failed(self, _task: int, message: str) -> None:
        self.solve_status.setText(message)
        self.state.log(message, "error")
        if self._solve_kind == "first":  # nobody pressed anything: no dialog, the line and the log say it
            return
        show_error(self, "Solving failed", message,
                   "Relax the constraints (fewer excluded devices, less headroom) or add devices with more memory.")

    def shutdown(self) -> None:
        self._solve_runner.shutdown()

"""The expert-offloading plan view (EdgeMoE): the problem of a profiled device of the cluster
(its measured compute times, memory budget and storage bandwidth: ``core.techniques.
expert_offload.on_agents``) or the paper-shaped what-if scenario; the plan of a strategy; Compare
of EdgeMoE and the paper's baselines (a row picks its strategy; one that does not fit cannot be
used); per strategy, a bar of one token's time split into compute and storage reads that compute
could not hide; and *Use for Run*: the Run screen runs the plan on the agent, its storage lane
and expert heat map live.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import (
    QComboBox, QDoubleSpinBox, QGridLayout, QHBoxLayout, QLabel, QProgressBar, QPushButton, QTableWidget,
    QTabWidget, QVBoxLayout, QWidget,
)

from core.errors import EdgeShardError
from core.techniques import technique_named
from core.techniques.expert_offload.on_agents import (
    cluster_problem, measure_storage, profile_agents, stored_bandwidth_bps, stored_read_cost,
)
from core.techniques.expert_offload.scenarios import paper_shaped
from gui.studio_state import StudioState
from gui.techniques.expert_offload.run_box import ExpertRunBox, run_job
from gui.widgets import InlineMessage, fill_table, panel_header, say_why_disabled
from gui.workers import TaskRunner

MEASURED = "Measured cluster"
WHAT_IF = "What-if: phone (paper-shaped)"
ADOPTABLE = ("optimal", "ok")
"""Statuses of a strategy whose plan fits its problem: only these can become the Run screen's plan."""

COMPUTE = QColor("#4c78a8")
STALL = QColor("#e45756")


class TokenTimeBars(QWidget):
    """One horizontal bar per strategy: compute and un-hidden storage reads per token."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.rows: list[tuple[str, float, float]] = []
        self.setMinimumHeight(120)

    def show_rows(self, rows: list[tuple[str, float, float]]) -> None:
        self.rows = rows
        self.update()

    def paintEvent(self, _event) -> None:  # noqa: N802 (Qt)
        p = QPainter(self)
        p.fillRect(self.rect(), self.palette().base())
        if not self.rows:
            p.drawText(self.rect(), Qt.AlignCenter, "Compare to see each strategy's time per token")
            return
        label_w, right = 110, 90
        width = max(10, self.width() - label_w - right)
        longest = max(c + s for _, c, s in self.rows) or 1.0
        row_h = min(34, (self.height() - 30) / len(self.rows))
        for i, (name, compute, stall) in enumerate(self.rows):
            y = 8 + i * row_h
            p.setPen(self.palette().text().color())
            p.drawText(QRectF(4, y, label_w - 8, row_h), Qt.AlignVCenter | Qt.AlignRight, name)
            cw, sw = width * compute / longest, width * stall / longest
            p.fillRect(QRectF(label_w, y + 4, cw, row_h - 8), COMPUTE)
            p.fillRect(QRectF(label_w + cw, y + 4, sw, row_h - 8), STALL)
            p.drawText(QRectF(label_w + cw + sw + 6, y, right, row_h), Qt.AlignVCenter,
                       f"{(compute + stall) * 1e3:.0f} ms")
        y = 8 + len(self.rows) * row_h + 4
        for x, color, text in ((label_w, COMPUTE, "compute"), (label_w + 110, STALL, "storage reads not hidden")):
            p.fillRect(QRectF(x, y + 3, 12, 12), color)
            p.setPen(QPen(self.palette().text().color()))
            p.drawText(QRectF(x + 16, y, 220, 18), Qt.AlignVCenter, text)


def _storage_job(reporter, model_dir: str) -> float:
    return measure_storage(model_dir, reporter=reporter)


def _profile_job(reporter, coordinator, model_dir: str):
    return profile_agents(coordinator, model_dir, reporter=reporter)


class ExpertOffloadPlanView(QWidget):
    """Plan screen view of the ``expert-offload`` technique."""

    HEADERS = ("strategy", "status", "tokens/s", "buffer slots", "expert bits", "preload", "memory (MB)",
               "reads stall (ms/token)")

    def __init__(self, state: StudioState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.technique = technique_named("expert-offload")
        self.model_dir = ""
        """The Mixtral checkpoint planned and run (the studio's model, or one given by ``set_model_dir``)."""
        self.measured_bps: float | None = None
        self.profile = None
        """The agents profiled for this view's model (*Profile agents*), else the studio's profile is used."""
        self.runner = TaskRunner(self, name="expert-offload")
        self.job = ""
        """What the runner does now: "run" (Run on agents), else a measurement."""
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 8, 16, 8)
        header = panel_header("Expert offloading (EdgeMoE)", "")
        self.subtitle = header.findChildren(QLabel)[-1]
        lay.addWidget(header)
        self.source = QComboBox()
        self.source.addItems((MEASURED, WHAT_IF))
        self.source.setCurrentText(WHAT_IF)
        self.source.setAccessibleName("Problem source")
        self.source.setToolTip("Measured: a profiled device of the cluster (its compute times, memory budget and "
                               "storage bandwidth) with the studio's Mixtral checkpoint. What-if: the paper's "
                               "phone-class device; sizes, times and bit options are assumptions")
        self.device = QComboBox()
        self.device.setAccessibleName("Device")
        self.device.setToolTip("The profiled device that runs the model with its experts on storage")
        self.budget = QDoubleSpinBox(minimum=5, maximum=100, value=10, suffix=" % of the model", decimals=0)
        self.bandwidth = QDoubleSpinBox(minimum=0.01, maximum=100_000, value=200, suffix=" MB/s", decimals=2)
        self.bound = QDoubleSpinBox(minimum=0, maximum=50, value=5, suffix=" % perplexity", decimals=1)
        self.measure_button = QPushButton("Measure storage")
        self.measure_button.setToolTip("Read every expert of the checkpoint with the caches dropped (here: the local "
                                       "cluster's agents read these files) and use the measured bandwidth")
        self.profile_button = QPushButton("Profile agents")
        self.profile_button.setToolTip("Time each unit and one expert of the Mixtral on the connected agents (and "
                                       "measure the storage): the measured problem of this model")
        device_row = QHBoxLayout()
        device_row.addWidget(self.device, 1)
        device_row.addWidget(self.profile_button)
        bandwidth_row = QHBoxLayout()
        bandwidth_row.addWidget(self.bandwidth, 1)
        bandwidth_row.addWidget(self.measure_button)
        self.budget_label = QLabel("Memory budget")
        self.strategy = QComboBox()
        self.strategy.addItems(self.technique.strategy_names())
        self.plan_label = QLabel()
        self.plan_label.setWordWrap(True)
        controls = QGridLayout()  # two columns of three rows: readable at 1024x700 with room for the run
        controls.setColumnStretch(1, 1)
        controls.setColumnStretch(3, 1)
        for row, (left, left_w, right, right_w) in enumerate((
                ("Source", self.source, "Storage bandwidth", bandwidth_row),
                ("Device", device_row, "Accuracy bound", self.bound),
                (self.budget_label, self.budget, "Strategy", self.strategy))):
            for col, (label, w) in enumerate(((left, left_w), (right, right_w))):
                controls.addWidget(label if isinstance(label, QLabel) else QLabel(label), row, 2 * col)
                if isinstance(w, QHBoxLayout):
                    controls.addLayout(w, row, 2 * col + 1)
                else:
                    controls.addWidget(w, row, 2 * col + 1)
        controls.addWidget(QLabel("Plan"), 3, 0)
        controls.addWidget(self.plan_label, 3, 1, 1, 3)
        lay.addLayout(controls)
        run_row = QHBoxLayout()
        self.use_for_run = QPushButton("Use for Run")
        self.use_for_run.clicked.connect(self.use_plan_for_run)
        self.run_message = InlineMessage()
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(120)
        self.progress.setTextVisible(False)
        self.progress.hide()
        run_row.addWidget(self.use_for_run)
        run_row.addWidget(self.progress)
        run_row.addWidget(self.run_message, 1)
        run_row.addStretch()  # the button keeps its size while there is no message
        lay.addLayout(run_row)
        self.table = QTableWidget(0, len(self.HEADERS))
        self.table.setHorizontalHeaderLabels(self.HEADERS)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.setSelectionBehavior(QTableWidget.SelectRows)
        self.table.setSelectionMode(QTableWidget.SingleSelection)
        self.table.setToolTip("Select a row to pick its strategy; one that does not fit cannot be used for Run")
        self.table.currentCellChanged.connect(lambda row, _c, _pr, _pc: self._on_table_row_changed(row))
        self.bars = TokenTimeBars()
        compare = QWidget()
        compare_lay = QVBoxLayout(compare)
        compare_lay.setContentsMargins(0, 0, 0, 0)
        compare_lay.addWidget(self.table, 3)
        compare_lay.addWidget(self.bars, 2)
        self.run_box = ExpertRunBox()
        self.run_box.run_button.clicked.connect(lambda: self.run_on_agents())
        self.tabs = QTabWidget()
        self.tabs.addTab(compare, "Compare")
        self.tabs.addTab(self.run_box, "Run on agents")
        lay.addWidget(self.tabs, 1)
        for spin in (self.budget, self.bandwidth, self.bound):
            spin.valueChanged.connect(lambda _v: self.refresh())
        self.strategy.currentTextChanged.connect(lambda _t: self.refresh())
        self.device.currentTextChanged.connect(lambda _t: self.refresh())
        self.source.activated.connect(lambda _i: self._on_source_chosen())
        self.measure_button.clicked.connect(lambda: self.measure_storage())
        self.profile_button.clicked.connect(lambda: self.profile_on_agents())
        self.runner.task_finished.connect(lambda _id, out: self._on_task_finished(out))
        self.runner.task_failed.connect(lambda _id, msg: self._on_task_failed(msg))
        self.runner.status_reported.connect(lambda _id, text: self._on_status(text))
        self.runner.partial_result_reported.connect(lambda _id, value: self._on_partial(value))
        self.runner.busy_changed.connect(lambda busy: (self.progress.setVisible(busy), self._update_run_button()))
        self.runner.progress_reported.connect(lambda _id, done, total: (self.progress.setMaximum(max(1, int(total))),
                                                                        self.progress.setValue(int(done))))
        self._source_chosen = False
        for signal in (state.model_changed, state.profile_changed, getattr(state, "technique_models_changed", None)):
            if signal is not None:
                signal.connect(lambda *_: self._on_studio_changed())
        for signal in (state.cluster_changed, state.problem_changed, state.agents_changed):
            signal.connect(lambda *_: self._update_run_button())
        self._on_studio_changed()

    # -- the problem -------------------------------------------------------------------------
    def measured(self) -> bool:
        return self.source.currentText() == MEASURED

    def set_model_dir(self, path: str) -> None:
        """Plan and run this Mixtral checkpoint (the demo tour's hook; the studio's model otherwise)."""
        self.model_dir = str(path)
        self._on_studio_changed()

    def _model(self) -> str:
        """This view's checkpoint: one given to it, the studio's model for this technique (the demo's tour:
        ``StudioState.technique_models``), else the studio's model."""
        own = getattr(self.state, "technique_models", {}).get("expert-offload", "")
        return self.model_dir or own or getattr(self.state, "model_path", "")

    def measured_profile(self):
        """The profile the measured problem uses: the view's own (*Profile agents*), else the studio's."""
        return self.profile or getattr(self.state, "profile", None)

    def measured_blocker(self) -> str:
        """Why the measured problem cannot be built ("" when it can): what the operator must do."""
        profile = self.measured_profile()
        if not self._model():
            return "no model: load the Mixtral checkpoint the agents run (Model)"
        if profile is None or not any(t.expert_decode_s for t in profile.times):
            return "no profile of the Mixtral: press Profile agents (or profile the cluster with it)"
        return ""

    def profile_on_agents(self) -> None:
        """Profile the connected agents for this view's model (a worker); its problem becomes theirs."""
        agents = getattr(self.state, "agents", None)
        if agents is None or not self._model():
            self.run_message.show_lines(["connect agents and load a Mixtral checkpoint first"], "Cannot profile:")
            return
        if not self.runner.is_busy():
            self.runner.start(_profile_job, agents, self._model())

    def _on_studio_changed(self) -> None:
        """A new profile or model: offer its devices, and use the measured problem unless the
        operator chose the what-if one."""
        profile = self.measured_profile()
        devices = [t.device for t in profile.times] if profile is not None else []
        current = self.device.currentText()
        self.device.blockSignals(True)
        self.device.clear()
        self.device.addItems(devices)
        source = getattr(getattr(self.state, "problem", None), "source", "")
        pick = current if current in devices else (source if source in devices else (devices[0] if devices else ""))
        self.device.setCurrentText(pick)
        self.device.blockSignals(False)
        if not self._source_chosen:
            self.source.setCurrentText(WHAT_IF if self.measured_blocker() else MEASURED)
        self._on_source_changed()

    def _on_source_chosen(self) -> None:
        self._source_chosen = True
        self._on_source_changed()

    def _on_source_changed(self) -> None:
        measured = self.measured()
        self.device.setEnabled(measured)
        self.measure_button.setVisible(measured)
        self.budget_label.setText("Experts held" if measured else "Memory budget")
        self.budget.setSuffix(" % of the experts at most" if measured else " % of the model")
        self.budget.setToolTip("Measured: the device's memory budget, capped at the resident weights and this share "
                               "of all the experts (to try offloading on a device that would hold them all)"
                               if measured else "The paper-shaped device's memory, as a share of the whole model")
        self.budget.blockSignals(True)
        self.bandwidth.blockSignals(True)
        if measured:
            self.budget.setValue(50)
            stored = stored_bandwidth_bps(self._model()) if self._model() else None
            self.measured_bps = stored
            if stored is not None:
                self.bandwidth.setValue(stored / 1e6)
        else:
            self.budget.setValue(10)
            self.bandwidth.setValue(200)
        self.budget.blockSignals(False)
        self.bandwidth.blockSignals(False)
        self.subtitle.setText(self._subtitle())
        if measured and self.measured_bps is None and not self.measured_blocker() and not self.runner.is_busy():
            self.measure_storage()  # a problem without a measured bandwidth is not the cluster's
        self.refresh()
        self._update_run_button()

    def _subtitle(self) -> str:
        if not self.measured():
            why = self.measured_blocker()
            return ("Paper-shaped scenario: sizes, times and bit options are assumptions"
                    + (f" (measured: {why})" if why else ""))
        why = self.measured_blocker()
        if why:
            return f"Measured cluster unavailable: {why}"
        cost = stored_read_cost(self._model()) if self.measured_bps is not None else None
        storage = (f"storage {self.measured_bps / 1e6:.0f} MB/s measured"
                   + (f" + {cost[1] * 1e3:.2f} ms a read (page-cached, as the agents read it)" if cost else "")
                   if self.measured_bps is not None else "storage not measured yet")
        return f"Measured on {self.device.currentText()}: its compute times and memory budget, {storage}"

    def problem(self):
        """The measured device's problem, or the what-if scenario's (``FormatError``: cannot build it)."""
        import msgspec

        if self.measured():
            why = self.measured_blocker()
            if why:
                raise EdgeShardError(why)
            base = cluster_problem(self.measured_profile(), self.device.currentText(), self._model(),
                                   bandwidth_bps=self.bandwidth.value() * 1e6, expert_share=self.budget.value() / 100)
        else:
            base = paper_shaped(self.budget.value() / 100.0, self.bandwidth.value() * 1e6)
        return msgspec.structs.replace(base, accuracy_bound=self.bound.value() / 100.0)

    def measure_storage(self) -> None:
        if self._model() and not self.runner.is_busy():
            self.runner.start(_storage_job, self._model())

    def _on_status(self, text: str) -> None:
        if self.job == "run":
            self.run_box.status.setText(text)
        else:
            self.run_message.show_lines([text])

    def _on_partial(self, value) -> None:
        if self.job == "run" and isinstance(value, tuple) and len(value) == 2:
            self.run_box.take(value)

    def run_on_agents(self) -> None:
        """Run the chosen strategy's plan on its device from this view (recorded; the studio's plan stays)."""
        why = self.run_blocker() or ("no agents connected: start the demo cluster or connect agents"
                                     if getattr(self.state, "agents", None) is None else "") or \
            ("busy: wait for the measurement to end" if self.runner.is_busy() else "")
        if why:
            self.run_box.message.show_lines([why], "Cannot run:")
            return
        import msgspec

        out, _ = self.outcome()
        from core.runs.prediction import PlanOrigin

        offload_plan = msgspec.structs.replace(out.plan, device=self.run_device())
        try:
            plan = self.technique.run_plan(offload_plan, self._model())
        except EdgeShardError as err:
            self.run_box.message.show_lines([str(err)], "Cannot run:")
            return
        prompts = self.run_box.prompt_list()
        if not prompts:
            self.run_box.message.show_lines(["type a prompt (several: separated by |)"], "Cannot run:")
            return
        self.job = "run"
        self.run_box.started([plan.stages[0].device, f"{plan.stages[0].device}:storage"])
        self.runner.start(run_job, self.state.agents, plan, self._model(), prompts, self.run_box.max_tokens.value(),
                          getattr(self.state, "workspace", ""), PlanOrigin(self.technique, self.problem(), offload_plan))

    def _on_task_finished(self, out) -> None:
        job, self.job = self.job, ""
        if job == "run":
            self.run_box.finished(out)
            self.state.log(f"expert-offload run on the agents: {self.run_box.status.text()}")
            return
        if isinstance(out, float):
            self._on_storage_measured(out)
            return
        self.profile = out
        self.run_message.show_lines([])
        self.state.log(f"agents profiled for {self._model()} (expert offloading)")
        self._source_chosen = False  # the measured problem now exists: show it
        self._on_studio_changed()

    def _on_storage_measured(self, bps: float) -> None:
        self.measured_bps = bps
        self.run_message.show_lines([])
        if self.measured():
            self.bandwidth.setValue(bps / 1e6)  # refreshes
            self.subtitle.setText(self._subtitle())
        self.state.log(f"expert storage read at {bps / 1e6:.0f} MB/s ({self._model()})")

    def _on_task_failed(self, msg: str) -> None:
        job, self.job = self.job, ""
        if job == "run":
            self.run_box.failed(msg)
            self.state.log(f"expert-offload run failed: {msg}", "error")
            return
        self.run_message.show_lines([msg], "Measuring failed:")

    # -- running the plan ------------------------------------------------------------------
    def run_device(self) -> str | None:
        """Where the run goes: the measured device; for the what-if problem the prompt's source device
        of the studio's problem, else the cluster's first."""
        if self.measured() and self.device.currentText():
            return self.device.currentText()
        problem = getattr(self.state, "problem", None)
        if problem is not None:
            return problem.source
        cluster = getattr(self.state, "cluster", None)
        return cluster.device_ids()[0] if cluster is not None and cluster.devices else None

    def outcome(self):
        try:
            problem = self.problem()
        except EdgeShardError as err:
            return None, str(err)
        return self.technique.run_strategy(problem, self.strategy.currentText(), "latency"), ""

    def run_blocker(self) -> str:
        """Why *Use for Run* cannot adopt the chosen strategy ("" when it can)."""
        if not self._model() or self.run_device() is None:
            return "load a Mixtral checkpoint (Model) and connect agents first"
        out, why = self.outcome()
        if out is None:
            return why
        if out.status not in ADOPTABLE:
            return f"{out.strategy} does not fit ({out.status}{': ' + out.error if out.error else ''})"
        return ""

    def _update_run_button(self) -> None:
        why = self.run_blocker()
        self.use_for_run.setEnabled(not why)
        self.use_for_run.setToolTip("Make this strategy's buffer options the Run screen's plan: the model checkpoint "
                                    "with its experts on storage, on the chosen device")
        say_why_disabled({self.use_for_run: why})
        self.measure_button.setEnabled(bool(self._model()) and not self.runner.is_busy())
        run_why = why or ("no agents connected: start the demo cluster or connect agents"
                          if getattr(self.state, "agents", None) is None else "") or \
            ("busy: a measurement or run is in progress" if self.runner.is_busy() else "")
        self.run_box.run_button.setEnabled(not run_why)
        self.run_box.run_button.setToolTip("Run the chosen strategy's plan on its device from here: compute and "
                                           "storage lanes, the heat map live, recorded for Sessions")
        say_why_disabled({self.run_box.run_button: run_why})
        can_profile = bool(self._model()) and getattr(self.state, "agents", None) is not None
        self.profile_button.setEnabled(can_profile and not self.runner.is_busy())
        say_why_disabled({self.profile_button: "" if can_profile else
                          "connect agents and load a Mixtral checkpoint first",
                          self.measure_button: "" if self._model() else "load a Mixtral checkpoint first"})

    def use_plan_for_run(self) -> None:
        """The chosen strategy's plan on the real checkpoint (``Technique.run_plan``) becomes the studio's plan."""
        import msgspec

        why = self.run_blocker()
        if why:
            self.run_message.show_lines([why], "Cannot use this plan:")
            return
        out, _ = self.outcome()
        device = self.run_device()
        plan = msgspec.structs.replace(out.plan, device=device)
        try:
            run_plan = self.technique.run_plan(plan, self._model())
        except EdgeShardError as err:
            self.run_message.show_lines([str(err)], "Cannot use this plan:")
            return
        if hasattr(self.state, "set_technique_models"):  # the Run screen's Model follows: this plan's checkpoint
            self.state.set_technique_models({**self.state.technique_models, "expert-offload": self._model()})
        from core.runs.prediction import PlanOrigin

        # the Run screen's ghosts: EdgeMoE's simulated schedule of this plan, storage reads included
        self.state.set_plan(run_plan, origin=PlanOrigin(self.technique, self.problem(), plan))
        self.run_message.show_lines([f"The Run screen runs {run_plan.model} on {device} with {plan.slots} expert "
                                     f"slots, preload {plan.preload}, eviction {plan.policy}."])

    def refresh(self) -> None:
        out, why = self.outcome()
        self._update_run_button()
        if out is None:
            self.plan_label.setText(why)
            return
        if out.plan is None:
            self.plan_label.setText(f"{out.status}: {out.error}")
            return
        c = out.cost
        self.plan_label.setText(
            f"{out.plan.slots} experts in the buffer at {out.plan.bits.name}, preload {out.plan.preload} per layer, "
            f"{'whole layers streamed, ' if out.plan.whole_layers else ''}eviction {out.plan.policy}; "
            f"{c.memory_bytes / 1e6:.1f} MB of {self.problem().memory_budget_bytes / 1e6:.1f} MB "
            f"({out.status}); {1 / c.latency_per_token_s:.2f} tokens/s")

    def auto_solve(self) -> None:
        self.strategy.setCurrentText(self.technique.exact)
        self.refresh()

    def compare(self) -> None:
        try:
            outs = self.technique.compare(self.problem(), "latency")
        except EdgeShardError as err:
            self.run_message.show_lines([str(err)], "Cannot compare:")
            return
        rows, bars = [], []
        for o in outs:
            c, plan = o.cost, o.plan
            rows.append([o.strategy, o.status,
                         f"{o.tokens_per_s:.2f}" if o.tokens_per_s else "—", str(plan.slots) if plan else "—",
                         plan.bits.name if plan else "—", str(plan.preload) if plan else "—",
                         f"{c.memory_bytes / 1e6:.1f}" if c else "—", f"{c.io_stall_s * 1e3:.1f}" if c else "—"])
            if c:
                bars.append((o.strategy, c.compute_s, c.io_stall_s))
        fill_table(self.table, rows, tooltips=[o.error for o in outs])  # why a strategy failed, not widening it
        self.bars.show_rows(bars)

    def _on_table_row_changed(self, row: int) -> None:
        item = self.table.item(row, 0) if row >= 0 else None
        if item is not None:
            self.strategy.setCurrentText(item.text())

    def shutdown(self) -> None:
        self.runner.shutdown(timeout_s=10.0)

"""The EPD plan view: a problem in (measured on the connected agents — their phase costs, exactly
those agents, a workload they serve — or the what-if scenario of illustrative edge devices); the
configuration search's progress, its best configurations beside the aggregated and PD-only
baselines, the picked pools, a request timeline and SLO attainment as the rate grows (simulated);
and *Run on agents*: the selected layout served for real, recorded, with its measured figures
beside the prediction (``agent_run``).

Measuring, searching and running go through one worker (``TaskRunner``); each trial arrives as a
``SearchProgress``.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QComboBox, QDoubleSpinBox, QFileDialog, QHBoxLayout, QHeaderView, QLabel, QProgressBar, QPushButton, QSpinBox, QSplitter,
    QTableWidget, QTabWidget, QVBoxLayout, QWidget,
)

from core.errors import EdgeShardError
from core.formats import load
from core.techniques.phase_disaggregation.baselines import aggregated, pd_only
from core.techniques.phase_disaggregation.goodput import TARGET, RatePoint, attainment_curve
from core.techniques.phase_disaggregation.on_agents import (
    LayoutRun, agent_slo, agent_workload, cluster_problem, per_device_text, served_problem,
)
from core.techniques.phase_disaggregation.scenarios import illustrative_costs, image_heavy_workload
from core.techniques.phase_disaggregation.search import Candidate, SearchProgress, search
from core.techniques.phase_disaggregation.simulator import CachePeak, simulate_pools
from core.techniques.phase_disaggregation.types import SLO, EpdProblem, PhaseCosts, PoolConfig, RequestMetrics
from gui.techniques.phase_disaggregation.agent_run import (
    MEASURED, SOURCES, WHAT_IF, AgentRunTab, measure_job, run_job,
)
from gui.techniques.phase_disaggregation.drawings import PoolsDiagram, RequestTimeline, pools_text
from gui.widgets import InlineMessage, fill_table, panel_header, say_why_disabled
from gui.workers import TaskRunner

LINES = {"search's pick": "#e45756", "aggregated": "#4c78a8", "pd-only": "#f58518"}
MEASURE_TEXT = "Measure phases on agents"
REPLACES = ("it loads EPD's encode, prefill and decode phases on each agent in turn, in place of what they hold "
            "(a layer-sharding plan's stages are loaded again by its next run)")
"""Said beside the button and in its tooltip: why measuring is never started by the view itself."""


class EpdPlanResult(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the view draws after a search (built on the worker)."""

    best: Candidate
    baselines: tuple[tuple[str, Candidate], ...]
    top: tuple[Candidate, ...]
    """The best configurations found, best first."""
    metrics: tuple[RequestMetrics, ...]
    """The picked configuration's requests at the workload's rate."""
    caches: tuple[CachePeak, ...]
    curves: tuple[tuple[str, tuple[RatePoint, ...]], ...]
    elapsed_s: float
    trials: int


def plan_epd(reporter, problem: EpdProblem, trials: int, served_only: bool = False) -> EpdPlanResult:
    """Baselines, the search seeded with them, then the picked configuration's timeline and the
    attainment curves (the worker's job; pure apart from the reporter). ``served_only``: only
    configurations the agents' real run serves (a measured problem's)."""
    reporter.status("evaluating the baselines")
    base = [("aggregated", aggregated(problem, served_only=served_only))]
    if len(problem.devices) >= 2:
        base.append(("pd-only", pd_only(problem, served_only=served_only)))
    result = search(problem, trials=trials, seeds=[c.config for _, c in base], served_only=served_only,
                    reporter=reporter)
    reporter.status("simulating the picked configuration")
    sim = simulate_pools(problem.costs, problem.workload, result.best.config)
    top = sorted({msgspec.json.encode(c.config): c for c in result.candidates}.values(), key=lambda c: -c.score)[:5]
    hi = max([result.best.goodput_rps] + [c.goodput_rps for _, c in base] + [problem.workload.rate_rps or 1.0])
    rates = [hi * f for f in (0.1, 0.25, 0.4, 0.55, 0.7, 0.85, 1.0, 1.15, 1.3, 1.5)]
    curves = [(name, tuple(attainment_curve(problem.costs, problem.workload, c.config, problem.slo, rates)))
              for name, c in [("search's pick", result.best)] + base]
    return EpdPlanResult(best=result.best, baselines=tuple(base), top=tuple(top), metrics=sim.metrics,
                         caches=sim.caches, curves=tuple(curves), elapsed_s=result.elapsed_s,
                         trials=len(result.candidates))



class PhaseDisaggregationPlanView(QWidget):
    """Plan screen view of the ``phase-disaggregation`` technique."""

    TABLE_HEADERS = ("configuration", "devices", "pools", "batch E/P/D", "policy", "goodput (req/s)",
                     "TTFT p50 (s)", "on agents")

    def __init__(self, state, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.costs: PhaseCosts = illustrative_costs()
        """The what-if calibration (illustrative, or a loaded file)."""
        self.measured_costs: PhaseCosts | None = None
        """Measured on the connected agents (``Measure phases on agents``)."""
        self.model_dir = ""
        """The Llava checkpoint the agents measure and serve."""
        self.result: EpdPlanResult | None = None
        self.trials_seen: list[SearchProgress] = []
        self.job = ""
        self.runner = TaskRunner(self, name="epd-search")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 8, 16, 8)
        self.header = panel_header("Encode/prefill/decode disaggregation (EPD)",
                                   "An image-heavy workload on a device budget; simulated, not measured")
        lay.addWidget(self.header)
        self.subtitle = self.header.findChildren(QLabel)[-1]
        self.source = QComboBox()
        self.source.addItems(SOURCES)
        self.source.setCurrentText(WHAT_IF)
        self.source.setAccessibleName("Problem source")
        self.source.setToolTip("Measured: the phases timed on the connected agents, planned for exactly those "
                               "agents and a workload they serve. What-if: illustrative edge devices (or loaded costs)")
        self.model_button = QPushButton("Llava model…")
        self.model_button.setToolTip("The Llava checkpoint the agents measure and serve")
        self.measure_button = QPushButton(MEASURE_TEXT)
        self.devices = QSpinBox(minimum=1, maximum=64, value=8, prefix="devices ")
        self.devices.setAccessibleName("Devices")
        self.requests = QSpinBox(minimum=1, maximum=200, value=6, suffix=" requests")
        self.requests.setAccessibleName("Requests")
        self.requests.setToolTip("Requests of the workload the agents serve (one or two images, short prompts)")
        self.rate = QDoubleSpinBox(minimum=0.05, maximum=1000, value=1.0, decimals=2, suffix=" req/s")
        self.rate.setAccessibleName("Request rate")
        self.ttft = QDoubleSpinBox(minimum=0.001, maximum=600, value=2.5, decimals=3, prefix="TTFT ≤ ", suffix=" s")
        self.ttft.setAccessibleName("TTFT SLO")
        self.tpot = QDoubleSpinBox(minimum=0.1, maximum=10_000, value=80, decimals=1, prefix="TPOT ≤ ", suffix=" ms")
        self.tpot.setAccessibleName("TPOT SLO")
        self.trials = QSpinBox(minimum=1, maximum=500, value=30, suffix=" trials")
        self.trials.setAccessibleName("Trials")
        self.costs_button = QPushButton("Costs…")
        self.costs_button.setToolTip("Load a measured calibration (edgeshard.epd-costs JSON) as the what-if costs")
        self.search_button = QPushButton("Search")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.record_button = QPushButton("Record")
        self.record_button.setEnabled(False)
        self.run_button = QPushButton("Run on agents")
        self.last_problem: EpdProblem | None = None
        for widgets in ((self.source, self.model_button, self.measure_button, self.devices, self.requests),
                        (self.rate, self.ttft, self.tpot, self.trials)):
            row = QHBoxLayout()
            for w in widgets:
                row.addWidget(w)
            row.addStretch(1)
            lay.addLayout(row)
        status = QHBoxLayout()
        for w in (self.costs_button, self.search_button, self.stop_button, self.record_button, self.run_button):
            status.addWidget(w)
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(120)
        self.progress.setTextVisible(False)
        status.addWidget(self.progress)
        self.status = QLabel(f"calibration: {self.costs.source}")
        self.status.setWordWrap(True)
        status.addWidget(self.status, 1)
        lay.addLayout(status)
        self.message = InlineMessage()
        lay.addWidget(self.message)

        split = QSplitter(Qt.Horizontal)
        self.pools = PoolsDiagram()
        split.addWidget(self.pools)
        self.tabs = QTabWidget()
        self.tabs.setUsesScrollButtons(False)  # short titles that fit at 1024 px; elided, never scrolled, if not
        self.tabs.setElideMode(Qt.ElideRight)
        self.table = QTableWidget(0, len(self.TABLE_HEADERS))
        self.table.setHorizontalHeaderLabels(self.TABLE_HEADERS)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)  # every column at 1024 px
        self.table.setSelectionBehavior(QTableWidget.SelectRows)
        self.table.setSelectionMode(QTableWidget.SingleSelection)
        self.table.setToolTip("Select a row to see its pools (the aggregated and PD-only baselines too); "
                              "Run on agents serves the selected row's layout")
        self.row_configs: list[PoolConfig] = []
        self.row_names: list[str] = []
        self.tabs.setTabToolTip(self.tabs.addTab(self.table, "Layouts"), "Configurations searched")
        self.timeline = RequestTimeline()
        self.tabs.setTabToolTip(self.tabs.addTab(self.timeline, "Timeline"), "Request timeline")
        self.slo_plot = pg.PlotWidget()
        self.slo_plot.setLabel("bottom", "request rate (req/s)")
        self.slo_plot.setLabel("left", "SLO attainment")
        self.slo_plot.setYRange(0, 1.05)
        self.slo_plot.addLegend(offset=(-10, -10))
        self.tabs.setTabToolTip(self.tabs.addTab(self.slo_plot, "SLO"), "SLO attainment against request rate")
        self.search_plot = pg.PlotWidget()
        self.search_plot.setLabel("bottom", "trial")
        self.search_plot.setLabel("left", "goodput (req/s)")
        self.search_plot.addLegend(offset=(10, 10))
        self.trial_dots = self.search_plot.plot([], [], pen=None, symbol="o", symbolSize=6, name="trial")
        self.best_line = self.search_plot.plot([], [], pen=pg.mkPen("#e45756", width=2), stepMode=None,
                                               name="best so far")
        self.tabs.setTabToolTip(self.tabs.addTab(self.search_plot, "Search"), "Goodput of each trial of the search")
        self.run_tab = AgentRunTab()
        self.tabs.setTabToolTip(self.tabs.addTab(self.run_tab, "Run"), "Serve the selected layout on the agents")
        split.addWidget(self.tabs)
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 3)
        split.setSizes([230, 900])
        lay.addWidget(split, 1)

        self.search_button.clicked.connect(lambda: self.auto_solve())
        self.stop_button.clicked.connect(lambda: self.runner.request_stop())
        self.costs_button.clicked.connect(lambda: self._choose_costs())
        self.model_button.clicked.connect(lambda: self._choose_model())
        self.measure_button.clicked.connect(lambda: self.measure_on_agents())
        self.record_button.clicked.connect(lambda: self.record())
        self.run_button.clicked.connect(lambda: self.run_on_agents())
        self.source.currentTextChanged.connect(lambda _t: self._on_source_changed())
        self.table.currentCellChanged.connect(lambda row, _c, _pr, _pc: self.show_row(row))
        state.workspace_changed.connect(lambda _p: self._update_buttons())
        state.agents_changed.connect(lambda _a: self._update_buttons())
        state.offline_changed.connect(lambda _o: self._update_buttons())
        state.model_changed.connect(lambda _n: self._adopt_studio_model())
        if hasattr(state, "technique_models_changed"):  # the demo's tour gives EPD a Llava of its own
            state.technique_models_changed.connect(lambda _m: self._adopt_studio_model())
        self.runner.partial_result_reported.connect(self._on_partial)
        self.runner.status_reported.connect(lambda _id, text: self.status.setText(text))
        self.runner.progress_reported.connect(self._on_progress)
        self.runner.task_finished.connect(self._on_finished)
        self.runner.task_failed.connect(lambda _id, msg: self._failed(msg))
        self.runner.task_cancelled.connect(lambda _id: self._cancelled())
        self._adopt_studio_model()
        self._on_source_changed()

    # -- inputs ---------------------------------------------------------------------------
    def measured(self) -> bool:
        return self.source.currentText() == MEASURED

    def agent_names(self) -> list[str]:
        agents = self.state.agents
        if agents is None:
            return []
        return [d for d in agents.endpoints if d not in self.state.offline_devices]

    def slo(self) -> SLO:
        return SLO(ttft_s=self.ttft.value(), tpot_s=self.tpot.value() / 1e3)

    def problem(self, requests: int = 120) -> EpdProblem:
        """The measured cluster's problem (its costs, its agents, a workload they serve) or the what-if one."""
        if self.measured():
            if self.measured_costs is None:
                raise EdgeShardError(f"no costs measured on these agents yet: press {MEASURE_TEXT}")
            workload = agent_workload(requests=self.requests.value(), rate_rps=self.rate.value())
            return cluster_problem(self.measured_costs, self.agent_names(), workload, self.slo())
        return EpdProblem(name="image-heavy", costs=self.costs,
                          workload=image_heavy_workload(rate_rps=self.rate.value(), requests=requests),
                          slo=self.slo(), devices=tuple(f"dev{i}" for i in range(self.devices.value())))

    def set_model_dir(self, path: str) -> bool:
        """Measure and serve this Llava checkpoint (the demo tour's hook); a non-Llava one is refused inline."""
        from core.models.multimodal import check_multimodal_dir

        try:
            check_multimodal_dir(path)
        except EdgeShardError as err:
            self.message.show_lines([str(err)], "Not a Llava checkpoint:")
            return False
        self.model_dir = str(path)
        self.model_button.setText(f"Model: {Path(path).name}")
        self.message.show_lines([])
        self._update_buttons()
        return True

    def _adopt_studio_model(self) -> None:
        """The studio's model for EPD (``StudioState.technique_models``, the demo's tour), else the studio's
        model when it is a Llava checkpoint (a Llama one stays the layer-sharding model)."""
        own = getattr(self.state, "technique_models", {}).get("phase-disaggregation", "")
        if own:
            self.set_model_dir(own)
            return
        path = getattr(self.state, "model_path", "")
        if path and (Path(path) / "config.json").is_file():
            try:
                import json

                if json.loads((Path(path) / "config.json").read_text()).get("model_type") == "llava":
                    self.set_model_dir(path)
            except ValueError:
                pass

    def _choose_model(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Llava checkpoint")
        if path:
            self.set_model_dir(path)

    def load_costs(self, path: str) -> bool:
        """Use a calibration file; a bad one leaves the current calibration and says why."""
        try:
            self.costs = load(path, PhaseCosts)
        except EdgeShardError as err:
            self.status.setText(f"costs not loaded: {err}")
            return False
        self.source.setCurrentText(WHAT_IF)
        self.status.setText(f"calibration: {self.costs.source or path}")
        return True

    def _choose_costs(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "EPD phase costs", "", "JSON (*.json)")
        if path:
            self.load_costs(path)

    def _on_source_changed(self) -> None:
        measured = self.measured()
        self.devices.setVisible(not measured)
        self.costs_button.setVisible(not measured)
        self.requests.setVisible(measured)
        costs = self.measured_costs if measured else self.costs
        self.subtitle.setText(
            ("The connected agents: phases timed on them, a workload they serve" if measured else
             "What-if: an image-heavy workload on illustrative devices; simulated, not measured")
            + (f" — costs {costs.source}" if costs is not None and costs.source else ""))
        self._update_buttons()
        if measured and self.measured_costs is None:  # never measured by itself: it replaces what the agents hold
            self.message.show_lines([self.measure_blocker() or f"press {MEASURE_TEXT}: {REPLACES}"],
                                    "Not measured yet:")

    # -- the menus' actions ---------------------------------------------------------------
    def measure_blocker(self) -> str:
        if self.runner.is_busy():
            return "a search or run is in progress: Stop it first"
        if not self.agent_names():
            return "no agents connected: start the demo cluster or connect an agents.json (File menu)"
        if not self.model_dir:
            return "no Llava checkpoint: choose one (Llava model…)"
        return ""

    def measure_on_agents(self) -> None:
        """Time encode, prefill and decode on the connected agents (a worker; Stop cancels it); the
        problem becomes theirs. Only ever the operator's action: it replaces what the agents held."""
        why = self.measure_blocker()
        if why:
            self.message.show_lines([why], "Cannot measure:")
            return
        self.state.log(f"EPD: measuring phases on {', '.join(self.agent_names())}: {REPLACES}")
        self._start("measure", measure_job, self.state.agents.link, self.model_dir, self.agent_names())

    def auto_solve(self, requests: int = 120) -> None:
        """Start the search (baselines first); results arrive through the runner."""
        if self.runner.is_busy():
            return
        try:
            problem = self.problem(requests)
        except EdgeShardError as err:
            self.message.show_lines([str(err)], "Cannot search:")
            return
        self.trials_seen = []
        self.trial_dots.setData([], [])
        self.best_line.setData([], [])
        self.last_problem = problem
        self._start("search", plan_epd, problem, self.trials.value(), self.measured())

    def compare(self) -> None:
        """The baselines are compared in every search: start one."""
        self.auto_solve()

    def selected_layout(self) -> tuple[str, PoolConfig] | None:
        if self.result is None:
            return None
        row = self.table.currentRow()
        if 0 <= row < len(self.row_configs):
            return self.row_names[row], self.row_configs[row]
        return "search's pick", self.result.best.config

    def run_blocker(self) -> str:
        """Why *Run on agents* cannot serve the selected layout now ("" when it can): what to do."""
        why = self.measure_blocker()
        if why:
            return why
        if self.result is None or self.last_problem is None:
            return f"no layout yet: {MEASURE_TEXT}, then Search"
        if self.last_problem.name != "measured cluster":
            return f"the layout is planned for the what-if devices: {MEASURE_TEXT}, then Search"
        _, config = self.selected_layout()
        return served_problem(config, self.agent_names())

    def run_on_agents(self) -> None:
        """Serve the selected row's layout (the pick by default) on the agents, recorded in the workspace."""
        why = self.run_blocker()
        if why:
            self.message.show_lines([why], "Cannot run on agents:")
            return
        name, config = self.selected_layout()
        self._start("run", run_job, self.state.agents.link, self.model_dir, self.last_problem, config, name,
                    self.state.workspace)

    def _start(self, job: str, fn, *args, **kwargs) -> None:
        self.job = job
        self.message.show_lines([])
        self.progress.setValue(0)
        self.runner.start(fn, *args, **kwargs)
        self._update_buttons()

    def shutdown(self) -> None:
        self.runner.shutdown(timeout_s=30.0)

    # -- results --------------------------------------------------------------------------
    def _on_progress(self, _id: int, done: float, total: float) -> None:
        self.progress.setMaximum(max(1, int(total)))
        self.progress.setValue(int(done))

    def _on_partial(self, _id: int, value) -> None:
        if not isinstance(value, SearchProgress):
            return
        self.trials_seen.append(value)
        xs = [p.trial for p in self.trials_seen]
        self.trial_dots.setData(xs, [p.candidate.goodput_rps for p in self.trials_seen])
        steps_x = [x for x in xs for _ in (0, 1)][1:] + [xs[-1]]
        steps_y = [p.best.goodput_rps for p in self.trials_seen for _ in (0, 1)]
        self.best_line.setData(steps_x, steps_y)

    def _cancelled(self) -> None:
        if self.job == "measure":  # the agents hold some of EPD's phases now, the costs stay as they were
            self._ended("measuring stopped: the costs are unchanged; the agents keep the EPD phases loaded so far")
        else:
            self._ended(f"{self.job or 'search'} stopped")

    def _ended(self, text: str) -> None:
        self.status.setText(text)
        self._update_buttons()

    def _failed(self, msg: str) -> None:
        verb = {"measure": "measuring", "run": "the run on the agents"}.get(self.job, "search")
        self.message.show_lines([msg], f"{verb[0].upper()}{verb[1:]} failed:")
        self._ended(f"{verb} failed")
        self.state.log(f"EPD {verb} failed: {msg}", "error")

    def _update_buttons(self) -> None:
        busy = self.runner.is_busy()
        self.search_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)
        ready = self.result is not None and bool(self.state.workspace) and not busy
        self.record_button.setEnabled(ready)
        say_why_disabled({
            self.record_button: "" if ready else ("Open a workspace (File) to record runs in"
                                                  if not self.state.workspace else "Search first"),
            self.measure_button: self.measure_blocker(),
            self.run_button: self.run_blocker(),
            self.search_button: "a search or run is in progress" if busy else "",
            self.stop_button: "" if busy else "nothing in progress"})
        self.measure_button.setEnabled(not self.measure_blocker())
        self.run_button.setEnabled(not self.run_blocker())
        if ready:
            self.record_button.setToolTip("Store the picked configuration's simulated run in the workspace "
                                          "(Sessions replays it)")
        if not self.run_blocker():
            self.run_button.setToolTip("Serve the selected layout's workload on the agents for real; recorded "
                                       "beside the simulator's prediction")
        if not self.measure_blocker():
            self.measure_button.setToolTip("Time encode, prefill and decode on the connected agents (Stop "
                                           f"cancels): the problem becomes theirs. {REPLACES[0].upper()}{REPLACES[1:]}")

    def record(self) -> int | None:
        """The picked configuration's simulated run, stored as a predicted run of session ``epd``."""
        from core.sessions.store import SessionStore
        from core.techniques.phase_disaggregation.simulator import record_simulation

        if self.result is None or self.last_problem is None or not self.state.workspace:
            return None
        p, cfg = self.last_problem, self.result.best.config
        sim = simulate_pools(p.costs, p.workload, cfg, record=True)
        try:
            with SessionStore(self.state.workspace) as store:
                run_id = record_simulation(store, store.create_session("epd"), sim, model="simulated",
                                           workload=p.workload, pools=cfg, slo=p.slo)
        except EdgeShardError as err:
            self.status.setText(f"not recorded: {err}")
            return None
        self.status.setText(f"recorded the picked configuration's simulated run as run {run_id} (session epd)")
        return run_id

    def show_row(self, row: int) -> None:
        """The pools of the table's row ``row`` (a search's configuration or a baseline); the
        multimodal caches' fill is known only for the pick (the only one simulated at the rate)."""
        if self.result is None or not 0 <= row < len(self.row_configs):
            return
        cfg = self.row_configs[row]
        self.pools.show_pools(cfg, self.result.caches if cfg == self.result.best.config else ())
        self._update_buttons()

    def _on_finished(self, _id: int, result) -> None:
        if isinstance(result, PhaseCosts):
            self.show_measured(result)
        elif isinstance(result, LayoutRun):
            self.show_run(result)
        else:
            self.show_result(result)

    def show_measured(self, costs: PhaseCosts) -> None:
        """Measured costs become the problem's; the SLOs are scaled to them (``agent_slo``)."""
        self.measured_costs = costs
        slo = agent_slo(costs, agent_workload(requests=self.requests.value(), rate_rps=self.rate.value()))
        self.ttft.setValue(slo.ttft_s)
        self.tpot.setValue(slo.tpot_s * 1e3)
        self.source.setCurrentText(MEASURED)
        self._on_source_changed()
        where = f"every phase on each of {len(costs.devices)} agents" if costs.devices else "the phases"
        self._ended(f"measured {where} (hover for the figures); SLOs scaled to them — Search next")
        self.status.setToolTip(per_device_text(costs))
        self.state.log(f"EPD phase costs {costs.source}: {per_device_text(costs)}")

    def show_run(self, run: LayoutRun) -> None:
        self.run_tab.show_run(run)
        self.tabs.setCurrentWidget(self.run_tab)
        m = run.measured
        self._ended(f"served {m.requests} requests with {run.layout}: TTFT p50 {m.ttft_p50_s * 1e3:.0f} ms, "
                    f"SLO met by {m.attainment:.0%}"
                    + (f"; recorded as run {run.run_id}" if run.run_id is not None else ""))
        self.state.log(f"EPD run on the agents ({run.layout}): {m.requests} requests, recorded as run {run.run_id}")

    def show_result(self, result: EpdPlanResult) -> None:
        self.result = result
        b = result.best
        costs = self.last_problem.costs if self.last_problem is not None else self.costs
        self.timeline.show_metrics(result.metrics)
        rows = [(f"#{i + 1} {c.config.disaggregation}", c) for i, c in enumerate(result.top)]
        rows += [(name, c) for name, c in result.baselines]
        self.row_configs = [c.config for _, c in rows]
        self.row_names = [name for name, _ in rows]
        agents = self.agent_names()
        measured = self.last_problem is not None and self.last_problem.name == "measured cluster"
        served = [served_problem(c.config, agents) if measured else "planned for the what-if devices"
                  for _, c in rows]
        fill_table(self.table, [
            (name, str(c.devices), pools_text(c.config),
             f"{c.config.encode_batch}/{c.config.prefill_batch}/{c.config.decode_batch}", c.config.policy,
             f"{c.goodput_rps:.3g}", f"{c.ttft_p50_s:.3f}", "runs" if not why else "simulated only")
            for (name, c), why in zip(rows, served)], tooltips=served)
        self.table.setCurrentCell(0, 0)
        self.pools.show_pools(b.config, result.caches)  # the pick, whatever row filling selected
        self.slo_plot.clear()
        self.slo_plot.addItem(pg.InfiniteLine(pos=TARGET, angle=0, pen=pg.mkPen("#888888", style=Qt.DashLine)))
        for name, pts in result.curves:
            self.slo_plot.plot([p.rate_rps for p in pts], [p.attainment for p in pts], name=name,
                               pen=pg.mkPen(LINES.get(name, "#888888"), width=2), symbol="o", symbolSize=5,
                               symbolBrush=LINES.get(name, "#888888"))
        self.slo_plot.setYRange(0, 1.05)
        xs = [p.rate_rps for _, pts in result.curves for p in pts]
        if xs and all(math.isfinite(x) for x in xs):
            self.slo_plot.setXRange(0, max(xs) * 1.02)
        self._ended(f"picked {b.config.disaggregation} on {b.devices} devices ({pools_text(b.config)}): goodput "
                    f"{b.goodput_rps:.3g} req/s, TTFT p50 {b.ttft_p50_s:.3f} s — {result.trials} trials in "
                    f"{result.elapsed_s:.1f} s; calibration: {costs.source or 'loaded'}")


__all__ = ["EpdPlanResult", "PhaseDisaggregationPlanView", "PoolsDiagram", "RequestTimeline", "plan_epd"]

"""Spatial partitioning's plan view: every layer's width coloured by device, halos hatched.

The spatial technique's face on the Plan screen (gui.techniques). A problem comes from the
cluster you have — the connected agents' CNN fits (*Profile CNN*) with the measured profile's
links and budgets (``core.techniques.spatial.measured``), re-planned whenever the fits, the
profile or the agents change, and chosen by itself once fits of connected agents are there
(unless the operator picked a source) — or, as a what-if, from a file or the paper-shaped
scenario (nodes, bandwidth); the network is the picker's, or a technique model of its own
(``StudioState.technique_models["spatial"]``: the demo's digit CNN, trained, whose labels are
shown per image). A strategy gives the plan (Auto-solve: the fused planner; Compare: every
partitioner side by side). The tile
canvas draws one row per spatial layer: the solid part is the columns each device owns, the
hatched band under it the input columns the device reads (its strip plus the halo), so a
halo shows as hatching reaching into the neighbour's colour; a line marks each tile (group)
where the gateway scatters and gathers. *Run on agents* runs the plan on the connected agents
(``StudioState.agents``: the demo cluster or an agents.json) on a worker thread
(``core.techniques.spatial.run.run_and_record``): each image's strips land on the timeline as
they finish, each image's latency and agreement with the single-device forward in the table,
and the run is recorded (with its prediction) for the Sessions screen.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec

from PySide6.QtCore import QSize, Qt
from PySide6.QtWidgets import (
    QComboBox, QDoubleSpinBox, QFileDialog, QHBoxLayout, QHeaderView, QLabel, QProgressBar, QPushButton, QSizePolicy,
    QSpinBox,
    QSplitter, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget,
)

from core.errors import EdgeShardError
from core.formats import load
from core.techniques.spatial.problem import CnnRef, SpatialPlan, SpatialProblem, check
from core.techniques.spatial.profiling import fits_of_problem, problem_with_fits
from core.techniques.spatial.run import on_agents
from core.techniques.spatial.scenarios import paper_shaped
from core.techniques.spatial.strategies import ORDER
from gui.studio_state import StudioState
from gui.techniques.spatial.legend import STRIP_LEGEND_TERMS, STRIP_LEGEND_TOOLTIP
from gui.techniques.spatial.solving import Solved, compare_task, run_task, solve_task
from gui.techniques.spatial.tiles import TileCanvas
from gui.timeline import TimelineView
from gui.widgets import (InlineMessage, borderless_scroll, comparison_table, counted, fill_table, panel_header,
                         say_why_disabled)
from gui.workers import TaskRunner, shutdown_together, warm_import


class WrappedLabel(QLabel):
    """A word-wrapped label whose least height is its text's at its width: QLabel's minimum is one
    line, so a summary or run status wrapped onto 2-3 lines at 1024x700 took that height from the
    run's timeline below its minimum, cutting the time axis (~14 px a line), and the page did not
    scroll to it (the screen's minimum did not count the lines)."""

    def __init__(self, text: str = "") -> None:
        super().__init__(text)
        self.setWordWrap(True)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 (Qt)
        hint = super().minimumSizeHint()
        if self.width() > 0 and self.text():
            hint.setHeight(max(hint.height(), self.heightForWidth(self.width())))
        return hint

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt)
        super().resizeEvent(event)
        if event.size().width() != event.oldSize().width():
            self.updateGeometry()  # its lines at the new width: the layout asks minimumSizeHint again

    def setText(self, text: str) -> None:  # noqa: N802 (Qt)
        super().setText(text)
        self.updateGeometry()


class SpatialPlanView(QWidget):
    """The spatial technique's plan view (registered in gui.techniques)."""

    def __init__(self, state: StudioState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.problem: SpatialProblem | None = None
        self.plan: SpatialPlan | None = None
        self.source = "scenario"
        """Where the problem comes from: ``measured`` (the connected agents), ``scenario`` or ``file``."""
        self._source_picked = False
        """The operator picked a source: fits arriving no longer switch to the measured cluster."""
        self.own_model: CnnRef | None = None
        """A trained network of its own (``StudioState.technique_models``), first in the Network picker."""
        self._run_files: list[str] = []
        """The image files of the run in progress (names in the image table)."""
        self._run_model = CnnRef()
        """The network of the run in progress (its class labels in the image table)."""
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 12, 16, 12)
        lay.addWidget(panel_header("Spatial CNN partitioning (EdgeMI)",
                                   "Each convolution map cut into vertical strips, one per device; the gateway "
                                   "scatters them with halo columns and gathers."))
        controls = QHBoxLayout()
        self.network = QComboBox()
        self.network.addItems(["vgg16", "resnet-style"])
        self.network.setAccessibleName("Network")
        self.nodes = QSpinBox()
        self.nodes.setRange(1, 16)
        self.nodes.setValue(4)
        self.nodes.setAccessibleName("Nodes")
        self.bandwidth = QDoubleSpinBox()
        self.bandwidth.setRange(0.1, 100000.0)
        self.bandwidth.setValue(1000.0)
        self.bandwidth.setSuffix(" Mbit/s")
        self.bandwidth.setAccessibleName("Bandwidth")
        scenario = QPushButton("Use scenario")
        scenario.setToolTip("What-if: devices shaped like EdgeMI's testbed (Raspberry-Pi-class, switched LAN)")
        scenario.clicked.connect(lambda: self._picked(self.use_scenario))
        self.measured_button = QPushButton("Use measured cluster")
        self.measured_button.setToolTip("Plan on the connected agents as profiled: their CNN fits (Profile CNN), "
                                        "links and memory budgets (Profile cluster); re-planned when they change")
        self.measured_button.clicked.connect(lambda: self._picked(self.use_measured))
        load_btn = QPushButton("Load problem…")
        load_btn.clicked.connect(self._load_clicked)
        self.fits_button = QPushButton("Use Profile fits")
        self.fits_button.clicked.connect(self.use_profile_fits)
        state.spatial_fits_changed.connect(lambda _f: self._update_fits_button())
        self.strategy = QComboBox()
        self.strategy.addItems(list(ORDER))
        self.strategy.setAccessibleName("Strategy")
        self.strategy.currentTextChanged.connect(lambda _s: self.show_strategy(self.strategy.currentText()))
        for label, w in (("Network", self.network), ("Nodes", self.nodes), ("Link", self.bandwidth)):
            controls.addWidget(QLabel(label))
            controls.addWidget(w)
        controls.addSpacing(16)
        controls.addWidget(QLabel("Strategy"))
        controls.addWidget(self.strategy)
        controls.addStretch(1)
        lay.addLayout(controls)
        # Where the problem comes from, on its own row: in one row with the pickers the Strategy
        # picker was cut off at 1024 px.
        sources = QHBoxLayout()
        for button in (self.measured_button, scenario, load_btn, self.fits_button):
            sources.addWidget(button)
        sources.addStretch(1)
        lay.addLayout(sources)
        self.summary = WrappedLabel()
        self.summary.setAccessibleName("Plan summary")
        lay.addWidget(self.summary)
        self.solve_progress = QProgressBar()  # busy (no percentage: a solve reports none) while a solve runs
        self.solve_progress.setRange(0, 0)
        self.solve_progress.setMaximumHeight(6)
        self.solve_progress.setTextVisible(False)
        self.solve_progress.setAccessibleName("Solving")
        self.solve_progress.hide()
        lay.addWidget(self.solve_progress)
        self.message = InlineMessage()
        lay.addWidget(self.message)
        self.table = comparison_table(["strategy", "ms / image", "speedup", "devices", "tiles", "status"])
        lay.addWidget(self.table)
        self.canvas = TileCanvas()
        split = QSplitter(Qt.Vertical)
        split.setChildrenCollapsible(False)
        tiles = borderless_scroll(self.canvas)
        tiles.setMinimumHeight(80)  # it scrolls: the run's lanes below keep their height on a short screen
        split.addWidget(tiles)
        split.addWidget(self._run_box())
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 2)  # the run's lanes and images: at 1024×700 an even split squeezed the lanes flat
        lay.addWidget(split, 1)
        # solves and Compare run on workers as the other techniques' do: the pick froze the GUI 0.9-1.2 s
        self.solver, self.comparer = TaskRunner(self, name="spatial-solve"), TaskRunner(self, name="spatial-compare")
        self.solver.task_finished.connect(lambda _t, solved: self._show_solved(solved))
        self.comparer.task_finished.connect(lambda _t, rows: (fill_table(self.table, rows), self.table.show()))
        for r in (self.solver, self.comparer):
            r.status_reported.connect(lambda _t, text: self.summary.setText(text))
            r.task_failed.connect(lambda _t, text: self.message.show_lines([text], "Solving failed:"))
            r.busy_changed.connect(lambda _b: self._on_solving_changed())
        self.runner = TaskRunner(self, name="spatial-run")
        self.runner.partial_result_reported.connect(self._on_runner_partial_result_reported)
        self.runner.progress_reported.connect(self._on_runner_progress_reported)
        self.runner.task_finished.connect(self._on_runner_task_finished)
        self.runner.task_failed.connect(self._on_runner_task_failed)
        self.runner.task_cancelled.connect(self._on_runner_task_cancelled)
        self.runner.busy_changed.connect(lambda _b: self.update_run_controls())
        self.runner.status_reported.connect(lambda _t, text: self.run_status.setText(text))
        state.agents_changed.connect(lambda _a: self.update_run_controls())
        state.offline_changed.connect(lambda _o: self.update_run_controls())
        for signal in (state.spatial_fits_changed, state.profile_changed, state.agents_changed,
                       state.offline_changed):
            signal.connect(lambda _v: self._on_cluster_changed())
        state.technique_models_changed.connect(lambda _m: self._use_own_model())
        self.network.currentIndexChanged.connect(lambda _i: self._replan())
        self._use_own_model(replan=False)
        self._update_fits_button()
        self._on_cluster_changed()
        if self.problem is None:  # no measured cluster: the what-if (it was solved first, then replaced:
            self.use_scenario()  # a second fused solve on the GUI thread, 0.55 s at load 19)
        # the run's images and one-device reference need torch: warmed now (after the solve it would
        # slow), not imported under the run's live timeline
        self.warming = warm_import("torch")

    def _run_box(self) -> QWidget:
        box = QWidget()
        lay = QVBoxLayout(box)
        lay.setContentsMargins(0, 4, 0, 0)
        row = QHBoxLayout()
        self.run_images = QSpinBox()
        self.run_images.setRange(1, 256)
        self.run_images.setValue(8)
        self.run_images.setAccessibleName("Images")
        self.run_images.setToolTip("Random images (seeded) to classify on the agents")
        self.image_files: list[str] = []
        """Image files to classify instead of random images (empty: random)."""
        self._random_images = self.run_images.value()
        """How many random images the operator asked for: the box's value again after files."""
        self.files_button = QPushButton("Image files…")
        self.files_button.setToolTip("Classify image files (PNG, JPEG, ...) instead of random images: each is "
                                     "resized and centre-cropped to the network's input")
        self.files_button.clicked.connect(self._files_clicked)
        self.random_button = QPushButton("Random")
        self.random_button.setToolTip("Classify seeded random images again instead of the chosen files")
        self.random_button.clicked.connect(lambda: self.set_image_files([]))
        self.random_button.hide()
        self.run_button = QPushButton("Run on agents")
        self.run_button.setToolTip("Run this plan on the connected agents: strips on their data plane, "
                                   "each image checked against one device, recorded for Sessions")
        self.run_button.clicked.connect(self.start_run)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setToolTip("Stop after the image in flight (what ran is recorded as stopped)")
        self.stop_button.clicked.connect(self.stop_run)
        self.run_status = WrappedLabel()
        self.run_status.setAccessibleName("Run status")
        # wrapped, never widening the view: a finished run's line pushed a 1024 px window sideways
        self.run_status.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        for w in (QLabel("Images"), self.run_images, self.files_button, self.random_button, self.run_button,
                  self.stop_button):
            row.addWidget(w)
        row.addWidget(self.run_status, 1)
        lay.addLayout(row)
        self.run_message = InlineMessage()
        lay.addWidget(self.run_message)
        self.timeline = TimelineView()
        # its least height is its toolbar, hint and a line of text per lane (TimelineView): the tiles above give way
        self.timeline.set_legend_terms(STRIP_LEGEND_TERMS, STRIP_LEGEND_TOOLTIP, micro_batches=False,
                                       step_word="image")
        self.image_table = QTableWidget(0, 5)
        self.image_table.setHorizontalHeaderLabels(["image", "ms", "class", "= 1 dev", "max |Δ|"])
        self.image_table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.image_table.verticalHeader().hide()
        self.image_table.setAccessibleName("Images classified")
        self.image_table.setToolTip("Per image: latency (first strip scattered → head done), top class, whether it "
                                    "equals the single-device forward's, and max |scores − single-device scores|")
        self.image_table.setMinimumWidth(320)
        live = QSplitter(Qt.Horizontal)
        live.setChildrenCollapsible(False)
        live.addWidget(self.timeline)
        live.addWidget(self.image_table)
        live.setStretchFactor(0, 3)
        live.setStretchFactor(1, 1)
        lay.addWidget(live, 1)
        return box

    # running on agents ------------------------------------------------------------
    def _files_clicked(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(self, "Images to classify", "",
                                                "Images (*.png *.jpg *.jpeg *.bmp *.gif *.webp);;All files (*)")
        if paths:
            self.set_image_files(paths)

    def set_image_files(self, paths: list[str]) -> None:
        """Classify these files on the next run (empty: seeded random images). They are read when the
        run starts, on its worker; a bad one fails the run before anything is sent, named inline."""
        if paths and not self.image_files:
            self._random_images = self.run_images.value()
        self.image_files = list(paths)
        # the box counts what will run: the files (it showed 8 while 10 files ran), else random images again
        self.run_images.setMaximum(max(256, len(paths)))
        self.run_images.setValue(len(paths) if paths else self._random_images)
        self.run_images.setEnabled(not paths)
        self.random_button.setVisible(bool(paths))
        names = ", ".join(os.path.basename(p) for p in paths[:3]) + (", …" if len(paths) > 3 else "")
        self.files_button.setText(f"{len(paths)} file{'s' if len(paths) != 1 else ''}…" if paths else "Image files…")
        self.files_button.setToolTip(f"Classifying {names}; click to choose others" if paths else
                                     "Classify image files (PNG, JPEG, ...) instead of random images: each is "
                                     "resized and centre-cropped to the network's input")

    def _agent_names(self) -> list[str]:
        agents = self.state.agents
        if agents is None:
            return []
        return [a for a in agents.endpoints if a not in self.state.offline_devices]

    def run_blocker(self) -> str:
        """Why *Run on agents* cannot start now ("" when it can): what the operator must do."""
        if self.runner.is_busy():
            return "a run is in progress: Stop it first"
        if self.solver.is_busy():
            return "the plan is being solved"
        if self.state.agents is None:
            return "no agents connected: start the demo cluster or connect an agents.json (File menu)"
        if self.plan is None or self.problem is None:
            return "no plan: pick a strategy that finds one"
        try:
            on_agents(self.problem, self.plan, self._agent_names())
        except EdgeShardError as err:
            return str(err)
        return ""

    def update_run_controls(self) -> None:
        why = self.run_blocker()
        self.run_button.setEnabled(not why)
        say_why_disabled({self.run_button: why})
        self.stop_button.setEnabled(self.runner.is_busy())
        say_why_disabled({self.stop_button: "no run in progress"})

    def start_run(self) -> None:
        why = self.run_blocker()
        if why:
            self.run_message.show_lines([why], "Cannot run on agents:")
            return
        problem, plan = on_agents(self.problem, self.plan, self._agent_names())
        self.run_message.show_lines([])
        self.image_table.setRowCount(0)
        self.timeline.clear()
        self.timeline.set_lanes(list(plan.devices))
        self._run_t0 = time.monotonic()
        self.run_status.setText("starting: " + ", ".join(f"{a} as {d}" for d, a in zip(self.plan.devices, plan.devices))
                                + "…")
        self._run_files = list(self.image_files)
        self._run_model = problem.model
        self.runner.start(run_task, self.state.agents.link, problem, plan, self._run_files or self.run_images.value(),
                          self.state.workspace, f"Spatial {time.strftime('%Y-%m-%d %H:%M')}",
                          on_discarded=self._on_runner_task_finished_discarded)

    def stop_run(self) -> None:
        if self.runner.is_busy():
            self.run_status.setText("stopping after the image in flight…")
            self.runner.request_stop()

    def _on_runner_partial_result_reported(self, _task: int, value) -> None:
        events, res = value
        self.timeline.append_events(events)
        r = self.image_table.rowCount()
        self.image_table.insertRow(r)
        name = os.path.basename(self._run_files[res.image]) if res.image < len(self._run_files) else ""
        label = self._run_model.label(res.top_class) if self._run_model.labels else str(res.top_class)
        for c, text in enumerate((f"{res.image} {name}".strip(), f"{res.latency_s * 1e3:.1f}", label,
                                  "yes" if res.agrees else "NO", f"{res.max_abs_error:.1e}")):
            self.image_table.setItem(r, c, QTableWidgetItem(text))
        self.image_table.scrollToBottom()

    def _on_runner_progress_reported(self, _task: int, done: float, total: float) -> None:
        self.run_status.setText(f"image {int(done) + 1} of {int(total)}…")

    def _on_runner_task_finished_discarded(self, out) -> None:
        """A stopped run still returns what it measured and recorded: show it."""
        self._on_runner_task_finished(0, out)

    def _on_runner_task_finished(self, _task: int, out) -> None:
        self.timeline.flush()
        self.timeline.fit_all()
        run = out.run
        n = len(run.tokens)
        rate = n / run.figures.duration_s if run.figures.duration_s > 0 else 0.0
        recorded = (f"recorded as runs {out.run_ids[0]} (measured) and {out.run_ids[1]} (predicted)"
                    if out.run_ids else "not recorded: open a workspace to keep runs")
        self.run_status.setText(f"{out.status}: {counted(n, 'image')}, {rate:.1f} images/s, "
                                f"max |scores − one device| = {out.max_abs_error:.1e}; {recorded}")
        agents = counted(len(self.timeline.lanes()), "agent")
        self.state.log(f"spatial run {out.status}: {counted(n, 'image')} on {agents}; {recorded}")

    def _on_runner_task_failed(self, _task: int, message: str) -> None:
        self.timeline.flush()
        self.run_status.setText("failed")
        self.run_message.show_lines([message], "The spatial run failed:")
        self.state.log(f"spatial run failed: {message}", "error")

    def _on_runner_task_cancelled(self, _task: int) -> None:
        if not self.run_status.text().startswith("stopped"):
            self.run_status.setText("stopped")

    def shutdown(self) -> None:
        shutdown_together((self.solver, self.comparer, self.runner), timeout_s=30.0)

    # problem ----------------------------------------------------------------------
    def _use_own_model(self, replan: bool = True) -> None:
        """Offer the technique model of the studio state (the demo's digit CNN) first in the Network
        picker, with its shipped images as the run's files."""
        from core.techniques.spatial.digits import digits_cnn

        folder = self.state.technique_models.get("spatial", "")
        try:
            own = digits_cnn(folder) if folder else None
        except (OSError, ValueError) as err:  # a missing or unreadable model folder: said, not raised
            self.message.show_lines([f"{folder}: {err}"], "The spatial model cannot be used:")
            own = None
        if own == self.own_model:
            return
        self.own_model = own
        self.network.blockSignals(True)
        if self.network.count() > 2:
            self.network.removeItem(0)
        if own is not None:
            self.network.insertItem(0, f"{os.path.basename(folder.rstrip('/'))} (trained)")
            self.network.setItemData(0, f"{folder}: {own.network}, {own.classes} classes "
                                        f"({', '.join(own.labels[:10])})", Qt.ItemDataRole.ToolTipRole)
            self.network.setCurrentIndex(0)
            images = sorted(str(p) for p in (Path(folder) / "images").glob("*.png"))
            if images and not self.image_files:
                self.set_image_files(images)
        self.network.blockSignals(False)
        if replan:
            self._replan()

    def model(self) -> CnnRef:
        """The network planned and run: the model of its own when picked, else the picker's (224 px)."""
        if self.own_model is not None and self.network.currentIndex() == 0:
            return self.own_model
        return CnnRef(network=self.network.currentText())

    def _picked(self, use) -> None:
        self._source_picked = True
        use()

    def _replan(self) -> None:
        """The current source again (the network or the cluster changed)."""
        if self.source == "measured":
            self.use_measured()
        elif self.source == "scenario":
            self.use_scenario()
        elif self.problem is not None and self.problem.model != self.model():
            self.set_problem(msgspec.structs.replace(self.problem, model=self.model()))

    def measured_blocker(self) -> str:
        """Why the measured cluster cannot be planned now ("" when it can)."""
        fits = self.state.spatial_fits
        agents = self._agent_names()
        if not agents:
            return "no agents connected: start the demo cluster or connect an agents.json (File menu)"
        if fits is None or not {f.device for f in fits.devices} & set(agents):
            return "no CNN time models of the connected agents: press Profile CNN on the Profile screen"
        return ""

    def _on_cluster_changed(self) -> None:
        why = self.measured_blocker()
        self.measured_button.setEnabled(not why)
        say_why_disabled({self.measured_button: why})
        if self.source == "measured" or (not why and not self._source_picked):
            self.use_measured()

    def use_measured(self) -> None:
        """Plan on the connected agents from their fits and the measured profile (links, budgets)."""
        from core.techniques.spatial.measured import problem_from_fits

        why = self.measured_blocker()
        if why:
            if self.source == "measured":
                self.message.show_lines([why], "Cannot plan the measured cluster:")
            return
        profile = self.state.profile if self.state.profile is not None and self.state.profile.source == "measured" \
            else None
        source = self.state.problem.source if self.state.problem is not None else ""
        try:
            problem = problem_from_fits(self.model(), self.state.spatial_fits, profile=profile,
                                        agents=self._agent_names(), gateway=source)
            check(problem)
        except EdgeShardError as err:
            self.message.show_lines([str(err)], "Cannot plan the measured cluster:")
            return
        self.source = "measured"
        self._show_scenario_inputs(False)
        if problem != self.problem:
            self.set_problem(problem)

    def _show_scenario_inputs(self, on: bool) -> None:
        """Nodes and Link shape the what-if scenario only: the measured cluster has its own."""
        for w in (self.nodes, self.bandwidth):
            w.setEnabled(on)
        say_why_disabled({w: "the measured cluster has its own devices and links (Use scenario for a what-if)"
                          for w in (self.nodes, self.bandwidth)})

    def use_scenario(self) -> None:
        self.source = "scenario"
        self._show_scenario_inputs(True)
        problem = paper_shaped(self.nodes.value(), self.bandwidth.value(), network=self.model().network)
        self.set_problem(msgspec.structs.replace(problem, model=self.model()))

    def _load_clicked(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Load spatial problem", "", "Spatial problem (*.json)")
        if path:
            self.load_problem(path)

    def load_problem(self, path: str) -> None:
        try:
            problem = load(path, SpatialProblem)
            check(problem)
        except EdgeShardError as err:
            self.message.show_lines([str(err)], "This problem cannot be planned:")
            return
        self.source, self._source_picked = "file", True
        self.set_problem(problem)
        self.state.set_spatial_fits(fits_of_problem(problem, f"spatial problem {os.path.basename(path)}"))

    def use_profile_fits(self) -> None:
        """The shown problem with the time models the Profile screen has (``StudioState.spatial_fits``:
        *Profile CNN* on the agents, or a loaded problem's), its devices mapped onto the timed agents
        (``profiling.problem_with_fits``); what does not match is said inline, the problem stays."""
        fits = self.state.spatial_fits
        if fits is None or self.problem is None:
            self.message.show_lines(["No CNN time models yet: press Profile CNN on the Profile screen "
                                     "(with agents connected), or load a spatial problem."], "Cannot use fits:")
            return
        try:
            problem = problem_with_fits(self.problem, fits)
            check(problem)
        except EdgeShardError as err:
            self.message.show_lines([str(err)], "These fits do not fit this problem:")
            return
        self.set_problem(problem)
        self.state.log(f"spatial problem now uses the time models {fits.source}: {problem.name}")

    def _update_fits_button(self) -> None:
        fits = self.state.spatial_fits
        self.fits_button.setEnabled(fits is not None)
        say_why_disabled({self.fits_button: "no CNN time models yet: press Profile CNN on the Profile screen"})
        self.fits_button.setToolTip(
            "Plan with the CNN time models the Profile screen shows" if fits is None else
            f"Plan with the CNN time models {fits.source} ({', '.join(f.device for f in fits.devices)}), "
            "the problem's devices named as those agents")

    def set_problem(self, problem: SpatialProblem) -> None:
        self.problem = problem
        self.message.show_lines([])
        self.table.hide()
        self.show_strategy(self.strategy.currentText())

    # plans ------------------------------------------------------------------------
    def show_strategy(self, name: str) -> None:
        """Solve ``name`` for the problem on the solver's worker; the plan is shown when it lands."""
        if self.problem is not None:
            self.solver.start(solve_task, self.problem, name)

    def _show_solved(self, solved: Solved) -> None:
        if solved.problem is not self.problem:  # solved for a problem since replaced
            return
        self.plan = solved.plan
        self.summary.setText(solved.summary)
        if solved.plan is None:
            self.message.show_lines([solved.error], f"{solved.strategy} found no plan:")
            self.canvas.show_plan(None, None)
        else:
            self.canvas.show_plan(self.problem.model.spec(), solved.plan)
        self.update_run_controls()

    def _on_solving_changed(self) -> None:
        self.solve_progress.setVisible(self.solver.is_busy() or self.comparer.is_busy())
        self.update_run_controls()

    def auto_solve(self) -> None:
        self.strategy.setCurrentText("fused")
        self.show_strategy("fused")

    def compare(self) -> None:
        if self.problem is not None:
            self.comparer.start(compare_task, self.problem)

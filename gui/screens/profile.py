"""The profile: per-unit prefill and decode times per device, memory budgets, the workload.

Profiling itself runs through a ``TaskRunner`` (measuring takes seconds to minutes on
real devices); the panel then shows what was measured, at the workload it was
measured for, so an operator can judge whether the numbers apply to their prompts.

CNN spatial partitioning has its own profile: per device, convolution time y = a·x + b over a
layer's FLOPs x (and the FC head's own fit), from ``StudioState.spatial_fits`` (set by
*Profile CNN* here, which times convolutions on the connected agents on the same worker, or by
loading a spatial problem). The table shows a, b, 1/a and each fit's median
|predicted − measured| / measured, so an operator sees how far the spatial planner's times can be trusted.
"""

from __future__ import annotations

from html import escape
from typing import Callable

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QHBoxLayout, QHeaderView, QLabel, QProgressBar, QPushButton, QTableWidget, QVBoxLayout, QWidget,
)

from core.devices.profile import Profile
from core.planning.cost import byte_unit, format_bytes
from core.techniques.spatial.problem import TimeModel
from core.techniques.spatial.profiling import SpatialFits, measure_fits
from gui.app import stage_color, style_plot, theme_colors
from gui.studio_state import StudioState
from gui.widgets import InlineMessage, fill_table, panel_header, say_why_disabled
from gui.workers import TaskRunner


MEMORY_HEADROOM = 1.3
"""The memory chart's top over its tallest bar or line: room for the bar's value above it."""


class ProfilePanel(QWidget):
    load_requested = Signal()
    """Load… was clicked: the window asks for the file (profiles and problems load there)."""

    def __init__(self, state: StudioState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.memory_plot: pg.PlotItem | None = None
        """The memory budgets' chart (None before a profile)."""
        self.weights_line: pg.InfiniteLine | None = None
        self.profile_task: Callable | None = None
        """``fn(reporter) -> Profile``, set by whoever can profile (the demo, the devices screen)."""
        self.runner = TaskRunner(self, name="profile")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 12, 16, 12)
        lay.addWidget(panel_header("Profile", "Measured compute time of every unit on every device, and each "
                                   "device's memory budget. Plans are predicted from these numbers."))
        bar = QHBoxLayout()
        self.profile_button = QPushButton("Profile cluster")
        self.profile_button.setProperty("role", "primary")
        self.profile_button.setAccessibleName("Profile cluster")
        self.profile_button.setToolTip("Measure every unit on every device with the running agents (Ctrl+P)")
        self.profile_button.clicked.connect(self.start_profiling)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setToolTip("Stop profiling; nothing is changed")
        self.cancel_button.clicked.connect(self.runner.cancel)
        self.cancel_button.hide()
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Profiling progress")
        self.progress.hide()
        self.progress_label = QLabel("")
        self.progress_label.setProperty("role", "subtitle")
        self.progress_label.setWordWrap(True)  # a long status ("…edge-b unit 4/8, edge-c…") widened the screen
        self.conv_button = QPushButton("Profile CNN")
        self.conv_button.setAccessibleName("Profile CNN convolutions")
        self.conv_button.setToolTip("Time convolutions over map sizes on every connected agent and fit "
                                    "y = a·x + b per device (CNN spatial partitioning)")
        self.conv_button.clicked.connect(self.start_conv_profiling)
        self.conv_sweep: dict = {}
        """``measure_fits``' sweep (sizes, channels, repeats); empty: the agents' defaults, as the CLI."""
        self.load_button = QPushButton("Load…")
        self.load_button.setToolTip("Load a profile or problem file (edgeshard profile --out, edgeshard scenario, "
                                    "a spatial problem)")
        self.load_button.setAccessibleName("Load profile")
        self.load_button.clicked.connect(self._on_load_clicked)
        self.save_button = QPushButton("Save…")
        self.save_button.setToolTip("Save this profile for `edgeshard plan --profile` and later sessions")
        self.save_button.setAccessibleName("Save profile")
        self.save_button.clicked.connect(self._on_save_clicked)
        say_why_disabled({self.save_button: "no profile yet: profile the cluster or load a profile first",
                          self.conv_button: "no agents connected: start the demo cluster or connect an "
                                            "agents.json (File menu)"})
        bar.addWidget(self.profile_button)
        bar.addWidget(self.conv_button)
        bar.addWidget(self.cancel_button)
        bar.addWidget(self.load_button)
        bar.addWidget(self.save_button)
        bar.addWidget(self.progress, 1)
        bar.addWidget(self.progress_label, 1)
        lay.addLayout(bar)
        self.workload_label = QLabel("No profile yet.")
        self.workload_label.setWordWrap(True)
        self.workload_label.setAccessibleName("Profiled workload")
        lay.addWidget(self.workload_label)
        self.cache_label = QLabel("")
        self.cache_label.setWordWrap(True)
        self.cache_label.setAccessibleName("How units were timed")
        lay.addWidget(self.cache_label)
        self.precision_label = QLabel("")
        self.precision_label.setWordWrap(True)
        self.precision_label.setAccessibleName("Weight precision")
        lay.addWidget(self.precision_label)
        state.plan_changed.connect(lambda _p: self._show_precision())
        self.error = InlineMessage()
        lay.addWidget(self.error)
        self.spatial_label = QLabel("")
        self.spatial_label.setWordWrap(True)
        self.spatial_label.setAccessibleName("CNN time models")
        lay.addWidget(self.spatial_label)
        self.spatial_table = QTableWidget(0, len(FIT_HEADERS))
        self.spatial_table.setHorizontalHeaderLabels(FIT_HEADERS)
        self.spatial_table.verticalHeader().hide()
        # every figure's heading whole at 1024 px (stretched, "a (ms per GFLOP)" read "ms per GFLO");
        # the device column takes what is left
        self.spatial_table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.spatial_table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.spatial_table.setAccessibleName("CNN time model fits")
        lay.addWidget(self.spatial_table, 1)
        self.plots = pg.GraphicsLayoutWidget()
        self.plots.setAccessibleName("Profile charts")
        self.plots.setMinimumHeight(340)  # with the CNN fits at 1024x700 the page scrolls; the charts were ~40 px
        lay.addWidget(self.plots, 1)
        lay.addStretch(0)
        self.runner.task_finished.connect(self._on_runner_finished)
        self.runner.task_failed.connect(self._on_runner_failed)
        self.runner.progress_reported.connect(self._on_runner_progress)
        self.runner.status_reported.connect(lambda _t, s: self.progress_label.setText(s))
        self.runner.busy_changed.connect(self._on_runner_busy_changed)
        state.profile_changed.connect(lambda _p: self.refresh())
        state.spatial_fits_changed.connect(lambda _f: self.refresh_spatial())
        state.agents_changed.connect(lambda _a: self._update_conv_button())
        self.set_profile_task(None)
        self._update_conv_button()
        self.refresh()
        self.refresh_spatial()

    # profiling ------------------------------------------------------------------------
    def set_profile_task(self, fn: Callable | None) -> None:
        self.profile_task = fn
        self.profile_button.setEnabled(fn is not None)
        self.profile_button.setToolTip(
            "Measure every unit on every device with the running agents (Ctrl+P)" if fn is not None
            else "Start agents on the Devices screen (or run `edgeshard studio --demo`) to profile"
        )

    def start_profiling(self) -> None:
        if self.profile_task is None:
            self.error.show_lines(["No running agents to profile. Deploy and start agents on the Devices screen, "
                                   "or load a saved profile (File ▸ Load profile…)."])
            return
        self.error.show_lines([])
        self.runner.start(self.profile_task)

    def start_conv_profiling(self) -> None:
        """Time convolutions on every connected (online) agent on the worker; the fits land in
        ``StudioState.spatial_fits``."""
        agents = self.state.agents
        if agents is None:
            self.error.show_lines(["No agents connected to profile. Start the demo cluster or connect an "
                                   "agents.json (File menu), or load a spatial problem (Load…)."])
            return
        devices = [d for d in agents.endpoints if d not in self.state.offline_devices]
        self.error.show_lines([])
        self.runner.start(_conv_job, agents.link, devices, self.conv_sweep)

    def _update_conv_button(self) -> None:
        self.conv_button.setEnabled(self.state.agents is not None and not self.runner.is_busy())

    def _on_runner_busy_changed(self, busy: bool) -> None:
        self.progress.setVisible(busy)
        self.cancel_button.setVisible(busy)
        self.profile_button.setEnabled(not busy and self.profile_task is not None)
        self._update_conv_button()
        if busy:
            self.progress.setRange(0, 0)
        if self.state.profile is None:  # not "press Profile cluster" while it runs
            self.refresh()

    def _on_runner_progress(self, _task: int, done: float, total: float) -> None:
        if total > 0:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(1000 * done / total))

    def _on_runner_finished(self, _task: int, profile) -> None:
        self.progress_label.setText("Profiling finished.")
        self.state.log("profiling finished")
        if isinstance(profile, SpatialFits):
            self.state.set_spatial_fits(profile)
        else:
            self.state.set_profile(profile)

    def _on_runner_failed(self, _task: int, message: str) -> None:
        self.progress_label.setText("")
        self.error.show_lines([message, "Check that the agents are running (Devices screen), then profile again."],
                              "Profiling failed:")
        self.state.log(message, "error")

    # files ----------------------------------------------------------------------------
    def save_profile_file(self, path: str) -> bool:
        from core import formats
        try:
            formats.save(path, self.state.profile)
        except OSError as err:
            self.error.show_lines([f"Cannot save {path}: {err.strerror or err}. Choose a folder you can write to."])
            return False
        self.error.show_lines([])
        self.state.log(f"saved profile to {path}")
        return True

    def _on_save_clicked(self) -> None:
        from PySide6.QtWidgets import QFileDialog

        path, _ = QFileDialog.getSaveFileName(self, "Save profile", "profile.json", "Profile files (*.json)")
        if path:
            self.save_profile_file(path)

    def _on_load_clicked(self) -> None:
        self.load_requested.emit()

    # drawing --------------------------------------------------------------------------
    def refresh(self) -> None:
        self.save_button.setEnabled(self.state.profile is not None)
        self.plots.clear()
        style_plot(self.plots)
        p = self.state.profile
        self.plots.setVisible(p is not None)
        self._size_spatial_table()
        self.cache_label.setText(cache_timing_text(p) if p is not None else "")
        self.cache_label.setVisible(bool(self.cache_label.text()))
        self._show_precision()
        if p is None:
            self.workload_label.setText(
                "Profiling the agents: the charts appear when it finishes." if self.runner.is_busy()
                else "No profile yet: press Profile cluster, or File ▸ Load profile… (Ctrl+Shift+P).")
            return
        w = p.profiled_workload
        wl = (f"prompt {w.prompt_tokens} tokens, batch {w.batch_size}" if w else "workload not recorded")
        self.workload_label.setText(
            f"<b>{p.model.name}</b> ({p.model.num_units} units, {format_bytes(p.model.param_bytes)} of weights, "
            f"{p.model.dtype}) on {len(p.times)} device(s) · profiled with {wl} · source: {p.source}"
            + (f" · {p.notes}" if p.notes else "")
        )
        c = theme_colors()
        batch = w.batch_size if w else 1
        prompt_tokens = (w.prompt_tokens * w.batch_size) if w else 32
        decode = self.plots.addPlot(row=0, col=0, title=f"Decode time per unit (batch {batch})")
        prefill = self.plots.addPlot(row=0, col=1, title=f"Prefill time per unit ({prompt_tokens} tokens)")
        for plot in (decode, prefill):
            plot.setLabel("bottom", "unit")
            plot.setLabel("left", "ms")
            # the values are ms already: pyqtgraph's SI prefix turned the demo's 0.2-0.8 ms into
            # ticks 200-800 labelled "ms (x0.001)"
            plot.getAxis("left").enableAutoSIPrefix(False)
            plot.showGrid(x=False, y=True, alpha=0.25)
            plot.setMenuEnabled(False)
        dlegend = decode.addLegend(offset=(10, 10))
        dlegend.setLabelTextColor(c["text"])
        units = np.arange(p.model.num_units)
        for i, t in enumerate(p.times):
            pen = pg.mkPen(stage_color(i), width=2)
            dec = np.array([t.decode_time(u, batch) for u in units]) * 1e3
            pre = np.array([t.prefill_time(u, prompt_tokens) for u in units]) * 1e3
            decode.plot(units, dec, pen=pen, symbol="o", symbolSize=5, symbolBrush=stage_color(i), name=t.device)
            prefill.plot(units, pre, pen=pen, symbol="o", symbolSize=5, symbolBrush=stage_color(i), name=t.device)
        devs = p.cluster.devices
        unit, size = byte_unit(max([d.memory_bytes for d in devs] + [p.model.param_bytes]))
        # the weights line is named in the title, in its colour: a label on the line was cut off
        # under the title where the line is the chart's top (the model bigger than any budget)
        mem = self.plots.addPlot(row=1, col=0, colspan=2,
                                 title=f"Memory budget per device ({unit}) — <span style='color:{c['error']}'>"
                                       f"- - - model weights {format_bytes(p.model.param_bytes)}</span>")
        mem.setMenuEnabled(False)
        mem.setMouseEnabled(False, False)
        budgets = [d.memory_bytes / size for d in devs]
        mem.addItem(pg.BarGraphItem(x=list(range(len(devs))), height=budgets, width=0.6,
                                    brushes=[pg.mkBrush(stage_color(i)) for i in range(len(devs))]))
        for i, b in enumerate(budgets):
            label = pg.TextItem(f"{b:.1f}", color=c["text"], anchor=(0.5, 1.0))
            label.setPos(i, b)
            mem.addItem(label)
        weights = p.model.param_bytes / size
        self.weights_line = pg.InfiniteLine(pos=weights, angle=0,
                                            pen=pg.mkPen(c["error"], width=2, style=pg.QtCore.Qt.DashLine))
        mem.addItem(self.weights_line)
        self.memory_plot = mem
        mem.getAxis("bottom").setTicks([[(i, d.id) for i, d in enumerate(devs)]])
        mem.setYRange(0, max(budgets + [weights]) * MEMORY_HEADROOM, padding=0)
        self.plots.ci.layout.setRowStretchFactor(0, 3)
        self.plots.ci.layout.setRowStretchFactor(1, 2)

    def refresh_spatial(self) -> None:
        fits = self.state.spatial_fits
        self.spatial_label.setVisible(fits is not None)
        self.spatial_table.setVisible(fits is not None)
        if fits is None:
            return
        self.spatial_label.setText(
            f"<b>CNN time models</b> (spatial partitioning): y = a·x + b per device and layer type, x a layer's "
            f"FLOPs, plus (profiled per layer strip) time per MB of the layer's weights and of the activations "
            f"it reads and writes (pools, narrow strips), fitted by least squares · fit error: median "
            f"|predicted − measured| / measured · "
            f"source: {fits.source}")
        rows, tips = fit_rows(fits)
        fill_table(self.spatial_table, rows, tips)
        self._size_spatial_table()

    def _size_spatial_table(self) -> None:
        """With a unit profile's charts below, the fit table keeps to 3 rows (it scrolls); alone, it
        takes the room the charts would."""
        table = self.spatial_table
        if self.state.profile is None:
            table.setMinimumHeight(0)
            table.setMaximumHeight(16777215)
            return
        shown = min(table.rowCount(), 3)
        table.setFixedHeight(table.horizontalHeader().sizeHint().height() + 4
                             + sum(table.rowHeight(r) for r in range(shown)))

    def shutdown(self) -> None:
        self.runner.shutdown()


    def _show_precision(self) -> None:
        """Each stage's weight precision in the current plan, and what each precision was measured to cost."""
        self.precision_label.setText(precision_text(self.state.profile, self.state.plan))
        self.precision_label.setVisible(bool(self.precision_label.text()))


def cache_timing_text(p: Profile) -> str:
    """Per device, whether its units were timed cold or warm (and why warm: a model larger than
    the cache then runs slower than profiled); "" when no device recorded it."""
    cold = [escape(t.device) for t in p.times if t.cache_timing == "cold"]
    warm = [f"<b>{escape(t.device)}</b> timed warm: {escape(t.warm_reason or 'reason not recorded')}"
            for t in p.times if t.cache_timing == "warm"]
    cold = [f"{', '.join(cold)} timed cold (weights out of the CPU's cache, as a run finds them)"] if cold else []
    return " · ".join(cold + warm)


FIT_HEADERS = ["device", "layers", "a (ms/GFLOP)", "b (ms/call)", "GFLOP/s (1/a)", "fit error",
               "weights (ms/MB)", "activations (ms/MB)"]


def fit_rows(fits: SpatialFits) -> tuple[list[list[str]], list[str]]:
    """The table's text: one row per device and layer type (convolutions; the FC head when timed),
    and each row's tooltip. A fit error of exactly 0 is no fit (a hand-written or scenario model)."""
    rows, tips = [], []

    def add(device: str, layers: str, m: TimeModel) -> None:
        fitted = m.median_rel_error > 0
        per_mb = lambda v: f"{v * 1e9:.3f}" if v > 0 else "—"  # noqa: E731 (s per byte -> ms per MB)
        rows.append([device, layers, f"{m.a * 1e12:.2f}", f"{m.b * 1e3:.3f}", f"{1e-9 / m.a:.2f}",
                     f"{m.median_rel_error * 100:.1f} %" if fitted else "—", per_mb(m.per_weight_byte),
                     per_mb(m.per_activation_byte)])
        terms = (f" + {m.per_weight_byte:.3g}·weight bytes + {m.per_activation_byte:.3g}·activation bytes"
                 if m.per_weight_byte or m.per_activation_byte else "")
        tips.append(f"{device}, {layers}: y = {m.a:.3g}·x + {m.b:.3g}{terms} s (x: FLOPs)" + (
            f"; median |predicted − measured| / measured over its samples {m.median_rel_error:.2%}" if fitted
            else "; not fitted from measurements (written by hand or by a scenario)"))

    for d in fits.devices:
        add(d.device, "convolutions", d.conv)
        if d.fc is not None:
            add(d.device, "FC head", d.fc)
    return rows, tips


def _conv_job(reporter, link, devices: list[str], sweep: dict) -> SpatialFits:
    return measure_fits(link, devices, reporter=reporter, **sweep)


def precision_text(profile: Profile | None, plan) -> str:
    """'Weights per stage: a fp on cpu, b int4 on cuda:0 · measured: int8 +0.10 % perplexity, 0.97× decode time;
    ... · on each device: a int8 0.92×, ... · GPUs: b cuda:0 8.0 GiB' (each part only where there is one; '' for
    an all-fp CPU plan of a profile without measured precisions, device times or GPUs)."""
    parts = []
    quality = {q.weights: q for q in profile.weight_quality} if profile is not None else {}
    if plan is not None and profile is not None and plan.model == profile.model.name and (
            quality or any(s.weights != "fp" or s.torch_device != "cpu" for s in plan.stages)):
        # an all-fp, all-CPU plan of a profile without measured precisions: nothing to say
        parts.append("Weights per stage: " + ", ".join(f"{s.device} {s.weights} on {s.torch_device}"
                                                       for s in plan.stages))
    if "fp" in quality:
        base = quality["fp"].perplexity
        parts.append("measured: " + "; ".join(
            f"{w} {(q.perplexity / base - 1) * 100:+.2f} % perplexity, {q.decode_time_ratio:.2f}× decode time"
            for w, q in quality.items() if w != "fp"))
    if profile is not None and profile.precision_times:  # each device's own, where profiled
        parts.append("on each device: " + ", ".join(f"{t.device} {t.weights} {t.decode_time_ratio:.2f}×"
                                                    for t in profile.precision_times))
    if profile is not None and profile.accelerator_times:
        parts.append("GPUs: " + ", ".join(f"{a.device} {a.torch_device} {a.memory_bytes / 2**30:.1f} GiB" + "".join(
            f" {t.weights} {t.decode_time_ratio:.2f}×" for t in a.precision_times) for a in profile.accelerator_times))
    return " · ".join(parts)

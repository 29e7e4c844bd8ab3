"""The profile: per-unit prefill and decode times per device, memory budgets, the workload.

Profiling itself runs through a ``TaskRunner`` (measuring takes seconds to minutes on
real devices); the panel then shows what was measured, at the workload it was
measured for, so an operator can judge whether the numbers apply to their prompts.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QPushButton, QVBoxLayout, QWidget

from core.devices.profile import Profile
from gui.app import stage_color, style_plot, theme_colors
from gui.studio_state import StudioState
from gui.widgets import InlineMessage, panel_header, say_why_disabled
from gui.workers import TaskRunner


class ProfilePanel(QWidget):
    load_requested = Signal()
    """Load… was clicked: the window asks for the file (profiles and problems load there)."""

    def __init__(self, state: StudioState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
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
        self.load_button = QPushButton("Load…")
        self.load_button.setToolTip("Load a profile or problem file (edgeshard profile --out, edgeshard scenario)")
        self.load_button.setAccessibleName("Load profile")
        self.load_button.clicked.connect(self._on_load_clicked)
        self.save_button = QPushButton("Save…")
        self.save_button.setToolTip("Save this profile for `edgeshard plan --profile` and later sessions")
        self.save_button.setAccessibleName("Save profile")
        self.save_button.clicked.connect(self._on_save_clicked)
        say_why_disabled({self.save_button: "no profile yet: profile the cluster or load a profile first"})
        bar.addWidget(self.profile_button)
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
        self.error = InlineMessage()
        lay.addWidget(self.error)
        self.plots = pg.GraphicsLayoutWidget()
        self.plots.setAccessibleName("Profile charts")
        lay.addWidget(self.plots, 1)
        self.runner.task_finished.connect(self._on_runner_finished)
        self.runner.task_failed.connect(self._on_runner_failed)
        self.runner.progress_reported.connect(self._on_runner_progress)
        self.runner.status_reported.connect(lambda _t, s: self.progress_label.setText(s))
        self.runner.busy_changed.connect(self._on_runner_busy_changed)
        state.profile_changed.connect(lambda _p: self.refresh())
        self.set_profile_task(None)
        self.refresh()

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

    def _on_runner_busy_changed(self, busy: bool) -> None:
        self.progress.setVisible(busy)
        self.cancel_button.setVisible(busy)
        self.profile_button.setEnabled(not busy and self.profile_task is not None)
        if busy:
            self.progress.setRange(0, 0)

    def _on_runner_progress(self, _task: int, done: float, total: float) -> None:
        if total > 0:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(1000 * done / total))

    def _on_runner_finished(self, _task: int, profile) -> None:
        self.progress_label.setText("Profiling finished.")
        self.state.log("profiling finished")
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
        if p is None:
            self.workload_label.setText("No profile yet: press Profile cluster, or File ▸ Load profile… (Ctrl+Shift+P).")
            return
        w = p.profiled_workload
        wl = (f"prompt {w.prompt_tokens} tokens, batch {w.batch_size}" if w else "workload not recorded")
        self.workload_label.setText(
            f"<b>{p.model.name}</b> ({p.model.num_units} units, {p.model.param_bytes / 2**30:.2f} GiB of weights, "
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
        mem = self.plots.addPlot(row=1, col=0, colspan=2, title="Memory budget per device (GiB) — line: whole model's weights")
        mem.setMenuEnabled(False)
        mem.setMouseEnabled(False, False)
        devs = p.cluster.devices
        budgets = [d.memory_bytes / 2**30 for d in devs]
        mem.addItem(pg.BarGraphItem(x=list(range(len(devs))), height=budgets, width=0.6,
                                    brushes=[pg.mkBrush(stage_color(i)) for i in range(len(devs))]))
        for i, b in enumerate(budgets):
            label = pg.TextItem(f"{b:.1f}", color=c["text"], anchor=(0.5, 1.0))
            label.setPos(i, b)
            mem.addItem(label)
        weights = p.model.param_bytes / 2**30
        mem.addItem(pg.InfiniteLine(pos=weights, angle=0, pen=pg.mkPen(c["error"], width=2, style=pg.QtCore.Qt.DashLine),
                                    label=f"model weights {weights:.2f} GiB",
                                    labelOpts={"color": c["error"], "position": 0.5, "anchors": [(0.5, 1.2), (0.5, 1.2)]}))
        mem.getAxis("bottom").setTicks([[(i, d.id) for i, d in enumerate(devs)]])
        mem.setYRange(0, max(budgets + [weights]) * 1.15)
        self.plots.ci.layout.setRowStretchFactor(0, 3)
        self.plots.ci.layout.setRowStretchFactor(1, 2)

    def shutdown(self) -> None:
        self.runner.shutdown()

"""The pipeline timeline: one lane per device, one box per compute / transfer / wait.

``TimelineView`` is the widget: its toolbar, legend and lane axis, follow-live, zoom and pan.
Events are appended to numpy columns and applied to the plot on a ~30 Hz timer, drawn by
``items.TimelineBoxesItem`` in batches (ARCHITECTURE.md, Concurrency); what it draws over
them is in ``overlays``, what a hover, click or range says in ``inspection``.

Encoding: colour = micro-batch; prefill = the colour, hatched; decode = the colour, plain;
a transfer (``send``) is a thinner box in the lower band of the sender's lane; a
``recv_wait`` is drawn faintly behind compute. Compute boxes that overlap on one lane (a decode
agent's continuous batch: one box per request, all running at once) are stacked in sub-lanes,
a lane's compute band split in as many rows as it ever ran at once. A second plot below shows the predicted
timeline (the simulator's ``TimelineEvent``s for the same plan) on the same time axis.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt, QTimer, Signal
from PySide6.QtGui import QColor, QFontMetrics, QPalette
from PySide6.QtWidgets import QCheckBox, QComboBox, QGridLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from agents.protocol import TimelineEvent
from gui.timeline.inspection import TimelineInspection, stage_errors
from gui.timeline.items import BANDS, BOX_DTYPE, KIND_CODE, PHASE_CODE, TimelineBoxesItem
from gui.timeline.legend import LEGEND_TERMS, LEGEND_TOOLTIP, TimelineLegend  # noqa: F401 (re-exported)
from gui.timeline.overlays import RangeSelectViewBox, TimelineOverlayItem
from gui.widgets import say_why_disabled

LANE_AXIS_MIN_WIDTH = 40
LANE_AXIS_MAX_WIDTH = 240
"""The lane-label column is as wide as its longest label plus LANE_AXIS_MARGIN (tick and gap), within these."""
LANE_AXIS_MARGIN = 16
LANE_MIN_LINES = 1.3
"""A lane's least height in lines of text: its name stays apart from its neighbours'."""
PLOT_FRAME_LINES = 8.5
"""The plot's title, time axis and margins, in lines of text."""


class TimelineView(TimelineInspection, TimelineLegend, QWidget):
    """Measured (and optionally predicted) pipeline timeline with zoom, pan and follow-live.

    Feed it with ``append_events`` from the GUI thread (the ``EventBridge`` batches what
    worker threads produce); boxes appear at the next ~30 Hz frame.
    """

    follow_live_changed = Signal(bool)
    predicted_visibility_changed = Signal(bool)
    selection_changed = Signal(object)
    """The selected ``TimelineEvent`` (None when nothing is)."""

    HINT = ("Click a box for its details · Shift+drag to sum a range · W/S zoom, A/D pan, "
            "Ctrl+wheel zoom, F fit")

    def __init__(self, parent: QWidget | None = None, frame_rate_hz: float = 30.0):
        super().__init__(parent)
        self.setAccessibleName("Pipeline timeline")
        self.setAccessibleDescription("W/S, +/- or Ctrl+wheel to zoom, A/D, arrows or drag to pan, F to fit")
        self.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        self._lanes: list[str] = []
        self._lane_of: dict[str, int] = {}
        self._lane_notes: dict[str, str] = {}
        """Device -> its role in the run, shown after its name (attention offloading: compute
        replica / attention)."""
        self._pending: list[TimelineEvent] = []
        self._predicted_events: list[TimelineEvent] = []
        self._micro_batches: set[int] = set()
        self._follow_live = True
        self._setting_range = False

        self.follow_check = QCheckBox("Follow live")
        self.follow_check.setChecked(True)
        self.follow_check.setAccessibleName("Follow live")
        self.follow_check.setToolTip("Keep the newest events in view (turned off when you pan or zoom)")
        self.follow_check.toggled.connect(self._on_follow_check_toggled)
        self.predicted_check = QCheckBox("Show predicted")
        self.predicted_check.setAccessibleName("Show predicted timeline")
        self.predicted_check.setToolTip("Draw the simulator's prediction for the same plan as ghost boxes "
                                        "under the measured ones, with each stage's error in %")
        self.predicted_check.setEnabled(False)
        say_why_disabled({self.predicted_check: "no prediction for this run: it needs the plan's profile"})
        self.predicted_check.toggled.connect(self._on_predicted_check_toggled)
        self.fit_button = QPushButton("Fit")
        self.fit_button.setAccessibleName("Fit timeline")
        self.fit_button.setToolTip("Zoom to show the whole run (F)")
        self.fit_button.setShortcut("F")
        self.fit_button.clicked.connect(self.fit_all)
        self.legend_label = QLabel()
        self.legend_label.setAccessibleName("Timeline legend")
        self._legend_terms = LEGEND_TERMS
        self._legend_micro_batches, self._colour_word = True, "mb"
        self.legend_label.setToolTip(LEGEND_TOOLTIP)
        # a legend that grows with the micro-batches seen must not widen the view's minimum: in the
        # Run screen's splitter that pushed the settings pane aside when a run ended (the page jumped).
        # Where its one line does not fit, the toolbar wraps (legend on a row of its own) and the
        # legend wraps between entries (never inside one), instead of clipping its last words.
        self.legend_label.setMinimumWidth(40)
        self.legend_label.setWordWrap(True)

        self.highlight_combo = QComboBox()
        self.highlight_combo.setAccessibleName("Highlight")
        self.highlight_combo.setToolTip("Which boxes a click highlights with the selected one")
        self._offer_highlights()
        # as wide as its widest entries: a spatial run's shorter ones left the legend room to wrap beside it
        self.highlight_combo.setMinimumWidth(self.highlight_combo.sizeHint().width())
        self.highlight_combo.currentIndexChanged.connect(self._update_overlay)

        # One row where there is room, two where the view is narrow (a 1024 px screen): the
        # toolbar's minimum is the two-row one, so it never widens the Run or Sessions page.
        self.toolbar = QWidget()
        self._bar = QGridLayout(self.toolbar)
        self._bar.setContentsMargins(4, 2, 8, 2)
        self._bar.setVerticalSpacing(2)
        self._bar_wrapped: tuple[bool, bool] | None = None
        self._legend_width = 0
        self._arrange_toolbar(wrapped=True)
        self.toolbar.setMinimumWidth(self._bar.minimumSize().width())
        self._arrange_toolbar(wrapped=False)
        self._one_row_width = self._bar.minimumSize().width() - self.legend_label.minimumWidth()
        """The one-row toolbar's width without its legend (the legend's own width is added when deciding)."""
        self.details_label = QLabel(self.HINT)
        self.details_label.setAccessibleName("Selection details")
        self.details_label.setWordWrap(True)
        self.details_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        # a fixed number of lines (two, three where the view is narrow): selecting a box or a
        # range never moves the plot
        self._fit_details_label(lines=2)
        self.details_label.setContentsMargins(6, 0, 6, 0)

        self.plot_widget = pg.GraphicsLayoutWidget()
        self.plot_widget.setAccessibleName("Timeline plot")
        self.plot_widget.setToolTip("")
        # keys go to the view as soon as the pointer is over the plot (no focus click first)
        self.plot_widget.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.plot_widget.viewport().installEventFilter(self)
        range_box = RangeSelectViewBox()
        range_box.range_dragged.connect(self._on_range_dragged)
        self.measured_plot = self.plot_widget.addPlot(row=0, col=0, viewBox=range_box)
        self.measured_item = TimelineBoxesItem()
        self.predicted_item = TimelineBoxesItem(ghost=True)
        self.predicted_item.setZValue(-1)
        self.predicted_item.setVisible(False)
        self.overlay_item = TimelineOverlayItem()
        plot = self.measured_plot
        plot.addItem(self.predicted_item)
        plot.addItem(self.measured_item)
        plot.addItem(self.overlay_item)
        plot.setMenuEnabled(False)
        plot.hideButtons()
        plot.setMouseEnabled(x=True, y=False)
        plot.invertY(True)
        plot.setLabel("bottom", "time", units="s")
        plot.showGrid(x=True, y=False, alpha=0.25)
        # major ticks only: every grid line is a full-height line redrawn on each pan
        plot.getAxis("bottom").setStyle(maxTickLevel=0)
        vb = plot.getViewBox()
        vb.disableAutoRange()
        vb.setLimits(xMin=-0.05, minXRange=1e-5)
        vb.setYRange(0, 1, padding=0.02)
        vb.sigRangeChangedManually.connect(self._on_viewbox_range_changed_manually)
        self.plot_widget.scene().sigMouseMoved.connect(self._on_scene_mouse_moved)
        self.plot_widget.scene().sigMouseClicked.connect(self._on_scene_mouse_clicked)
        self._selected: int | None = None
        self._range: tuple[float, float] | None = None
        self._hover: int | None = None
        self._errors: dict[int, float] = {}

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.toolbar)
        layout.addWidget(self.details_label)
        layout.addWidget(self.plot_widget, 1)

        self._frame_timer = QTimer(self)
        self._frame_timer.setInterval(max(1, int(1000 / frame_rate_hz)))
        self._frame_timer.timeout.connect(self._on_frame_timer_timeout)
        self._errors_timer = QTimer(self)
        self._errors_timer.setSingleShot(True)
        self._errors_timer.setInterval(500)
        self._errors_timer.timeout.connect(self._update_errors)
        self._boxes_kind = "measured"
        self._apply_palette()
        self._update_legend()
        self._update_lane_axis()  # no lanes yet: no numeric ticks on the lane axis

    def _arrange_toolbar(self, wrapped: bool, legend_alone: bool = False) -> None:
        """Toolbar in one row, or in two (highlight and legend below) where the view is narrow, or
        in three (the legend on a row of its own) where even the second row has no room for it."""
        layout = (wrapped, legend_alone and wrapped)
        if layout == self._bar_wrapped:
            return
        self._bar_wrapped = layout
        bar = self._bar
        widgets = (self.follow_check, self.predicted_check, self.fit_button, self.highlight_combo, self.legend_label)
        for w in widgets:
            bar.removeWidget(w)
        for column in range(6):
            bar.setColumnStretch(column, 0)
        bar.addWidget(self.follow_check, 0, 0)
        bar.addWidget(self.predicted_check, 0, 1)
        bar.addWidget(self.fit_button, 0, 2)
        if wrapped:
            bar.addWidget(self.highlight_combo, 1, 0, 1, 2)
            if legend_alone:
                bar.addWidget(self.legend_label, 2, 0, 1, 6)
            else:
                bar.addWidget(self.legend_label, 1, 2, 1, 4)
            bar.setColumnStretch(5, 1)
            self.legend_label.setMinimumWidth(40)
        else:  # chosen only where the whole legend fits (``_arrange_for_width``): it gets that width
            bar.addWidget(self.highlight_combo, 0, 3)
            bar.addWidget(self.legend_label, 0, 5)
            bar.setColumnStretch(4, 1)
            self.legend_label.setMinimumWidth(max(40, self._legend_width))

    def hide_live_controls(self) -> None:
        """A recorded run shown for itself (Compare): no Follow live nor Show predicted, and the
        toolbar's one row is measured without them (else Fit sat alone on a row of its own)."""
        self.follow_check.setVisible(False)
        self.predicted_check.setVisible(False)
        self._bar_wrapped = None
        self._arrange_toolbar(wrapped=False)
        self._bar.invalidate()
        self._one_row_width = self._bar.minimumSize().width() - self.legend_label.minimumWidth()
        self._arrange_for_width(self.width())

    def _fit_details_label(self, lines: int) -> None:
        self.details_label.setFixedHeight(lines * self.details_label.fontMetrics().lineSpacing() + 6)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._arrange_for_width(event.size().width())

    def _arrange_for_width(self, width: int) -> None:
        """One toolbar row where the whole legend fits beside the controls, else two."""
        narrow = width < self._one_row_width + self._legend_width
        beside = width - max(self.highlight_combo.sizeHint().width(), self.highlight_combo.minimumWidth()) - 24  # the legend's room on the second row
        self._arrange_toolbar(wrapped=narrow, legend_alone=beside < self._legend_width)
        self.legend_label.setMinimumWidth(40 if narrow else max(40, self._legend_width))
        self._fit_details_label(lines=3 if narrow else 2)

    # -- public API ----------------------------------------------------------------------
    def set_lanes(self, devices: Sequence[str]) -> None:
        """Fix the lane order (e.g. stage order of the plan); unknown devices append later."""
        for device in devices:
            self._lane_index(device)
        self._update_lane_axis()

    def lanes(self) -> list[str]:
        return list(self._lanes)

    def set_lane_notes(self, notes: dict[str, str]) -> None:
        """Each device's role in the run, shown after its lane's name (events still go by device)."""
        self._lane_notes = dict(notes)
        self._update_lane_axis()

    def lane_labels(self) -> list[str]:
        """The lane axis's labels, top lane first."""
        return [self._lane_label(i, name) for i, name in enumerate(self._lanes)]

    def append_events(self, events: Iterable[TimelineEvent]) -> None:
        """Queue measured events; they are drawn at the next frame (~30 Hz)."""
        self._pending.extend(events)
        if self._pending and not self._frame_timer.isActive():
            self._frame_timer.start()

    def set_predicted(self, events: Sequence[TimelineEvent]) -> None:
        """Replace the predicted timeline (shown below the measured one when enabled)."""
        self._predicted_events = list(events)
        self.predicted_item.clear()
        for event in events:
            self._lane_index(event.device)
        self.predicted_item.add(self._rows(events), list(events))
        self._errors = stage_errors(self.predicted_item.boxes.rows, self.measured_item.boxes.rows)
        self._update_lane_axis()
        self.predicted_check.setEnabled(bool(events))
        if not events:
            self.predicted_check.setChecked(False)
        elif not self.measured_item.boxes.size:
            self.fit_all()  # before a run, show the whole prediction

    def clear(self) -> None:
        """Forget all measured and predicted boxes and lanes (a new run)."""
        self._pending.clear()
        self._frame_timer.stop()
        self.measured_item.clear()
        self.predicted_item.clear()
        self._predicted_events = []
        self._lanes.clear()
        self._lane_of.clear()
        self._lane_notes = {}
        self._micro_batches.clear()
        self._errors = {}
        self._hover = None
        self.select(None)
        self._update_legend()
        self.predicted_check.setEnabled(False)
        self.predicted_check.setChecked(False)
        self._update_lane_axis()
        self.set_follow_live(True)
        self._set_x_range(0.0, 1.0)

    def flush(self) -> None:
        """Apply queued events now (the frame timer does this ~30 times a second)."""
        self._on_frame_timer_timeout()
        if self.predicted_item.boxes.size:
            self._update_errors()

    def box_count(self, device: str | None = None, kind: str | None = None,
                  predicted: bool = False) -> int:
        rows = (self.predicted_item if predicted else self.measured_item).boxes.rows
        mask = np.ones(len(rows), dtype=bool)
        if device is not None:
            mask &= rows["lane"] == self._lane_of.get(device, -1)
        if kind is not None:
            mask &= rows["kind"] == KIND_CODE[kind]
        return int(mask.sum())

    def boxes(self, predicted: bool = False) -> np.ndarray:
        """All boxes as a structured array in a canonical order (to compare two timelines)."""
        rows = (self.predicted_item if predicted else self.measured_item).boxes.rows.copy()
        return np.sort(rows, order=["lane", "start_s", "kind", "micro_batch", "step", "end_s"])

    def follow_live(self) -> bool:
        return self._follow_live

    def set_follow_live(self, on: bool) -> None:
        if on == self._follow_live and self.follow_check.isChecked() == on:
            return
        self._follow_live = on
        self.follow_check.blockSignals(True)
        self.follow_check.setChecked(on)
        self.follow_check.blockSignals(False)
        if on:
            self._follow()
        self.follow_live_changed.emit(on)

    def show_predicted(self, on: bool) -> None:
        self.predicted_check.setChecked(on)

    def clip_predicted_to_run(self) -> None:
        """A run that ended (at EOS, or stopped) generated fewer tokens than predicted: the ghosts
        of steps it never ran are dropped, so the whole-run view fits what ran (a demo run that
        stopped at ~120 ms had an axis to ~770 ms, 80 % of it empty ghosts)."""
        rows = self.measured_item.boxes.rows
        if not rows.size or not self._predicted_events:
            return
        last = int(rows["step"].max())
        kept = [e for e in self._predicted_events if e.step <= last]
        if len(kept) < len(self._predicted_events):
            self.set_predicted(kept)

    def show_whole_run(self) -> None:
        """A live run ended: if the view was following it, show all of it. Following keeps a window
        as wide as the prediction shown before the run, so the start of a longer run (its prefill)
        was left scrolled out of view; a range the operator chose is kept."""
        if self._follow_live and self.measured_item.max_end() > 0:
            self.fit_all()

    def fit_all(self) -> None:
        """The whole run, and its ghosts when they are shown or nothing ran yet (hidden ones
        predicted slower than the run left the attention-offload demo run's axis 40 % empty)."""
        shown = self.predicted_check.isChecked() or not self.measured_item.boxes.size
        ghosts = self.predicted_item.max_end() if shown else 0.0
        end = max(self.measured_item.max_end(), ghosts, 1e-3)
        self._set_x_range(0.0, end * 1.02)

    def x_range(self) -> tuple[float, float]:
        return tuple(self.measured_plot.getViewBox().viewRange()[0])

    def set_x_range(self, x0: float, x1: float) -> None:
        """Zoom/pan programmatically (like a user would: follow-live turns off)."""
        self.set_follow_live(False)
        self._set_x_range(x0, x1)

    def event_at(self, x: float, device: str, band: str = "compute",
                 predicted: bool = False) -> TimelineEvent | None:
        lane = self._lane_of.get(device)
        if lane is None:
            return None
        b0, b1 = BANDS[KIND_CODE[band]]
        item = self.predicted_item if predicted else self.measured_item
        return item.box_at(x, lane + (b0 + b1) / 2)

    def keyPressEvent(self, event) -> None:
        """Keyboard zoom and pan (as Perfetto): W / + and S / - zoom around the centre,
        A / Left and D / Right pan by a tenth; Escape clears the selection."""
        x0, x1 = self.x_range()
        width, centre = x1 - x0, (x0 + x1) / 2
        key = event.key()
        if key in (Qt.Key.Key_Plus, Qt.Key.Key_Equal, Qt.Key.Key_W):
            self.set_x_range(centre - width / 3, centre + width / 3)
        elif key in (Qt.Key.Key_Minus, Qt.Key.Key_S):
            self.set_x_range(max(0.0, centre - width * 0.75), centre + width * 0.75)
        elif key in (Qt.Key.Key_Left, Qt.Key.Key_A):
            shift = min(width / 10, x0)
            self.set_x_range(x0 - shift, x1 - shift)
        elif key in (Qt.Key.Key_Right, Qt.Key.Key_D):
            self.set_x_range(x0 + width / 10, x1 + width / 10)
        elif key == Qt.Key.Key_Escape:
            self.select(None)
        else:
            super().keyPressEvent(event)

    # -- internals -----------------------------------------------------------------------
    def _lane_index(self, device: str) -> int:
        lane = self._lane_of.get(device)
        if lane is None:
            lane = self._lane_of[device] = len(self._lanes)
            self._lanes.append(device)
        return lane

    def _rows(self, events: Sequence[TimelineEvent]) -> np.ndarray:
        rows = np.empty(len(events), dtype=BOX_DTYPE)
        if not len(events):
            return rows
        rows["lane"] = [self._lane_index(e.device) for e in events]
        rows["stage"] = [e.stage for e in events]
        rows["kind"] = [KIND_CODE[e.kind] for e in events]
        rows["phase"] = [PHASE_CODE[e.phase] for e in events]
        rows["micro_batch"] = [e.micro_batch for e in events]
        rows["step"] = [e.step for e in events]
        rows["start_s"] = [e.start_s for e in events]
        rows["end_s"] = [e.end_s for e in events]
        rows["nbytes"] = [e.nbytes for e in events]
        return rows

    def _on_frame_timer_timeout(self) -> None:
        if not self._pending:
            self._frame_timer.stop()
            return
        events, self._pending = self._pending, []
        lanes_before = len(self._lanes)
        rows = self._rows(events)
        self.measured_item.add(rows, events)
        if len(self._lanes) != lanes_before:
            self._update_lane_axis()
        new_mbs = set(np.unique(rows["micro_batch"]).tolist()) - self._micro_batches
        if new_mbs:
            self._micro_batches |= new_mbs
            self._update_legend()
        if self._follow_live:
            self._follow()
        if self.predicted_item.boxes.size and not self._errors_timer.isActive():
            self._errors_timer.start()  # at most twice a second, however fast events arrive

    def _follow(self) -> None:
        end = self.measured_item.max_end()
        if end <= 0:
            return
        x0, x1 = self.x_range()
        width = x1 - x0
        if end <= width:  # the whole run still fits: show it from the start
            self._set_x_range(0.0, max(width, end * 1.05))
        else:
            self._set_x_range(end - width * 0.95, end + width * 0.05)

    def _set_x_range(self, x0: float, x1: float) -> None:
        self._setting_range = True
        try:
            self.measured_plot.getViewBox().setXRange(x0, x1, padding=0)
        finally:
            self._setting_range = False

    def _update_lane_axis(self) -> None:
        n = max(1, len(self._lanes))
        ticks = [[(i + 0.5, self._lane_label(i, name)) for i, name in enumerate(self._lanes)], []]
        plot = self.measured_plot
        axis = plot.getAxis("left")
        axis.setTicks(ticks)
        # as wide as the longest lane label: a fixed 120 px left the boxes ~145 px of a 1024x700
        # Run screen's timeline for labels like "edge-a" (~45 px), and clipped longer ones
        metrics = QFontMetrics(axis.style["tickFont"] or axis.font())
        widest = max((metrics.horizontalAdvance(label) for _, label in ticks[0]), default=0)
        axis.setWidth(min(LANE_AXIS_MAX_WIDTH, max(LANE_AXIS_MIN_WIDTH, widest + LANE_AXIS_MARGIN)))
        for item in (self.measured_item, self.predicted_item):
            item.set_lane_count(n)
        vb = plot.getViewBox()
        vb.setLimits(yMin=-0.05, yMax=n + 0.05)
        vb.setYRange(0, n, padding=0.0)
        # a line of text per lane at least: at 1024x700 EPD's five lanes got ~11 px each below the
        # toolbar and details and their names overlapped; the page around gives way instead
        line = self.fontMetrics().height()
        self.plot_widget.setMinimumHeight(round(n * line * LANE_MIN_LINES + PLOT_FRAME_LINES * line))

    def _lane_label(self, lane: int, name: str) -> str:
        error = self._errors.get(lane) if self.predicted_check.isChecked() else None
        note = self._lane_notes.get(name)
        shown = name if not note else f"{name} · {note}"
        return shown if error is None else f"{shown}  {error:+.0f} %"

    def stage_errors(self) -> dict[str, float]:
        """Device -> prediction error in % of its compute time (what the lane labels show)."""
        return {self._lanes[lane]: err for lane, err in self._errors.items() if lane < len(self._lanes)}

    def _update_errors(self) -> None:
        errors = stage_errors(self.predicted_item.boxes.rows, self.measured_item.boxes.rows)
        if errors != self._errors:
            self._errors = errors
            self._update_lane_axis()

    def _on_follow_check_toggled(self, on: bool) -> None:
        self.set_follow_live(on)

    def _on_predicted_check_toggled(self, on: bool) -> None:
        self.predicted_item.setVisible(on)
        self._show_title()
        self._update_lane_axis()
        self.predicted_visibility_changed.emit(on)

    def set_boxes_kind(self, kind: str) -> None:
        """Name what the solid boxes are in the title: a run's kind (measured, simulated, predicted).
        A predicted run's replay draws the simulator's timeline, and its plot was titled "measured"."""
        self._boxes_kind = kind or "measured"
        self._show_title()

    def _show_title(self) -> None:
        ghosts = ", predicted as dashed ghosts (lane: prediction error)" if self.predicted_item.isVisible() else ""
        # LabelItem writes its colour into the title's HTML, so the text is set again with it
        self.measured_plot.setTitle(self._boxes_kind + ghosts, size="9pt", color=self._text_colour)

    def _on_viewbox_range_changed_manually(self, *_args) -> None:
        if not self._setting_range and self._follow_live:
            self.set_follow_live(False)

    def eventFilter(self, obj, event) -> bool:
        if obj is self.plot_widget.viewport():
            if event.type() == QEvent.Type.Enter and not self.hasFocus():
                self.setFocus(Qt.FocusReason.MouseFocusReason)
            elif event.type() == QEvent.Type.Leave:
                self._hover = None
        return super().eventFilter(obj, event)

    # -- palette (light / dark) ----------------------------------------------------------
    def changeEvent(self, event: QEvent) -> None:
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            self._apply_palette()
        super().changeEvent(event)

    def _apply_palette(self) -> None:
        pal = self.palette()
        base = pal.color(QPalette.ColorRole.Base)
        text = pal.color(QPalette.ColorRole.Text)
        dark = base.lightness() < 128
        self.plot_widget.setBackground(base)
        self._text_colour = text.name()
        plot = self.measured_plot
        for name in ("left", "bottom"):
            axis = plot.getAxis(name)
            axis.setPen(pg.mkPen(text))
            axis.setTextPen(pg.mkPen(text))
        self._show_title()
        for item in (self.measured_item, self.predicted_item):
            item.set_dark(dark)
        self.overlay_item.set_colour(QColor("#f5f5f5") if dark else QColor("#111111"))

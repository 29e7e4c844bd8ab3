"""What a run looks like while it happens: timeline, figures, tokens/s, utilisation, text.

The Run screen feeds it live (through the EventBridge) and the Sessions screen feeds it
from a replay, through the same two methods and the same ``core.runs.metrics`` functions,
so a replayed run shows exactly what was seen live. ``core.runs.metrics.LiveMetrics``
keeps the O(events) parts up to date per event, so the figures, redrawn on a 4 Hz timer
(not per event), cost O(tokens) on the GUI thread however long the run.
"""

from __future__ import annotations

import math

from typing import Sequence

import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt, QTimer
from PySide6.QtGui import QFont, QPalette
from PySide6.QtWidgets import (QFrame, QGridLayout, QHBoxLayout, QLabel, QPlainTextEdit,
                               QProgressBar, QScrollArea, QSplitter, QVBoxLayout, QWidget)

from agents.protocol import TimelineEvent, TokenEvent, storage_lane
from core.runs.metrics import LiveMetrics, RunFigures, tokens_per_s_over_time
from gui.techniques.expert_offload.heat_map import ExpertHeatMap
from gui.techniques import speculative
from gui.screens.image_figures import IMAGE_CARDS, IMAGE_HEADINGS, class_text, is_image_run
from gui.techniques.phase_disaggregation.replay_panel import EpdRequestsPanel
from gui.screens.run_legends import name_boxes
from gui.timeline import TimelineView
from gui.widgets import MetricCard


def rate_window_s(duration_s: float) -> float:
    """Window of the tokens/s plot: about 40 windows over the run, at least 50 ms."""
    for w in (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0):
        if duration_s / w <= 40:
            return w
    return 30.0


def _ms(s: float | None) -> str:
    return "—" if s is None else f"{s * 1000:.1f} ms"



class SparseAxis(pg.AxisItem):
    """A vertical axis for a short plot (~100 px): one labelled tick per ``MIN_GAP_PX`` at most, at
    1, 2 or 5 × 10^k, so the labels never crowd or clip (pyqtgraph puts at least 2.25 intervals on
    any axis: six labels 0 … 1.0 on top of one another in the Run screen's rate plot)."""

    MIN_GAP_PX = 28

    def tickSpacing(self, minVal: float, maxVal: float, size: float):
        span = abs(maxVal - minVal)
        if span == 0 or size <= 0:
            return []
        intervals = max(1, int(size // self.MIN_GAP_PX))
        raw = span / intervals
        unit = 10 ** math.floor(math.log10(raw))
        step = next(f * unit for f in (1, 2, 5, 10) if f * unit >= raw)
        return [(step, 0.0)]

def nice_ceiling(value: float) -> float:
    """The least 1, 2 or 5 x 10^k at or above ``value`` (1 for nothing): a tick SparseAxis labels."""
    if value <= 0:
        return 1.0
    unit = 10 ** math.floor(math.log10(value))
    return next(f * unit for f in (1, 2, 5, 10) if f * unit >= value * (1 - 1e-9))


class RunMonitorView(QWidget):
    """Timeline + figures + generated text of one run (live or replayed)."""

    def __init__(self, parent: QWidget | None = None, refresh_hz: float = 4.0):
        super().__init__(parent)
        self.setAccessibleName("Run monitor")
        self.metrics = LiveMetrics()
        self._reads: dict[str, float] = {}
        self._texts: dict[int, list[str]] = {}
        self._prompts: tuple[str, ...] = ()
        self._dirty = False
        self._last_figures = RunFigures()

        self.timeline = TimelineView()

        self.ttft_card = MetricCard("TTFT", "Time to first token: the prefill's token reaching the source")
        self.latency_card = MetricCard("Latency / token", "Mean time between a sequence's consecutive tokens")
        self.rate_card = MetricCard("Decode tokens/s", "Tokens per second over the decode steps")
        self.tokens_card = MetricCard("Tokens", "Tokens generated so far")
        self._lm_cards = tuple((c.accessibleName(), c.toolTip()) for c in self._cards())
        self._image_run = False
        self._class_labels: tuple[str, ...] | None = ()
        cards = QGridLayout()  # 2 x 2: readable in a narrow side column
        for i, card in enumerate((self.ttft_card, self.latency_card, self.rate_card, self.tokens_card)):
            cards.addWidget(card, i // 2, i % 2)

        self.rate_plot = pg.PlotWidget(axisItems={"left": SparseAxis("left")})
        self.rate_plot.setAccessibleName("Tokens per second over time")
        self.rate_plot.setToolTip("Tokens arrived per second, in windows over the run")
        self.rate_plot.setMenuEnabled(False)
        self.rate_plot.hideButtons()
        self.rate_plot.setMouseEnabled(x=False, y=False)
        # no left-axis title: the heading above says "Tokens per second", and at 1024x700 the
        # plot is too short for a vertical "tokens/s" (it was cut to "tokens/")
        self.rate_plot.setLabel("bottom", "time", units="s")
        self.rate_plot.setMinimumHeight(80)  # with three devices' bars the column still fits 1024x700
        self.rate_plot.getAxis("bottom").setStyle(maxTickLevel=0)
        self.rate_plot.getViewBox().setDefaultPadding(0.1)
        # room above the plot for half the top tick's label (the view's top is a tick: ``refresh``)
        left, _, right, bottom = self.rate_plot.getPlotItem().layout.getContentsMargins()
        self.rate_plot.getPlotItem().layout.setContentsMargins(left, self.fontMetrics().height() // 2 + 2,
                                                               right, bottom)
        self._empty_rate_range()
        self.rate_curve = self.rate_plot.plot([], [], stepMode="center", fillLevel=0,
                                              pen=pg.mkPen("#4e79a7", width=2), brush=(78, 121, 167, 80))

        self.util_box = QWidget()
        self.util_box.setAccessibleName("Compute utilisation")
        self.util_box.setToolTip("Fraction of the run each device spent computing")
        self._util_layout = QGridLayout(self.util_box)
        self._util_layout.setContentsMargins(0, 0, 0, 0)
        self.util_bars: dict[str, QProgressBar] = {}

        self.heat_map = ExpertHeatMap()  # shown once a run carries expert activity (expert offloading)
        self.heat_map.setMinimumHeight(110)
        self.trips_plot = speculative.TokensPerTripPlot()  # shown once a run drafts (speculative decoding)
        self.requests_panel = EpdRequestsPanel()  # shown for a recorded EPD run (its requests and SLO figures)

        self.text_edit = QPlainTextEdit()
        self.text_edit.setReadOnly(True)
        self.text_edit.setAccessibleName("Generated text")
        self.text_edit.setToolTip("The generated text of every sequence, as it streams")
        self.text_edit.setPlaceholderText("Generated text appears here as tokens arrive.")
        self.text_edit.setMinimumHeight(48)
        mono = QFont("monospace")
        mono.setStyleHint(QFont.StyleHint.Monospace)
        self.text_edit.setFont(mono)

        side = QWidget()
        side_layout = QVBoxLayout(side)
        side_layout.setContentsMargins(0, 0, 0, 0)
        side_layout.addLayout(cards)
        self.wire_label = QLabel()  # after a run (or in a recorded run's replay): what its sockets sent
        self.wire_label.setAccessibleName("Wire bytes")
        self.wire_label.setVisible(False)
        side_layout.addWidget(self.wire_label)
        for title, widget, stretch in (("Tokens per second", self.rate_plot, 1),
                                       ("Compute utilisation", self.util_box, 0),
                                       ("Expert buffer (blocks × experts)", self.heat_map, 2),
                                       (speculative.PLOT_TITLE, self.trips_plot, 1),
                                       ("Requests (EPD)", self.requests_panel, 2),
                                       ("Generated text", self.text_edit, 2)):
            label = QLabel(title)
            label.setProperty("role", "metricLabel")
            side_layout.addWidget(label)
            side_layout.addWidget(widget, stretch)
            if widget is self.heat_map:
                self.heat_map_label = label
            if widget is self.trips_plot:
                self.trips_label = label
            if widget is self.requests_panel:
                self.requests_label = label
            if widget is self.rate_plot:
                self.rate_label = label
            if widget is self.text_edit:
                self.text_label = label
        self._show_heat_map(False)
        self._show_trips(False)
        self.requests_panel.hide()
        self.requests_label.hide()

        # the side column scrolls rather than setting the monitor's minimum height (~404 px): the
        # Sessions screen stacks its runs list above the replay and leaves it ~300 px at 1024x700;
        # where the column fits (the Run screen at 1024x700 and up) no scroll bar shows
        self.side_scroll = QScrollArea()
        self.side_scroll.setAccessibleName("Run figures")
        self.side_scroll.setWidget(side)
        self.side_scroll.setWidgetResizable(True)
        self.side_scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.side_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.setChildrenCollapsible(False)
        splitter.addWidget(self.timeline)
        splitter.addWidget(self.side_scroll)
        splitter.setStretchFactor(0, 2)
        splitter.setStretchFactor(1, 1)
        side.setMinimumWidth(256)
        self.side_scroll.setMinimumWidth(256 + self.side_scroll.verticalScrollBar().sizeHint().width())
        splitter.setSizes([760, 360])
        self.splitter = splitter
        self.stack_below_width = 0
        """Below this width the figures go under the timeline (0: never; the Run screen sets it: at
        1024x700 the column beside left the timeline ~90 px of plot)."""
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(splitter)

        self._refresh_timer = QTimer(self)
        self._refresh_timer.setInterval(int(1000 / refresh_hz))
        self._refresh_timer.timeout.connect(self._on_refresh_timer_timeout)
        self._apply_palette()

    # -- feeding -------------------------------------------------------------------------
    def reset(self, lanes: Sequence[str] = (), prompts: Sequence[str] = (),
              lane_notes: dict[str, str] | None = None, settings: dict | None = None,
              wire: dict | None = None, class_labels: tuple[str, ...] | None = ()) -> None:
        """Start over for a new run (or a replay seek): nothing drawn, no figures. ``lane_notes``:
        each device's role in the run, shown beside its lane; ``settings``: a recorded run's (an
        EPD run's show its requests and SLO figures); ``wire``: a recorded run's wire figures;
        ``class_labels``: an image run's class names (None: a prediction, no classes)."""
        self._class_labels = class_labels
        self.set_wire(wire)
        self.metrics = LiveMetrics()
        self._reads = {}  # storage lane -> seconds of expert reads so far (its bar shows reads, not compute)
        self._texts = {}
        self._prompts = tuple(prompts)
        self.timeline.clear()
        self.timeline.set_lanes(list(lanes))
        self.timeline.set_lane_notes(lane_notes or {})
        self._clear_util_devices()
        self._set_util_devices(list(lanes))
        self.heat_map.reset()
        self._show_heat_map(False)
        self._show_trips(False)
        self._image_run = is_image_run(settings)
        name_boxes(self.timeline, settings)
        for card, (label, tip) in zip(self._cards(), IMAGE_CARDS if self._image_run else self._lm_cards):
            card.set_label(label, tip)
        rate_heading, text_heading = IMAGE_HEADINGS if self._image_run else ("Tokens per second", "Generated text")
        self.rate_label.setText(rate_heading)
        self.text_label.setText(text_heading)
        shown = self.requests_panel.show_settings(settings)
        self.requests_panel.setVisible(shown)
        self.requests_label.setVisible(shown)
        self._dirty = True
        self.refresh()

    def _cards(self) -> tuple[MetricCard, ...]:
        return self.ttft_card, self.latency_card, self.rate_card, self.tokens_card

    def add_timeline_events(self, events: Sequence[TimelineEvent]) -> None:
        if not events:
            return
        add = self.metrics.add_event
        for event in events:
            add(event)
            if event.kind == "io" and event.device.endswith(storage_lane("")):
                self._reads[event.device] = self._reads.get(event.device, 0.0) + max(0.0, event.end_s - event.start_s)
        self.timeline.append_events(events)
        if self.heat_map.add_events(events) and self.heat_map.isHidden():
            self._show_heat_map(True)
        if self.trips_plot.isHidden() and speculative.is_speculative(events):
            self._show_trips(True)
        self._mark_dirty()

    def add_token_events(self, tokens: Sequence[TokenEvent]) -> None:
        if not tokens:
            return
        for tok in tokens:
            self.metrics.add_tokens(tok)
            pieces = (tuple(class_text(t, self._class_labels) for t in tok.token_ids) if self._image_run
                      else tok.text or tuple(f"[{t}]" for t in tok.token_ids))
            for seq, piece in zip(tok.sequence_ids, pieces):
                self._texts.setdefault(seq, []).append(piece)
        self._mark_dirty()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        narrow = 0 < event.size().width() < self.stack_below_width
        orientation = Qt.Orientation.Vertical if narrow else Qt.Orientation.Horizontal
        if self.splitter.orientation() != orientation:
            self.splitter.setOrientation(orientation)
            self.splitter.setSizes([3 * event.size().height() // 5, 2 * event.size().height() // 5] if narrow
                                   else [760, 360])

    def set_predicted(self, events: Sequence[TimelineEvent]) -> None:
        self.timeline.set_predicted(events)

    def flush(self) -> None:
        """Draw and compute everything fed so far, now (end of a run, tests)."""
        self.timeline.flush()
        self.refresh()

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Stop refreshing (nothing here runs on another thread)."""
        self._refresh_timer.stop()
        return True

    def set_wire(self, wire: dict | None) -> None:
        """Show a run's wire figures (``core.runs.wire.wire_figures``; None or unmeasured: hidden)."""
        text = wire_text(wire)
        self.wire_label.setText(text)
        self.wire_label.setToolTip(wire_tooltip(wire))
        self.wire_label.setVisible(bool(text))

    # -- reading -------------------------------------------------------------------------
    @property
    def events(self) -> list[TimelineEvent]:
        return self.metrics.events

    @property
    def tokens(self) -> list[TokenEvent]:
        return self.metrics.tokens

    def figures(self) -> RunFigures:
        return self._last_figures

    def text_of(self, sequence: int) -> str:
        return "".join(self._texts.get(sequence, []))

    # -- internals -----------------------------------------------------------------------
    def _mark_dirty(self) -> None:
        self._dirty = True
        if not self._refresh_timer.isActive():
            self._refresh_timer.start()

    def _on_refresh_timer_timeout(self) -> None:
        if not self._dirty:
            self._refresh_timer.stop()
            return
        self.refresh()

    def _empty_rate_range(self) -> None:
        """No tokens yet: 0 … 1 with the same padding data gets (autorange stays on for the run)."""
        self.rate_plot.getViewBox().setRange(yRange=(0, 1), padding=0.1, disableAutoRange=False)

    def refresh(self) -> None:
        """Recompute and show the figures now."""
        self._dirty = False
        fig = self.metrics.figures()
        self._last_figures = fig
        window = rate_window_s(fig.duration_s)
        series = tokens_per_s_over_time(self.metrics.tokens, window)
        self.ttft_card.set_value(_ms(fig.ttft_s))
        self.latency_card.set_value(_ms(fig.per_token_latency_s))
        rate = fig.tokens_per_s if self._image_run else fig.decode_tokens_per_s  # images/s: every image counts
        self.rate_card.set_value("—" if rate is None else f"{rate:.1f}")
        self.tokens_card.set_value(str(fig.tokens))
        if series:
            xs = [t for t, _ in series] + [series[-1][0] + window]
            self.rate_curve.setData(xs, [r for _, r in series])
            # the top at a labelled tick: autorange's 10 % above the peak put SparseAxis' one step
            # (a 40 px plot has room for one) past the top, and the plot read only "0"
            top = nice_ceiling(max(r for _, r in series))
            self.rate_plot.getViewBox().setRange(yRange=(0, top), padding=0.0)
        else:
            self.rate_curve.setData([], [])
            self._empty_rate_range()
        self._set_util_devices(list(fig.utilisation))
        for device, bar in self.util_bars.items():
            reads = device.endswith(storage_lane(""))  # a storage lane never computes: its share reading experts
            frac = (min(1.0, self._reads.get(device, 0.0) / fig.duration_s) if reads and fig.duration_s > 0
                    else fig.utilisation.get(device, 0.0))
            bar.setValue(int(round(frac * 1000)))
            bar.setFormat(f"{'reads ' if reads else ''}{frac * 100:.0f} %")
            bar.setAccessibleDescription(f"{device}: {frac * 100:.0f} percent {'reading' if reads else 'busy'}")
        if not self.trips_plot.isHidden():
            self.trips_plot.set_tokens(self.metrics.tokens)
        self._render_text()

    def _show_trips(self, shown: bool) -> None:
        if shown or not self.trips_plot.isHidden():  # the legend names draft and rollback while they show
            self.timeline.set_legend_terms(*((speculative.SPECULATIVE_LEGEND_TERMS, speculative.SPECULATIVE_LEGEND_TOOLTIP)
                                             if shown else (speculative.LEGEND_TERMS, speculative.LEGEND_TOOLTIP)))
        self.trips_plot.setVisible(shown)
        self.trips_label.setVisible(shown)

    def _show_heat_map(self, shown: bool) -> None:
        self.heat_map.setVisible(shown)
        self.heat_map_label.setVisible(shown)

    def _set_util_devices(self, devices: list[str]) -> None:
        for device in devices:
            if device in self.util_bars:
                continue
            row = len(self.util_bars)
            label = QLabel(device)
            bar = QProgressBar()
            bar.setRange(0, 1000)
            bar.setValue(0)
            bar.setFormat("0 %")
            bar.setTextVisible(True)
            bar.setAccessibleName(f"Utilisation of {device}")
            bar.setToolTip(f"Fraction of the run {device} spent reading experts from storage"
                           if device.endswith(storage_lane("")) else f"Fraction of the run {device} spent computing")
            self._util_layout.addWidget(label, row, 0)
            self._util_layout.addWidget(bar, row, 1)
            self.util_bars[device] = bar

    def _clear_util_devices(self) -> None:
        while self._util_layout.count():
            item = self._util_layout.takeAt(0)
            if item.widget() is not None:
                item.widget().deleteLater()
        self.util_bars.clear()

    def _render_text(self) -> None:
        parts = []
        for seq in sorted(self._texts):
            head = f"#{seq}"
            if seq < len(self._prompts):
                head += f"  {self._prompts[seq]}"
            parts.append(f"Image {seq}: {', '.join(self._texts[seq])}" if self._image_run  # one line an image
                         else f"{head}\n{''.join(self._texts[seq])}")
        text = ("\n" if self._image_run else "\n\n").join(parts)
        if text != self.text_edit.toPlainText():
            bar = self.text_edit.verticalScrollBar()
            at_end = bar.value() >= bar.maximum() - 2
            self.text_edit.setPlainText(text)
            if at_end:
                bar.setValue(bar.maximum())

    def changeEvent(self, event: QEvent) -> None:
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            self._apply_palette()
        super().changeEvent(event)

    def _apply_palette(self) -> None:
        pal = self.palette()
        base = pal.color(QPalette.ColorRole.Base)
        text = pal.color(QPalette.ColorRole.Text)
        self.rate_plot.setBackground(base)
        self.trips_plot.apply_palette(base, text)
        for name in ("left", "bottom"):
            axis = self.rate_plot.getAxis(name)
            axis.setPen(pg.mkPen(text))
            axis.setTextPen(pg.mkPen(text))


def wire_text(wire: dict | None) -> str:
    """One short line of a run's wire figures (the side column has room for one): measured between
    agents, over the cost model's bytes, and after a re-plan the re-planned stages' ratio ("" when
    nothing was measured). ``wire_tooltip`` says it in words."""
    from core.planning.cost import format_bytes

    if not wire or wire.get("measured_bytes") is None:
        return ""
    text = f"Wire {format_bytes(wire['measured_bytes'])}"
    if wire.get("predicted_bytes"):
        text += f" · model ×{wire['measured_over_predicted']:.3f}"
    after = wire.get("after_replan") or {}
    if after.get("measured_over_predicted") is not None:
        text += f" · re-planned ×{after['measured_over_predicted']:.3f}"
    return text


def wire_tooltip(wire: dict | None) -> str:
    """The wire line in words: what was measured, what the cost model predicted."""
    from core.planning.cost import format_bytes

    if not wire or wire.get("measured_bytes") is None:
        return ""
    text = (f"The agents' sockets sent each other {format_bytes(wire['measured_bytes'])} during the run "
            "(frame headers included)")
    if wire.get("predicted_bytes"):
        text += f"; the cost model predicted {format_bytes(wire['predicted_bytes'])}"
    after = wire.get("after_replan") or {}
    if after.get("measured_bytes") is not None and after.get("predicted_bytes"):
        text += (f"; after the re-plan {format_bytes(after['measured_bytes'])} against the re-planned plan's "
                 f"{format_bytes(after['predicted_bytes'])}")
    return text + f"; {format_bytes(wire.get('control_bytes') or 0)} went to the coordinator"

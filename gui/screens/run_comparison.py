"""Two recorded runs side by side: timelines aligned at t = 0 on one time axis, and their
figures (TTFT, tokens/s, per-device utilisation, bubbles) in one table, headed by each run's
technique; below them each prompt with the text each run generated for it, side by side (two
techniques' runs of the same prompt: does the other technique give the same text, and how fast).

The runs are read on a worker (``load_comparison``); the figures are the same
``core.runs.metrics`` functions the live run and the replay use.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QHeaderView, QLabel, QPushButton, QScrollArea, QSplitter,
                               QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from agents.protocol import TimelineEvent, TokenEvent, storage_lane
from core.reporting import Reporter
from core.runs.metrics import RunFigures, bubbles, comparison_rows, compute_figures
from core.sessions.store import RunInfo, SessionStore
from gui.screens.image_figures import image_rows, is_image_run
from gui.screens.run_names import run_technique, run_title, technique_label, with_expert_buffer
from gui.screens.run_legends import name_boxes
from gui.timeline import TimelineView


@dataclass(frozen=True)
class ComparedRun:
    info: RunInfo
    events: list[TimelineEvent]
    tokens: list[TokenEvent]
    figures: RunFigures
    bubbles: dict[str, float]
    lanes: list[str]

    def prompts(self) -> list[str]:
        return [str(p) for p in (self.info.settings or {}).get("prompts") or ()]

    def texts(self) -> dict[int, str]:
        """The text the run generated per prompt (its sequence index), from its recorded token pieces."""
        out: dict[int, list[str]] = {}
        for tok in self.tokens:
            for i, seq in enumerate(tok.sequence_ids):
                out.setdefault(seq, []).append(tok.text[i] if i < len(tok.text) else f"[{tok.token_ids[i]}]")
        return {seq: "".join(pieces) for seq, pieces in out.items()}


def technique_row(a: ComparedRun, b: ComparedRun) -> tuple[str, str, str]:
    """The figures table's first row: each run's technique (its style and model are in its title)."""
    return ("Technique", technique_label(run_technique(a.info)), technique_label(run_technique(b.info)))


def read_shares(run: ComparedRun) -> dict[str, float]:
    """Storage lane -> the share of the run spent reading experts (an expert-offload run's)."""
    reads: dict[str, float] = {}
    for e in run.events:
        if e.kind == "io" and e.device.endswith(storage_lane("")):
            reads[e.device] = reads.get(e.device, 0.0) + max(0.0, e.end_s - e.start_s)
    dur = run.figures.duration_s
    return {d: min(1.0, r / dur) if dur > 0 else 0.0 for d, r in reads.items()}


def with_reads(rows: list[tuple[str, str, str]], a: ComparedRun, b: ComparedRun) -> list[tuple[str, str, str]]:
    """``rows`` with a storage lane's "Utilisation" (it never computes: always 0 %) as its "Reads" share."""
    shares = (read_shares(a), read_shares(b))
    out = []
    for name, va, vb in rows:
        lane = name.removeprefix("Utilisation · ")
        if lane != name and lane.endswith(storage_lane("")):
            name, va, vb = (f"Reads · {lane}", *(f"{s[lane] * 100:.0f} %" if lane in s else "—" for s in shares))
        out.append((name, va, vb))
    return out


def output_rows(a: ComparedRun, b: ComparedRun) -> list[tuple[str, str, str]]:
    """Per prompt (its index in the runs), (the prompt, run A's text, run B's text); a prompt the runs
    were not both given reads "A: … / B: …". None for runs that recorded no prompts (a simulation)."""
    prompts_a, prompts_b, texts_a, texts_b = a.prompts(), b.prompts(), a.texts(), b.texts()
    rows = []
    for i in range(max(len(prompts_a), len(prompts_b))):
        pa = prompts_a[i] if i < len(prompts_a) else "—"
        pb = prompts_b[i] if i < len(prompts_b) else "—"
        rows.append((pa if pa == pb else f"A: {pa} / B: {pb}", texts_a.get(i, "—"), texts_b.get(i, "—")))
    return rows


def load_comparison(reporter: Reporter, workspace: str, run_a: int, run_b: int) -> tuple[ComparedRun, ComparedRun]:
    """Worker job: both runs' events, tokens and figures."""
    out = []
    with SessionStore(workspace) as store:
        for run_id in (run_a, run_b):
            reporter.status(f"Reading run {run_id}…")
            info = with_expert_buffer(store, store.run(run_id))
            events, tokens = store.events(run_id), store.tokens(run_id)
            lanes = list(info.settings.get("lanes") or [])
            for e in events:
                if e.device not in lanes:
                    lanes.append(e.device)
            out.append(ComparedRun(info=info, events=events, tokens=tokens,
                                   figures=compute_figures(events, tokens), bubbles=bubbles(events), lanes=lanes))
    return out[0], out[1]


TABLE_BESIDE_PX = 800
"""Narrower than this, the figures table goes below the two timelines instead of beside them."""
TIMELINES_LEAST_PX = 420
"""The timelines' least width beside the table: where the table's own least width leaves less, it goes below."""
LANE_LINES = 1.6
"""A compared timeline's least height per lane, in lines of text (its lane names never overlap)."""


class RunComparisonView(QWidget):
    """Run A's and run B's timelines, x-linked from t = 0, above a table of their figures."""

    closed = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setAccessibleName("Run comparison")
        self.runs: tuple[ComparedRun, ComparedRun] | None = None
        self.title_label = QLabel("Select two runs and press Compare.")
        self.title_label.setAccessibleName("Compared runs")
        self.title_label.setWordWrap(True)  # two long run titles on a 1024 px screen: two lines, not a scroll bar
        self.back_button = QPushButton("Back to replay")
        self.back_button.setAccessibleName("Back to replay")
        self.back_button.setToolTip("Leave the comparison and show the replay of the open run")
        self.back_button.clicked.connect(self.closed.emit)
        self.timeline_a = TimelineView()
        self.timeline_b = TimelineView()
        for view in (self.timeline_a, self.timeline_b):
            view.hide_live_controls()
        self.timeline_b.measured_plot.setXLink(self.timeline_a.measured_plot)
        self.table = QTableWidget(0, 3)
        self.table.setAccessibleName("Figures of both runs")
        self.table.setHorizontalHeaderLabels(["Figure", "Run A", "Run B"])
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)

        head = QHBoxLayout()
        head.addWidget(self.title_label, 1)
        head.addWidget(self.back_button)
        self.timelines = QSplitter(Qt.Orientation.Vertical)
        self.timelines.setChildrenCollapsible(False)
        self.timelines.addWidget(self.timeline_a)
        self.timelines.addWidget(self.timeline_b)
        # the figures beside the timelines where there is room, below them where there is not
        # (a 1024 px screen): the timelines keep the width, and the page scrolls rather than
        # squeezing a timeline's lanes together or drawing it under the table
        self.body = QSplitter(Qt.Orientation.Horizontal)
        self.body.setChildrenCollapsible(False)
        self.body.addWidget(self.timelines)
        self.body.addWidget(self.table)
        self.body.setStretchFactor(0, 3)
        self.body.setStretchFactor(1, 1)
        self.table.setMinimumWidth(260)
        self.scroll = QScrollArea()
        self.scroll.setAccessibleName("Run comparison page")
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        # each prompt and both runs' texts, below and across the page: long texts wrap, never elided
        self.outputs = QTableWidget(0, 3)
        self.outputs.setAccessibleName("Texts of both runs")
        self.outputs.setHorizontalHeaderLabels(["Prompt", "Run A's text", "Run B's text"])
        self.outputs.verticalHeader().setVisible(False)
        self.outputs.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.outputs.setWordWrap(True)
        self.outputs.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.outputs.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)  # the page scrolls
        page = QWidget()
        page_lay = QVBoxLayout(page)
        page_lay.setContentsMargins(0, 0, 0, 0)
        page_lay.addWidget(self.body, 1)
        page_lay.addWidget(self.outputs)
        self.scroll.setWidget(page)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(head)
        layout.addWidget(self.scroll, 1)
        self._fit_timelines()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._arrange(event.size().width())

    def _arrange(self, width: int) -> None:
        wide = width >= max(TABLE_BESIDE_PX, self.table.minimumWidth() + TIMELINES_LEAST_PX)
        orientation = Qt.Orientation.Horizontal if wide else Qt.Orientation.Vertical
        if self.body.orientation() != orientation:
            self.body.setOrientation(orientation)
        rows = self.table.rowCount()
        table_px = (self.table.horizontalHeader().sizeHint().height() + 4
                    + sum(self.table.rowHeight(r) for r in range(rows)))
        self.table.setMinimumHeight(0 if wide else table_px)  # below: every figure, no scroll of its own
        self.table.resizeRowsToContents()  # a technique's name wraps in a narrow column
        self.outputs.resizeRowsToContents()
        self.outputs.setFixedHeight(self.outputs.horizontalHeader().sizeHint().height() + 4
                                    + sum(self.outputs.rowHeight(r) for r in range(self.outputs.rowCount()))
                                    if self.outputs.rowCount() else 0)
        self.outputs.setVisible(self.outputs.rowCount() > 0)

    def _fit_timelines(self) -> None:
        """Each timeline at least its toolbar plus a line of text per lane and its time axis."""
        line = self.fontMetrics().height()
        for view in (self.timeline_a, self.timeline_b):
            lanes = max(len(view.lanes()), 1)
            toolbar = view.minimumSizeHint().height()
            view.setMinimumHeight(toolbar + lanes * int(line * LANE_LINES) + 4 * line)

    def show_runs(self, a: ComparedRun, b: ComparedRun) -> None:
        self.runs = (a, b)
        self.title_label.setText(f"A: {run_title(a.info)}   vs   B: {run_title(b.info)}")
        for view, run, name in ((self.timeline_a, a, "A"), (self.timeline_b, b, "B")):
            view.clear()
            view.set_lanes(run.lanes)
            view.append_events(run.events)
            view.flush()
            view.measured_plot.setTitle(f"{name}: {run_title(run.info)}", size="9pt")
            name_boxes(view, run.info.settings)
        end = max([e.end_s for e in a.events + b.events] + [1e-3])
        self.timeline_a.set_x_range(0.0, end * 1.02)  # both from t = 0, on one axis (x-linked)
        self._fit_timelines()
        rows = [technique_row(a, b)] + image_rows(
            with_reads(comparison_rows(a.figures, b.figures, a.bubbles, b.bubbles), a, b),
            is_image_run(a.info.settings), is_image_run(b.info.settings))
        self.table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, text in enumerate(row):
                item = QTableWidgetItem(text)
                if c:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(r, c, item)
        texts = output_rows(a, b)
        self.outputs.setRowCount(len(texts))
        for r, row in enumerate(texts):
            for c, text in enumerate(row):
                item = QTableWidgetItem(text)
                item.setToolTip(text)
                self.outputs.setItem(r, c, item)
        self._fit_words()
        self.table.resizeRowsToContents()
        self._arrange(self.width())

    def _fit_words(self) -> None:
        """The table at least as wide as its figure names plus each run's longest word, so a technique's
        name wraps between words ("Encode/prefill/ decode disaggregation") and is never cut to "disag…"."""
        fm, header = self.table.fontMetrics(), self.table.horizontalHeader()
        pad = 2 * self.table.style().pixelMetric(self.style().PixelMetric.PM_FocusFrameHMargin) + 12
        words = [w for r in range(self.table.rowCount()) for c in (1, 2)
                 for w in self.table.item(r, c).text().replace("/", "/ ").split()]
        least = max([fm.horizontalAdvance(w) + pad for w in words] + [header.minimumSectionSize()])
        self.table.resizeColumnToContents(0)
        self.table.setMinimumWidth(max(260, self.table.columnWidth(0) + 2 * least
                                       + self.table.verticalScrollBar().sizeHint().width() + 2 * self.table.frameWidth()))

    def table_rows(self) -> list[tuple[str, str, str]]:
        return [tuple(self.table.item(r, c).text() for c in range(3)) for r in range(self.table.rowCount())]

    def figure_rows(self) -> list[tuple[str, str, str]]:
        """The table's rows after the technique's: the compared figures."""
        return self.table_rows()[1:]

    def output_rows(self) -> list[tuple[str, str, str]]:
        """(prompt, run A's text, run B's text) as shown."""
        return [tuple(self.outputs.item(r, c).text() for c in range(3)) for r in range(self.outputs.rowCount())]

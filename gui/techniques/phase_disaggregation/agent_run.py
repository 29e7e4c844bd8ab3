"""EPD on the connected agents, as the plan view shows it: the source of the problem (measured on
the agents, or the what-if scenario), the jobs that measure and run on a worker, and the *Run*
tab (the served requests' timeline, measured SLO figures beside the simulator's prediction, and
each device's phases predicted beside measured)."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHeaderView, QLabel, QPlainTextEdit, QSplitter, QTableWidget, QVBoxLayout, QWidget

from core.techniques.phase_disaggregation.on_agents import LayoutRun, PhaseFit, SloFigures, measure_costs, run_layout
from gui.techniques.phase_disaggregation.drawings import LAYOUT_WORDS, RequestTimeline, pools_text
from gui.widgets import fill_table

MEASURED = "Measured on the agents"
WHAT_IF = "What-if: illustrative edge devices"
SOURCES = (MEASURED, WHAT_IF)


def measure_job(reporter, link, model_dir: str, devices: list[str]):
    """The worker's job of *Measure phases on agents*."""
    return measure_costs(link, model_dir, devices, reporter=reporter)


def run_job(reporter, link, model_dir: str, problem, pools, layout: str, workspace: str) -> LayoutRun:
    """The worker's job of *Run on agents*."""
    return run_layout(link, model_dir, problem, pools, layout=layout, workspace=workspace, reporter=reporter)


FIT_HEADERS = ("device", "phase", "pred ms", "meas ms", "ratio")
"""Short: the table shares the Run tab's right column with the answers (about 250 px at 1024x700)."""


def fit_rows(fit: tuple[PhaseFit, ...]) -> list[tuple[str, ...]]:
    """The per-device table's rows: decode is per token after the first."""
    return [(f.device, f.phase + ("/token" if f.phase == "decode" else ""), f"{f.predicted_s * 1e3:.1f}",
             f"{f.measured_s * 1e3:.1f}", f"{f.ratio:.2f}") for f in fit]


def figures_text(f: SloFigures) -> str:
    return (f"TTFT p50 {f.ttft_p50_s * 1e3:.0f} ms, p90 {f.ttft_p90_s * 1e3:.0f} ms · TPOT p50 "
            f"{f.tpot_p50_s * 1e3:.1f} ms · SLO met by {f.attainment:.0%} of {f.requests}")


PROMPT_TAIL_CHARS = 24
"""How much of a request's prompt its answer line shows: its end, which the answer continues."""


def answer_line(request: int, prompt: str, answer: str) -> str:
    """"#3 …the secret of life is ▸ to be the same.": the prompt's end before the answer, so an answer that
    finishes a cut word ("icto.") reads as the rest of it, not as noise."""
    prompt = " ".join(prompt.split())
    shown = prompt if len(prompt) <= PROMPT_TAIL_CHARS else "…" + prompt[-PROMPT_TAIL_CHARS:]
    return f"#{request} {shown} ▸ {answer.strip()}" if shown else f"#{request} {answer.strip()}"


class AgentRunTab(QWidget):
    """The last layout served on the agents: which, its requests' spans, measured vs predicted."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.last: LayoutRun | None = None
        self.summary = QLabel("Run a layout on the agents (Run on agents) to see its requests here.")
        self.summary.setWordWrap(True)
        self.summary.setAccessibleName("EPD run figures")
        self.timeline = RequestTimeline()
        self.timeline.placeholder = "No run on the agents yet"
        self.timeline.setMinimumWidth(200)
        self.answers = QPlainTextEdit()
        self.answers.setReadOnly(True)
        self.answers.setAccessibleName("EPD answers")
        self.answers.setToolTip("Each request's answer as the agents generated it (image + prompt in)")
        self.answers.setMinimumWidth(220)  # a line per answer, readable at 1024x700
        self.fit_table = QTableWidget(0, len(FIT_HEADERS))
        self.fit_table.setHorizontalHeaderLabels(FIT_HEADERS)
        self.fit_table.verticalHeader().setVisible(False)
        self.fit_table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.fit_table.verticalHeader().setDefaultSectionSize(self.fit_table.fontMetrics().height() + 6)
        self.fit_table.setAccessibleName("EPD phases per device")
        self.fit_table.setToolTip("Each device's phases (medians over the run's requests): what the simulator "
                                  "predicted with the measured costs beside what the agents took, and their "
                                  "ratio (1: exact; below 1: predicted too fast)")
        side = QSplitter(Qt.Vertical)
        side.setChildrenCollapsible(False)
        side.addWidget(self.answers)
        side.addWidget(self.fit_table)
        side.setStretchFactor(0, 1)
        side.setStretchFactor(1, 2)  # up to six rows (three devices in the aggregated layout: nine)
        side.setSizes([100, 200])
        split = QSplitter(Qt.Horizontal)
        split.setChildrenCollapsible(False)
        split.addWidget(self.timeline)
        split.addWidget(side)
        split.setStretchFactor(0, 2)
        split.setStretchFactor(1, 1)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addWidget(self.summary)
        lay.addWidget(split, 1)

    def show_run(self, run: LayoutRun) -> None:
        self.last = run
        self.timeline.show_metrics(run.metrics)
        lines = [f"<b>{run.layout}</b>: {LAYOUT_WORDS.get(run.pools.disaggregation, run.pools.disaggregation)}, "
                 f"{pools_text(run.pools)} on {', '.join(run.pools.devices)}",
                 f"measured: {figures_text(run.measured)}"]
        if run.predicted is not None:
            lines.append(f"predicted: {figures_text(run.predicted)}")
        lines.append(f"recorded as run {run.run_id} (predicted: run {run.predicted_id}); Sessions replays it"
                     if run.run_id is not None else "not recorded: open a workspace to keep runs")
        self.summary.setText("<br>".join(lines))
        self.answers.setPlainText("\n".join(answer_line(rid, run.prompts.get(rid, ""), text)
                                            for rid, text in sorted(run.texts.items())))
        fill_table(self.fit_table, fit_rows(run.fit))
        table = self.fit_table  # as wide as its columns: the timeline beside it gives way
        table.setMinimumWidth(sum(table.columnWidth(c) for c in range(table.columnCount())) + 2 * table.frameWidth()
                              + table.verticalScrollBar().sizeHint().width())


__all__ = ["FIT_HEADERS", "MEASURED", "SOURCES", "WHAT_IF", "AgentRunTab", "answer_line", "figures_text", "fit_rows",
           "measure_job", "run_job"]

"""The Experiments screen: the EdgeShard paper's experiments run in simulation, with their plots.

The work is ``core.runs.experiments`` (the same as ``edgeshard experiment NAME``); this view
picks an experiment, runs it on a worker with progress and a Cancel, and shows the table,
the findings (held / not held) and the figures as written to disk (PNG), so what the
studio shows is what the CLI wrote.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QPixmap
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from core.paths import workspace_file
from core.runs.experiments import EXPERIMENTS, ExperimentResult, run_experiment, write_outputs
from gui.widgets import panel_header
from gui.workers import TaskRunner

DESCRIPTIONS = {
    "table-iv": "Table IV — latency and throughput of Llama2-7B/13B/70B, four methods",
    "bandwidth": "Figs 7–8 — 7B as the source–cloud link goes 1 → 50 Mbit/s",
    "source": "Fig. 9 — an AGX Orin or an Orin NX holds the prompt",
    "pipelines": "Fig. 10 — pipelines with and without bubbles",
    "algorithms": "The paper's Algorithms 1 and 2 against the exact solvers",
    "miniature": "Miniature — the paper's setup on a netns testbed, run for real (needs root, ~3 min)",
}


def default_output_dir() -> Path:
    """Beside the sessions workspace (``$EDGESHARD_WORKSPACE``'s folder)/experiments."""
    return workspace_file().parent / "experiments"


def _run_and_write(reporter, name: str, out_dir: Path, time_limit_s: float) -> tuple[ExperimentResult, list[Path]]:
    result = run_experiment(name, reporter, time_limit_s)
    reporter.status("writing CSV and figures")
    return result, write_outputs(result, out_dir)


class FittedImage(QLabel):
    """A figure scaled to the space it has, aspect kept (a small window still shows all of it)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.original = QPixmap(str(path))
        self.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.setMinimumSize(200, 120)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Ignored)
        self.setAccessibleName(path.stem)

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt)
        super().resizeEvent(event)
        if not self.original.isNull():
            self.setPixmap(self.original.scaled(self.size(), Qt.AspectRatioMode.KeepAspectRatio,
                                                Qt.TransformationMode.SmoothTransformation))


class ExperimentsPanel(QWidget):
    """Pick an experiment, run it, read its findings and figures."""

    def __init__(self, state=None, out_dir: str | Path | None = None, time_limit_s: float = 30.0) -> None:
        super().__init__()
        self.state = state
        self.out_dir = Path(out_dir) if out_dir else default_output_dir()
        self.time_limit_s = time_limit_s
        self.result: ExperimentResult | None = None
        self.runner = TaskRunner(self, name="experiment")
        self._task = None

        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 12, 16, 12)  # as every other screen: the titles line up
        lay.addWidget(panel_header("Experiments", "The EdgeShard paper's experiments, reproduced in simulation on "
                                   "its testbed (resources/scenarios/edgeshard-paper.json); "
                                   "Miniature runs them for real on a netns testbed"))
        bar = QHBoxLayout()
        self.choice = QComboBox()
        self.choice.setAccessibleName("Experiment")
        for name in EXPERIMENTS:
            self.choice.addItem(DESCRIPTIONS.get(name, name), name)
        self.run_button = QPushButton("Run")
        self.run_button.setToolTip("Run the experiment (exact solves may take a minute for 70B)")
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setValue(0)
        self.progress.setTextVisible(False)
        self.progress.setMaximumWidth(220)
        bar.addWidget(self.choice, 1)
        bar.addWidget(self.run_button)
        bar.addWidget(self.cancel_button)
        bar.addWidget(self.progress)
        lay.addLayout(bar)
        self.status = QLabel("Pick an experiment and press Run.")
        self.status.setWordWrap(True)
        lay.addWidget(self.status)

        split = QSplitter(Qt.Orientation.Vertical)
        top = QTabWidget()
        self.findings = QTableWidget(0, 3)
        self.findings.setHorizontalHeaderLabels(("", "finding", "ours"))
        self.findings.horizontalHeader().setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        self.findings.horizontalHeader().setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        self.findings.verticalHeader().setVisible(False)
        self.findings.setWordWrap(True)
        self.table = QTableWidget(0, 0)
        self.table.verticalHeader().setVisible(False)
        top.addTab(self.findings, "Findings")
        top.addTab(self.table, "Table")
        split.addWidget(top)
        self.plots = QTabWidget()
        self.plots.setAccessibleName("Figures")
        split.addWidget(self.plots)
        split.setSizes([300, 500])
        lay.addWidget(split, 1)

        self.run_button.clicked.connect(lambda: self.start())  # not start(checked): clicked passes a bool
        self.cancel_button.clicked.connect(self.runner.cancel)
        self.runner.status_reported.connect(lambda _t, text: self.status.setText(text))
        self.runner.progress_reported.connect(self._on_progress)
        self.runner.task_finished.connect(self._on_finished)
        self.runner.task_failed.connect(self._on_failed)
        self.runner.task_cancelled.connect(lambda _t: self._done("Cancelled."))

    def start(self, name: str | None = None) -> None:
        """Run the chosen experiment (or ``name``) on the worker."""
        if name is not None:
            self.choice.setCurrentIndex(self.choice.findData(name))
        name = self.choice.currentData()
        self.run_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.progress.setValue(0)
        self.status.setText(f"Running {name} …")
        self._task = self.runner.start(_run_and_write, name, self.out_dir, self.time_limit_s)

    def _on_progress(self, _task: int, done: float, total: float) -> None:
        self.progress.setValue(int(1000 * done / total) if total else 0)

    def _done(self, text: str) -> None:
        self.run_button.setEnabled(True)
        self.cancel_button.setEnabled(False)
        self.status.setText(text)

    def _on_failed(self, _task: int, message: str) -> None:
        self._done(f"Failed: {message}")

    def _on_finished(self, _task: int, payload: object) -> None:
        result, paths = payload
        self.result = result
        held = sum(f.held for f in result.findings)
        self.progress.setValue(1000)
        self._done(f"{result.title}: {held} of {len(result.findings)} findings held. Files in {self.out_dir}")
        self._show_findings(result)
        self._show_table(result)
        self._show_plots([p for p in paths if p.suffix == ".png"])

    def _show_findings(self, result: ExperimentResult) -> None:
        self.findings.setRowCount(len(result.findings))
        for i, f in enumerate(result.findings):
            mark = QTableWidgetItem("held" if f.held else "NOT HELD")
            mark.setForeground(Qt.GlobalColor.darkGreen if f.held else Qt.GlobalColor.red)
            self.findings.setItem(i, 0, mark)
            for col, text in ((1, f.claim), (2, f.detail + (f"  (figure: {f.figure})" if f.figure else ""))):
                item = QTableWidgetItem(text)
                item.setToolTip(text)  # the whole text where the column elides it
                self.findings.setItem(i, col, item)
        self.findings.resizeColumnToContents(0)
        self.findings.resizeRowsToContents()

    def _show_table(self, result: ExperimentResult) -> None:
        self.table.clear()
        self.table.setColumnCount(len(result.columns))
        self.table.setHorizontalHeaderLabels(result.columns)
        self.table.setRowCount(len(result.rows))
        for i, row in enumerate(result.rows):
            for j, cell in enumerate(row):
                self.table.setItem(i, j, QTableWidgetItem(cell))
        self.table.resizeColumnsToContents()

    def _show_plots(self, pngs: list[Path]) -> None:
        while self.plots.count():
            w = self.plots.widget(0)
            self.plots.removeTab(0)
            w.deleteLater()
        for png in pngs:
            self.plots.addTab(FittedImage(png), png.stem)

    def shutdown(self) -> None:
        """Stop a running experiment and join its worker (the window calls this on close)."""
        self.runner.shutdown()

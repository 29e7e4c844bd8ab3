"""The expert-offloading plan view (EdgeMoE): a paper-shaped scenario's memory budget, storage
bandwidth and accuracy bound; the plan of a strategy; Compare of EdgeMoE and the paper's
baselines; and, per strategy, a bar of one token's time split into compute and storage
reads that compute could not hide (what the I/O lane of the simulated timeline shows).
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import (
    QComboBox, QDoubleSpinBox, QFormLayout, QHBoxLayout, QLabel, QPushButton, QTableWidget,
    QVBoxLayout, QWidget,
)

from core.errors import EdgeShardError

from core.techniques import technique_named
from core.techniques.expert_offload.scenarios import paper_shaped
from gui.studio_state import StudioState
from gui.widgets import InlineMessage, fill_table, panel_header, say_why_disabled

COMPUTE = QColor("#4c78a8")
STALL = QColor("#e45756")


class TokenTimeBars(QWidget):
    """One horizontal bar per strategy: compute and un-hidden storage reads per token."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.rows: list[tuple[str, float, float]] = []
        self.setMinimumHeight(160)

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


class ExpertOffloadPlanView(QWidget):
    """Plan screen view of the ``expert-offload`` technique."""

    HEADERS = ("strategy", "status", "tokens/s", "buffer slots", "expert bits", "preload", "memory (MB)",
               "reads stall (ms/token)")

    def __init__(self, state: StudioState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.technique = technique_named("expert-offload")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 8, 16, 8)
        lay.addWidget(panel_header("Expert offloading (EdgeMoE)",
                                   "Paper-shaped scenario: sizes, times and bit options are assumptions"))
        controls = QHBoxLayout()
        form = QFormLayout()
        self.budget = QDoubleSpinBox(minimum=5, maximum=100, value=10, suffix=" % of the model", decimals=0)
        self.bandwidth = QDoubleSpinBox(minimum=10, maximum=5000, value=200, suffix=" MB/s", decimals=0)
        self.bound = QDoubleSpinBox(minimum=0, maximum=50, value=5, suffix=" % perplexity", decimals=1)
        form.addRow("Memory budget", self.budget)
        form.addRow("Storage bandwidth", self.bandwidth)
        form.addRow("Accuracy bound", self.bound)
        controls.addLayout(form)
        side = QFormLayout()
        self.strategy = QComboBox()
        self.strategy.addItems(self.technique.strategy_names())
        side.addRow("Strategy", self.strategy)
        self.plan_label = QLabel()
        self.plan_label.setWordWrap(True)
        side.addRow("Plan", self.plan_label)
        controls.addLayout(side, 1)
        lay.addLayout(controls)
        run_row = QHBoxLayout()
        self.use_for_run = QPushButton("Use for Run")
        self.use_for_run.setToolTip("Make this strategy's buffer options the Run screen's plan: the model checkpoint "
                                    "(Model) with its experts on storage, on the prompt's source device")
        self.use_for_run.clicked.connect(self.use_plan_for_run)
        say_why_disabled({self.use_for_run: "load a Mixtral checkpoint (Model) and connect agents first"})
        self.run_message = InlineMessage()
        run_row.addWidget(self.use_for_run)
        run_row.addWidget(self.run_message, 1)
        run_row.addStretch()  # the button keeps its size while there is no message
        lay.addLayout(run_row)
        self.table = QTableWidget(0, len(self.HEADERS))
        self.table.setHorizontalHeaderLabels(self.HEADERS)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setStretchLastSection(True)
        lay.addWidget(self.table, 1)
        self.bars = TokenTimeBars()
        lay.addWidget(self.bars, 1)
        for spin in (self.budget, self.bandwidth, self.bound):
            spin.valueChanged.connect(lambda _v: self.refresh())
        self.strategy.currentTextChanged.connect(lambda _t: self.refresh())
        for signal in (state.model_changed, state.cluster_changed, state.problem_changed):
            signal.connect(lambda *_: self._update_run_button())
        self._update_run_button()
        self.refresh()

    # -- running the plan ------------------------------------------------------------------
    def run_device(self) -> str | None:
        """Where the run goes: the prompt's source device of the studio's problem, else the cluster's first."""
        problem = getattr(self.state, "problem", None)
        if problem is not None:
            return problem.source
        cluster = getattr(self.state, "cluster", None)
        return cluster.device_ids()[0] if cluster is not None and cluster.devices else None

    def _update_run_button(self) -> None:
        self.use_for_run.setEnabled(bool(getattr(self.state, "model_path", "")) and self.run_device() is not None)

    def use_plan_for_run(self) -> None:
        """The chosen strategy's plan on the real checkpoint (``Technique.run_plan``) becomes the studio's plan."""
        import msgspec

        out = self.technique.run_strategy(self.problem(), self.strategy.currentText(), "latency")
        device = self.run_device()
        if out.plan is None or device is None:
            self.run_message.show_lines([out.error or "no device to run on: connect agents first"],
                                        "Cannot use this plan:")
            return
        plan = msgspec.structs.replace(out.plan, device=device)
        try:
            run_plan = self.technique.run_plan(plan, self.state.model_path)
        except EdgeShardError as err:
            self.run_message.show_lines([str(err)], "Cannot use this plan:")
            return
        self.state.set_plan(run_plan)
        self.run_message.show_lines([f"The Run screen runs {run_plan.model} on {device} with {plan.slots} expert "
                                     f"slots, preload {plan.preload}, eviction {plan.policy}."])

    def problem(self):
        base = paper_shaped(self.budget.value() / 100.0, self.bandwidth.value() * 1e6)
        import msgspec

        return msgspec.structs.replace(base, accuracy_bound=self.bound.value() / 100.0)

    def refresh(self) -> None:
        out = self.technique.run_strategy(self.problem(), self.strategy.currentText(), "latency")
        if out.plan is None:
            self.plan_label.setText(f"{out.status}: {out.error}")
            return
        c = out.cost
        self.plan_label.setText(
            f"{out.plan.slots} experts in the buffer at {out.plan.bits.name}, preload {out.plan.preload} per layer, "
            f"{'whole layers streamed, ' if out.plan.whole_layers else ''}eviction {out.plan.policy}; "
            f"{c.memory_bytes / 1e6:.0f} MB of {self.problem().memory_budget_bytes / 1e6:.0f} MB "
            f"({out.status}); {1 / c.latency_per_token_s:.2f} tokens/s")

    def auto_solve(self) -> None:
        self.strategy.setCurrentText(self.technique.exact)
        self.refresh()

    def compare(self) -> None:
        outs = self.technique.compare(self.problem(), "latency")
        rows, bars = [], []
        for o in outs:
            c, plan = o.cost, o.plan
            rows.append([o.strategy, o.status,
                         f"{o.tokens_per_s:.2f}" if o.tokens_per_s else "—", str(plan.slots) if plan else "—",
                         plan.bits.name if plan else "—", str(plan.preload) if plan else "—",
                         f"{c.memory_bytes / 1e6:.0f}" if c else "—", f"{c.io_stall_s * 1e3:.0f}" if c else "—"])
            if c:
                bars.append((o.strategy, c.compute_s, c.io_stall_s))
        fill_table(self.table, rows, tooltips=[o.error for o in outs])  # why a strategy failed, not widening it
        self.bars.show_rows(bars)

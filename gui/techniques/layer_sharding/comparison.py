"""Layer sharding's strategy comparison: every strategy's predicted latency and throughput as a
chart (one bar per strategy, named on its left) beside a table with Adopt; mixed into the plan
editor, which owns the undo stack Adopt pushes onto."""

from __future__ import annotations

import math

import pyqtgraph as pg
from PySide6.QtCore import QEvent, QPointF, Qt
from PySide6.QtGui import QColor, QFontMetrics
from PySide6.QtWidgets import (QAbstractItemView, QFrame, QHeaderView, QLabel, QPushButton, QScrollArea,
                               QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from core.planning.solvers.comparison import StrategyOutcome, status_text
from gui.app import style_plot, theme_colors
from gui.techniques.layer_sharding.stages import fmt_s

COMPARE_LEGEND = (("ok", "current plan"), ("accent", "other strategy"), ("error", "does not fit"))
"""The comparison chart's colours (theme colour key, words), as its bars use them."""
COMPARE_ROW_PX = 6
COMPARE_TWO_CHARTS_PX = 380
COMPARE_BAR_PX = 80
"""The least room for the bars and their values beside the strategy names."""
"""Narrower than this, the comparison charts only the objective's figure (the table has both)."""
"""Room between two strategy names on the comparison chart, beyond a line of text."""


def _fits(outcome: StrategyOutcome) -> bool:
    return outcome.status in ("optimal", "ok")



def precision_text(plan) -> str:
    """' (int4 on b, int8 on c cuda:0, d cuda:0)' for a plan with quantized or GPU stages ('' when every
    stage is at fp on its CPU)."""
    quantized = [(f"{s.weights} on {s.device}" if s.weights != "fp" else s.device)
                 + ("" if s.torch_device == "cpu" else f" {s.torch_device}")
                 for s in getattr(plan, "stages", ()) if s.weights != "fp" or s.torch_device != "cpu"]
    return f" ({', '.join(quantized)})" if quantized else ""

class StrategyComparison:
    """The plan editor's Compare chart and table, and adopting a compared plan."""

    def _build_compare_chart(self) -> QWidget:
        """The chart under its legend, in a scroll area: a short window (1024x700) scrolls the
        chart instead of squeezing its rows until the strategy names overlap."""
        box = QWidget()
        lay = QVBoxLayout(box)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(2)
        self.compare_legend = QLabel()
        self.compare_legend.setAccessibleName("Strategy comparison legend")
        self.compare_legend.setWordWrap(True)
        self.compare_legend.setToolTip("The bars' colours: the current plan, a strategy whose plan does not fit "
                                       "(memory, constraints or no plan at all), every other strategy. "
                                       "Latency: lower is better (↓); tokens/s: higher is better (↑)")
        lay.addWidget(self.compare_legend)
        self.compare_scroll = QScrollArea()
        self.compare_scroll.setWidgetResizable(True)
        self.compare_scroll.setFrameShape(QFrame.NoFrame)
        self.compare_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.compare_scroll.setMinimumHeight(90)
        self.compare_scroll.setWidget(self.compare_plot)
        self.compare_scroll.viewport().installEventFilter(self)  # names elided anew to its width
        lay.addWidget(self.compare_scroll, 1)
        return box

    def _compare_legend_text(self) -> str:
        c = theme_colors()
        return " ".join(f"<span style='color:{c[key]}'>■</span>&nbsp;{words.replace(' ', '&nbsp;')}"
                        for key, words in COMPARE_LEGEND)

    def _build_compare_table(self) -> QWidget:
        self.compare_table = QTableWidget(0, 4)
        self.compare_table.setHorizontalHeaderLabels(["Strategy", "Latency", "Tokens/s", ""])
        self.compare_table.verticalHeader().hide()
        self.compare_table.setAccessibleName("Strategies")
        self.compare_table.setToolTip("Every strategy's predicted figures; Adopt makes one the current plan")
        self.compare_table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.compare_table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.compare_table.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        self.compare_table.setMinimumWidth(300)
        return self.compare_table

    def show_comparison(self, results: list[StrategyOutcome]) -> None:
        self.comparison = results
        self._compared_problem = self.state.problem
        t = self.compare_table
        t.setRowCount(len(results))
        for i, r in enumerate(results):
            status = status_text(r)
            # the status core gives every outcome: proven optimal, the gap left, OOM by how much, why no plan
            name = QTableWidgetItem(f"{r.strategy}{precision_text(r.plan)} — {status}" if r.status != "ok" or status != "ok"
                                    else r.strategy + precision_text(r.plan))
            name.setToolTip(status)
            if not _fits(r):
                name.setForeground(QColor(theme_colors()["error"]))
            t.setItem(i, 0, name)
            t.setItem(i, 1, QTableWidgetItem(fmt_s(r.cost.latency_per_token_s) if r.cost else "—"))
            t.setItem(i, 2, QTableWidgetItem(f"{r.cost.throughput_tokens_s:.1f}" if r.cost else "—"))
            b = QPushButton("Adopt")
            b.setAccessibleName(f"Adopt {r.strategy}")
            b.setToolTip(f"Make the {r.strategy} plan the current plan (undoable)" if _fits(r) else
                         f"The {r.strategy} plan cannot run here ({status_text(r)}): adopt one that fits")
            b.setEnabled(r.plan is not None and _fits(r))
            b.clicked.connect(lambda _c=False, i=i: self.adopt(i))
            t.setCellWidget(i, 3, b)
        self._show_speculative_rows(results)
        best = next((r for r in results if r.strategy == "edgeshard" and r.status == "optimal"), None)
        self.solve_status.setText(f"{len(results)} strategies compared" + (" (edgeshard proven optimal)" if best else "")
                                  + "; Adopt one to edit it.")
        self._draw_comparison()

    def _show_speculative_rows(self, results: list[StrategyOutcome]) -> None:
        """Below the strategies, each fitting plan with the model's shipped draft (``<model>-draft``)
        proposing: one sequence's predicted decode at the cost model's k (``core.runs.speculative``)."""
        from core.runs.speculative import speculative_rows
        from gui.techniques.speculative import shipped_draft

        t, first = self.compare_table, len(results)
        draft = shipped_draft(getattr(self.state, "model_path", ""))
        rows = speculative_rows(self.state.problem, results, draft)
        t.setRowCount(first + len(rows))
        for i, (strategy, c, figures) in enumerate(rows, start=first):
            cost = "timed on the source" if figures.measured else "by proxy from the profile"
            name = QTableWidgetItem(f"{strategy} + draft, k {c.k}" if c.k else f"{strategy} + draft: plain is faster")
            name.setToolTip(f"One sequence's decode with {draft.rsplit('/', 1)[-1]} proposing: plain "
                            f"{c.plain_tokens_s:.1f} → {c.speculative_tokens_s:.1f} tokens/s ({c.speedup:.2f}×; "
                            f"{c.tokens_per_trip:.2f} tokens a trip at acceptance {figures.acceptance_rate:.2f}; "
                            f"draft {figures.token_s * 1e3:.1f} ms a token, {cost}). Run it: Run ▸ Draft model.")
            t.setItem(i, 0, name)
            t.setItem(i, 1, QTableWidgetItem(fmt_s(1.0 / c.speculative_tokens_s)))
            t.setItem(i, 2, QTableWidgetItem(f"{c.speculative_tokens_s:.1f}"))

    def adopt(self, index: int) -> None:
        if self.state.problem is not self._compared_problem:  # its plans may name devices no longer there
            self._mark_comparison_stale()
            return
        r = self.comparison[index]
        if r.plan is not None and _fits(r):  # a plan that does not fit would only fail at Start
            self.push_plan(r.plan, f"Adopt {r.strategy}")

    def _mark_comparison_stale(self) -> None:
        """The profile or constraints changed since Compare: its plans cannot be adopted any more."""
        why = "Stale: the profile or constraints changed since this comparison — press Compare again."
        for i in range(self.compare_table.rowCount()):
            b = self.compare_table.cellWidget(i, 3)
            if b is not None:
                b.setEnabled(False)
                b.setToolTip(why)
        self.solve_status.setText(why)

    def _draw_comparison(self) -> None:
        self.compare_plot.clear()
        self.compare_hint = None
        style_plot(self.compare_plot)
        self.compare_legend.setText(self._compare_legend_text())
        rs = [r for r in self.comparison if r.cost is not None]
        if not rs:
            return
        c = theme_colors()
        current = self.own_plan
        metrics = QFontMetrics(self.font())
        # each strategy a row a line of text tall (the chart scrolls where the window is short),
        # the latency and the throughput side by side so both share the rows' names
        title_px = metrics.height() + 16
        self.compare_plot.setMinimumHeight(len(rs) * (metrics.height() + COMPARE_ROW_PX) + title_px)
        avail = self.compare_scroll.viewport().width() - 20  # the layout's margins
        two = avail >= COMPARE_TWO_CHARTS_PX
        label_px = min(max(metrics.horizontalAdvance(r.strategy) for r in rs) + 24,
                       max(60, avail * 9 // 20 if two else avail - COMPARE_BAR_PX))
        names = [metrics.elidedText(r.strategy, Qt.ElideRight, label_px - 20) for r in rs]
        self.compare_plot.setToolTip("\n".join(
            f"{r.strategy}: {r.cost.latency_per_token_s * 1e3:.1f} ms/token, {r.cost.throughput_tokens_s:.1f} tokens/s"
            + ("" if _fits(r) else " — does not fit") for r in rs))
        brushes = [pg.mkBrush(c["error"] if not _fits(r) else c["ok"] if r.plan == current else c["accent"])
                   for r in rs]
        first = None
        charts = {"latency": ("ms/token ↓", [r.cost.latency_per_token_s * 1e3 for r in rs]),
                  "throughput": ("tokens/s ↑", [r.cost.throughput_tokens_s for r in rs])}
        if not two:  # a narrow window: the objective's figure only
            charts = {k: v for k, v in charts.items() if k == (self.objective_combo.currentData() or "latency")}
        for col, (title, values) in enumerate(charts.values()):
            # the title above the whole plot (names and bars), so it never widens the bars' column
            self.compare_plot.addLabel(title, row=0, col=col, size=f"{self.font().pointSizeF():.0f}pt",
                                       color=c["text"])
            p = self.compare_plot.addPlot(row=1, col=col)
            p.setMenuEnabled(False)
            p.setMouseEnabled(False, False)
            p.invertY(True)
            p.hideAxis("bottom")  # each bar is labelled with its value
            finite = [v if math.isfinite(v) else 0.0 for v in values]
            p.addItem(pg.BarGraphItem(x0=0, y=list(range(len(rs))), height=0.6, width=finite, brushes=brushes))
            for i, v in enumerate(values):
                label = pg.TextItem(f"{v:.1f}" if math.isfinite(v) else "∞", color=c["text"], anchor=(0, 0.5))
                label.setPos(finite[i], i)
                p.addItem(label)
            ax = p.getAxis("left")
            if first is None:
                ax.setTicks([list(enumerate(names))])
                ax.setStyle(tickFont=self.font(), tickLength=0)
                ax.setWidth(label_px)
                first = p
            else:
                p.hideAxis("left")
                p.setYLink(first)
            p.setXRange(0, max(finite + [1e-9]) * 1.8, padding=0)  # room for the value after the bar
            p.setYRange(-0.5, len(rs) - 0.5, padding=0)

    def eventFilter(self, obj, event) -> bool:
        if obj is self.compare_scroll.viewport() and event.type() == QEvent.Type.Resize and self.comparison:
            self._draw_comparison()
        return super().eventFilter(obj, event)

    def compare_rows_overlap(self) -> bool:
        """Whether the chart's rows are closer than a line of text (its names would overlap)."""
        if not self.compare_plot.ci.items:
            return False
        plot = next(i for i in self.compare_plot.ci.items if isinstance(i, pg.PlotItem))
        vb = plot.getViewBox()
        row_px = abs(vb.mapViewToDevice(QPointF(0, 1)).y() - vb.mapViewToDevice(QPointF(0, 0)).y())
        return row_px < QFontMetrics(self.font()).height()

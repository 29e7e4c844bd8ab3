"""The EPD plan view: a device budget, a request rate and SLOs in; the configuration search's
progress, its best configurations beside the aggregated and PD-only baselines, the picked
pools (which device serves which phase, each multimodal cache's peak fill), a request timeline
(each request's encode / transfer / prefill / transfer / decode spans) and SLO attainment as
the rate grows — all from the simulator, on the illustrative calibration or a loaded one.

The search runs on a worker (``TaskRunner``); each trial arrives as a ``SearchProgress``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import (
    QDoubleSpinBox, QFileDialog, QHBoxLayout, QLabel, QProgressBar, QPushButton, QSpinBox, QSplitter, QTableWidget,
    QTabWidget, QVBoxLayout, QWidget,
)

from core.errors import EdgeShardError
from core.formats import load
from core.techniques.phase_disaggregation.baselines import aggregated, pd_only
from core.techniques.phase_disaggregation.goodput import TARGET, RatePoint, attainment_curve
from core.techniques.phase_disaggregation.scenarios import illustrative_costs, image_heavy_workload
from core.techniques.phase_disaggregation.search import Candidate, SearchProgress, search
from core.techniques.phase_disaggregation.simulator import CachePeak, simulate_pools
from core.techniques.phase_disaggregation.types import SLO, EpdProblem, PhaseCosts, PoolConfig, RequestMetrics
from gui.workers import TaskRunner
from gui.widgets import fill_table, panel_header

SPANS = (("encode", QColor("#9467bd")), ("E→P", QColor("#bab0ac")), ("queue", QColor("#f2cf5b")),
         ("prefill", QColor("#4c78a8")), ("P→D", QColor("#bab0ac")), ("decode", QColor("#54a24b")))
PHASES = ("encode", "prefill", "decode")
PHASE_COLORS = {"encode": QColor("#9467bd"), "prefill": QColor("#4c78a8"), "decode": QColor("#54a24b")}
LAYOUT_WORDS = {"epd": "EPD (a pool per phase)", "pd": "PD-only (EP coupled)", "aggregated": "aggregated (EPD on each)"}
LINES = {"search's pick": "#e45756", "aggregated": "#4c78a8", "pd-only": "#f58518"}


class EpdPlanResult(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the view draws after a search (built on the worker)."""

    best: Candidate
    baselines: tuple[tuple[str, Candidate], ...]
    top: tuple[Candidate, ...]
    """The best configurations found, best first."""
    metrics: tuple[RequestMetrics, ...]
    """The picked configuration's requests at the workload's rate."""
    caches: tuple[CachePeak, ...]
    curves: tuple[tuple[str, tuple[RatePoint, ...]], ...]
    elapsed_s: float
    trials: int


def plan_epd(reporter, problem: EpdProblem, trials: int) -> EpdPlanResult:
    """Baselines, the search seeded with them, then the picked configuration's timeline and the
    attainment curves (the worker's job; pure apart from the reporter)."""
    reporter.status("evaluating the baselines")
    base = [("aggregated", aggregated(problem))]
    if len(problem.devices) >= 2:
        base.append(("pd-only", pd_only(problem)))
    result = search(problem, trials=trials, seeds=[c.config for _, c in base], reporter=reporter)
    reporter.status("simulating the picked configuration")
    sim = simulate_pools(problem.costs, problem.workload, result.best.config)
    top = sorted({msgspec.json.encode(c.config): c for c in result.candidates}.values(), key=lambda c: -c.score)[:5]
    hi = max([result.best.goodput_rps] + [c.goodput_rps for _, c in base] + [problem.workload.rate_rps or 1.0])
    rates = [hi * f for f in (0.1, 0.25, 0.4, 0.55, 0.7, 0.85, 1.0, 1.15, 1.3, 1.5)]
    curves = [(name, tuple(attainment_curve(problem.costs, problem.workload, c.config, problem.slo, rates)))
              for name, c in [("search's pick", result.best)] + base]
    return EpdPlanResult(best=result.best, baselines=tuple(base), top=tuple(top), metrics=sim.metrics,
                         caches=sim.caches, curves=tuple(curves), elapsed_s=result.elapsed_s,
                         trials=len(result.candidates))


def pools_text(cfg: PoolConfig) -> str:
    if cfg.disaggregation == "epd":
        return f"E{len(cfg.encode)} P{len(cfg.prefill)} D{len(cfg.decode)}, IRP {cfg.irp_degree}"
    if cfg.disaggregation == "pd":
        return f"EP{len(cfg.prefill)} D{len(cfg.decode)}"
    return f"EPD on each of {len(cfg.prefill)}"


class PoolsDiagram(QWidget):
    """Three columns (encode, prefill, decode), one box per device; under each encode and
    prefill device its multimodal cache's peak fill. A device serving several phases appears
    in each of them."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.config: PoolConfig | None = None
        self.caches: dict[tuple[str, str], CachePeak] = {}
        self.setMinimumSize(260, 150)

    def show_pools(self, config: PoolConfig | None, caches: Sequence[CachePeak] = ()) -> None:
        self.config = config
        self.caches = {(c.device, c.side): c for c in caches}
        self.update()

    def box_label(self, device: str) -> str:
        """A device's box text: its name, and the phases it serves when it serves several (PD-only's
        encode+prefill devices "dev0 EP", the aggregated layout's "dev0 EPD"), so that a
        device drawn in two or three columns reads as one agent, not as several."""
        cfg = self.config
        served = [ph[0].upper() for ph in PHASES if cfg is not None and device in getattr(cfg, ph)]
        return device if len(served) < 2 else f"{device} {''.join(served)}"

    def paintEvent(self, _event) -> None:  # noqa: N802 (Qt)
        p = QPainter(self)
        p.fillRect(self.rect(), self.palette().base())
        text = self.palette().text().color()
        if self.config is None:
            p.setPen(text)
            p.drawText(self.rect(), Qt.AlignCenter | Qt.TextWordWrap, "Search to see which device serves which phase")
            return
        cfg = self.config
        cols = (("encode", cfg.encode, "encode-out"), ("prefill", cfg.prefill, "prefill-in"), ("decode", cfg.decode, ""))
        col_w = (self.width() - 16) / 3
        most = max(len(d) for _, d, _ in cols)
        box_h = max(14.0, min(34.0, (self.height() - 34) / most - 4))
        for i, (phase, devs, side) in enumerate(cols):
            x = 8 + i * col_w
            p.setPen(text)
            p.drawText(QRectF(x, 2, col_w, 18), Qt.AlignCenter, f"{phase} ({len(devs)})")
            for k, d in enumerate(devs):
                r = QRectF(x + 6, 24 + k * (box_h + 4), col_w - 12, box_h)
                p.setPen(QPen(PHASE_COLORS[phase].darker(130), 1))
                p.setBrush(PHASE_COLORS[phase].lighter(160))
                p.drawRoundedRect(r, 4, 4)
                p.setPen(QColor("#202020"))
                label = p.fontMetrics().elidedText(self.box_label(d), Qt.ElideMiddle, int(r.width() - 8))
                p.drawText(r.adjusted(4, 0, -4, 0), Qt.AlignVCenter | Qt.AlignLeft, label)
                cache = self.caches.get((d, side))
                if cache is not None:
                    frac = cache.peak_tokens / cache.capacity_tokens
                    bar = QRectF(r.left() + 3, r.bottom() - 5, (r.width() - 6) * min(1.0, frac), 3)
                    p.fillRect(bar, QColor("#e45756") if frac >= 0.999 else QColor("#202020"))
                    p.drawText(r.adjusted(4, 0, -4, 0), Qt.AlignVCenter | Qt.AlignRight, f"{frac:.0%}")
        p.setPen(text)
        p.drawText(QRectF(8, self.height() - 20, self.width() - 16, 18), Qt.AlignLeft | Qt.AlignVCenter,
                   f"{LAYOUT_WORDS.get(cfg.disaggregation, cfg.disaggregation)}"
                   + ("; %: cache peak fill" if self.caches else ""))


class RequestTimeline(QWidget):
    """One row per request (the first ``MAX_ROWS``): encode, E→P, queue, prefill, P→D, decode."""

    MAX_ROWS = 40

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.metrics: list[RequestMetrics] = []
        self.setMinimumSize(300, 150)

    def show_metrics(self, metrics: Sequence[RequestMetrics]) -> None:
        self.metrics = sorted(metrics, key=lambda m: m.request_id)[:self.MAX_ROWS]
        self.update()

    @staticmethod
    def spans(m: RequestMetrics) -> list[tuple[str, float, float]]:
        """(span name, start, end) of one request, in phase order."""
        edges = [m.encode_start_s, m.encode_end_s, m.ep_transfer_end_s, m.prefill_start_s, m.prefill_end_s,
                 m.pd_transfer_end_s, m.decode_end_s]
        return [(name, a, b) for (name, _), a, b in zip(SPANS, edges, edges[1:])]

    def paintEvent(self, _event) -> None:  # noqa: N802 (Qt)
        p = QPainter(self)
        p.fillRect(self.rect(), self.palette().base())
        text = self.palette().text().color()
        p.setPen(text)
        if not self.metrics:
            p.drawText(self.rect(), Qt.AlignCenter, "Search to see each request's phases")
            return
        left, bottom = 44, 40
        t0 = min(m.arrival_s for m in self.metrics)
        t1 = max(m.decode_end_s for m in self.metrics)
        span = max(t1 - t0, 1e-9)
        width = max(10, self.width() - left - 10)
        row_h = max(2.0, (self.height() - bottom - 6) / len(self.metrics))
        x = lambda t: left + width * (t - t0) / span  # noqa: E731
        for i, m in enumerate(self.metrics):
            y = 4 + i * row_h
            if row_h >= 11:
                p.setPen(text)
                p.drawText(QRectF(0, y, left - 4, row_h), Qt.AlignVCenter | Qt.AlignRight, f"#{m.request_id}")
            p.setPen(QPen(text, 1))
            p.drawLine(int(x(m.arrival_s)), int(y + 1), int(x(m.arrival_s)), int(y + row_h - 1))
            for (name, a, b), (_, color) in zip(self.spans(m), SPANS):
                if b > a:
                    p.fillRect(QRectF(x(a), y + 1, max(1.0, x(b) - x(a)), max(1.0, row_h - 2)), color)
        y = self.height() - bottom + 4
        p.setPen(text)
        p.drawText(QRectF(left, y, width, 14), Qt.AlignLeft, f"{t0:.1f} s")
        p.drawText(QRectF(left, y, width, 14), Qt.AlignRight, f"{t1:.1f} s")
        lx = left
        for name, color in SPANS:
            p.fillRect(QRectF(lx, y + 20, 12, 12), color)
            p.setPen(text)
            p.drawText(QRectF(lx + 16, y + 18, 70, 16), Qt.AlignVCenter, name)
            lx += 86


class PhaseDisaggregationPlanView(QWidget):
    """Plan screen view of the ``phase-disaggregation`` technique."""

    TABLE_HEADERS = ("configuration", "devices", "pools", "batches E/P/D", "policy", "goodput (req/s)",
                     "TTFT p50 (s)")

    def __init__(self, state, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.costs: PhaseCosts = illustrative_costs()
        self.result: EpdPlanResult | None = None
        self.trials_seen: list[SearchProgress] = []
        self.runner = TaskRunner(self, name="epd-search")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 8, 16, 8)
        lay.addWidget(panel_header("Encode/prefill/decode disaggregation (EPD)",
                                   "An image-heavy workload on a device budget; simulated, not measured"))
        row = QHBoxLayout()
        self.devices = QSpinBox(minimum=1, maximum=64, value=8, prefix="devices ")
        self.devices.setAccessibleName("Devices")
        self.rate = QDoubleSpinBox(minimum=0.05, maximum=1000, value=1.0, decimals=2, suffix=" req/s")
        self.rate.setAccessibleName("Request rate")
        self.ttft = QDoubleSpinBox(minimum=0.05, maximum=600, value=2.5, decimals=2, prefix="TTFT ≤ ", suffix=" s")
        self.ttft.setAccessibleName("TTFT SLO")
        self.tpot = QDoubleSpinBox(minimum=1, maximum=10_000, value=80, decimals=0, prefix="TPOT ≤ ", suffix=" ms")
        self.tpot.setAccessibleName("TPOT SLO")
        self.trials = QSpinBox(minimum=1, maximum=500, value=30, suffix=" trials")
        self.trials.setAccessibleName("Trials")
        self.costs_button = QPushButton("Costs…")
        self.costs_button.setToolTip("Load a measured calibration (edgeshard.epd-costs JSON)")
        self.search_button = QPushButton("Search")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.record_button = QPushButton("Record")
        self.record_button.setToolTip("Store the picked configuration's simulated run in the workspace "
                                      "(Sessions replays it)")
        self.record_button.setEnabled(False)
        self.last_problem: EpdProblem | None = None
        for w in (self.devices, self.rate, self.ttft, self.tpot, self.trials):
            row.addWidget(w)
        row.addStretch(1)
        lay.addLayout(row)
        status = QHBoxLayout()
        for w in (self.costs_button, self.search_button, self.stop_button, self.record_button):
            status.addWidget(w)
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(140)
        self.progress.setTextVisible(False)
        status.addWidget(self.progress)
        self.status = QLabel(f"calibration: {self.costs.source}")
        self.status.setWordWrap(True)
        status.addWidget(self.status, 1)
        lay.addLayout(status)

        split = QSplitter(Qt.Horizontal)
        self.pools = PoolsDiagram()
        split.addWidget(self.pools)
        self.tabs = QTabWidget()
        self.table = QTableWidget(0, len(self.TABLE_HEADERS))
        self.table.setHorizontalHeaderLabels(self.TABLE_HEADERS)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.setSelectionBehavior(QTableWidget.SelectRows)
        self.table.setSelectionMode(QTableWidget.SingleSelection)
        self.table.setToolTip("Select a row to see its pools (the aggregated and PD-only baselines too)")
        self.row_configs: list[PoolConfig] = []
        self.tabs.addTab(self.table, "Configurations")
        self.timeline = RequestTimeline()
        self.tabs.addTab(self.timeline, "Request timeline")
        self.slo_plot = pg.PlotWidget()
        self.slo_plot.setLabel("bottom", "request rate (req/s)")
        self.slo_plot.setLabel("left", "SLO attainment")
        self.slo_plot.setYRange(0, 1.05)
        self.slo_plot.addLegend(offset=(-10, -10))
        self.tabs.addTab(self.slo_plot, "SLO attainment")
        self.search_plot = pg.PlotWidget()
        self.search_plot.setLabel("bottom", "trial")
        self.search_plot.setLabel("left", "goodput (req/s)")
        self.search_plot.addLegend(offset=(10, 10))
        self.trial_dots = self.search_plot.plot([], [], pen=None, symbol="o", symbolSize=6, name="trial")
        self.best_line = self.search_plot.plot([], [], pen=pg.mkPen("#e45756", width=2), stepMode=None,
                                               name="best so far")
        self.tabs.addTab(self.search_plot, "Search progress")
        split.addWidget(self.tabs)
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 3)
        split.setSizes([300, 900])
        lay.addWidget(split, 1)

        self.search_button.clicked.connect(lambda: self.auto_solve())
        self.stop_button.clicked.connect(lambda: self.runner.request_stop())
        self.costs_button.clicked.connect(lambda: self._choose_costs())
        self.record_button.clicked.connect(lambda: self.record())
        self.table.currentCellChanged.connect(lambda row, _c, _pr, _pc: self.show_row(row))
        state.workspace_changed.connect(lambda _p: self._update_record_button())
        self.runner.partial_result_reported.connect(self._on_partial)
        self.runner.status_reported.connect(lambda _id, text: self.status.setText(text))
        self.runner.progress_reported.connect(self._on_progress)
        self.runner.task_finished.connect(self._on_finished)
        self.runner.task_failed.connect(lambda _id, msg: self._ended(f"search failed: {msg}"))
        self.runner.task_cancelled.connect(lambda _id: self._ended("search stopped"))

    # -- inputs ---------------------------------------------------------------------------
    def problem(self, requests: int = 120) -> EpdProblem:
        return EpdProblem(name="image-heavy", costs=self.costs,
                          workload=image_heavy_workload(rate_rps=self.rate.value(), requests=requests),
                          slo=SLO(ttft_s=self.ttft.value(), tpot_s=self.tpot.value() / 1e3),
                          devices=tuple(f"dev{i}" for i in range(self.devices.value())))

    def load_costs(self, path: str) -> bool:
        """Use a calibration file; a bad one leaves the current calibration and says why."""
        try:
            self.costs = load(path, PhaseCosts)
        except EdgeShardError as err:
            self.status.setText(f"costs not loaded: {err}")
            return False
        self.status.setText(f"calibration: {self.costs.source or path}")
        return True

    def _choose_costs(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "EPD phase costs", "", "JSON (*.json)")
        if path:
            self.load_costs(path)

    # -- the menus' actions ---------------------------------------------------------------
    def auto_solve(self, requests: int = 120) -> None:
        """Start the search (baselines first); results arrive through the runner."""
        self.trials_seen = []
        self.trial_dots.setData([], [])
        self.best_line.setData([], [])
        self.search_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self.progress.setValue(0)
        self.record_button.setEnabled(False)
        self.last_problem = self.problem(requests)
        self.runner.start(plan_epd, self.last_problem, self.trials.value())

    def compare(self) -> None:
        """The baselines are compared in every search: start one."""
        self.auto_solve()

    def shutdown(self) -> None:
        self.runner.shutdown()

    # -- results --------------------------------------------------------------------------
    def _on_progress(self, _id: int, done: float, total: float) -> None:
        self.progress.setMaximum(int(total))
        self.progress.setValue(int(done))

    def _on_partial(self, _id: int, value) -> None:
        if not isinstance(value, SearchProgress):
            return
        self.trials_seen.append(value)
        xs = [p.trial for p in self.trials_seen]
        self.trial_dots.setData(xs, [p.candidate.goodput_rps for p in self.trials_seen])
        steps_x = [x for x in xs for _ in (0, 1)][1:] + [xs[-1]]
        steps_y = [p.best.goodput_rps for p in self.trials_seen for _ in (0, 1)]
        self.best_line.setData(steps_x, steps_y)

    def _ended(self, text: str) -> None:
        self.status.setText(text)
        self.search_button.setEnabled(True)
        self.stop_button.setEnabled(False)
        self._update_record_button()

    def _update_record_button(self) -> None:
        ready = self.result is not None and bool(self.state.workspace) and not self.runner.is_busy()
        self.record_button.setEnabled(ready)
        self.record_button.setToolTip("Store the picked configuration's simulated run in the workspace "
                                      "(Sessions replays it)" if self.state.workspace else
                                      "Open a workspace (File) to record runs in")

    def record(self) -> int | None:
        """The picked configuration's simulated run, stored as a predicted run of session ``epd``."""
        from core.sessions.store import SessionStore
        from core.techniques.phase_disaggregation.simulator import record_simulation

        if self.result is None or self.last_problem is None or not self.state.workspace:
            return None
        p, cfg = self.last_problem, self.result.best.config
        sim = simulate_pools(p.costs, p.workload, cfg, record=True)
        try:
            with SessionStore(self.state.workspace) as store:
                run_id = record_simulation(store, store.create_session("epd"), sim, model="simulated",
                                           workload=p.workload, pools=cfg)
        except EdgeShardError as err:
            self.status.setText(f"not recorded: {err}")
            return None
        self.status.setText(f"recorded the picked configuration's simulated run as run {run_id} (session epd)")
        return run_id

    def show_row(self, row: int) -> None:
        """The pools of the table's row ``row`` (a search's configuration or a baseline); the
        multimodal caches' fill is known only for the pick (the only one simulated at the rate)."""
        if self.result is None or not 0 <= row < len(self.row_configs):
            return
        cfg = self.row_configs[row]
        self.pools.show_pools(cfg, self.result.caches if cfg == self.result.best.config else ())

    def _on_finished(self, _id: int, result: EpdPlanResult) -> None:
        self.show_result(result)

    def show_result(self, result: EpdPlanResult) -> None:
        self.result = result
        b = result.best
        self._ended(f"picked {b.config.disaggregation} on {b.devices} devices ({pools_text(b.config)}): goodput "
                    f"{b.goodput_rps:.3g} req/s, TTFT p50 {b.ttft_p50_s:.2f} s — {result.trials} trials in "
                    f"{result.elapsed_s:.1f} s; calibration: {self.costs.source or 'loaded'}")
        self.timeline.show_metrics(result.metrics)
        rows = [(f"#{i + 1} {c.config.disaggregation}", c) for i, c in enumerate(result.top)]
        rows += [(name, c) for name, c in result.baselines]
        self.row_configs = [c.config for _, c in rows]
        fill_table(self.table, [
            (name, str(c.devices), pools_text(c.config),
             f"{c.config.encode_batch}/{c.config.prefill_batch}/{c.config.decode_batch}", c.config.policy,
             f"{c.goodput_rps:.3g}", f"{c.ttft_p50_s:.2f}") for name, c in rows])
        self.pools.show_pools(b.config, result.caches)  # the pick, whatever row filling selected
        self.slo_plot.clear()
        self.slo_plot.addItem(pg.InfiniteLine(pos=TARGET, angle=0, pen=pg.mkPen("#888888", style=Qt.DashLine)))
        for name, pts in result.curves:
            self.slo_plot.plot([p.rate_rps for p in pts], [p.attainment for p in pts], name=name,
                               pen=pg.mkPen(LINES.get(name, "#888888"), width=2), symbol="o", symbolSize=5,
                               symbolBrush=LINES.get(name, "#888888"))
        self.slo_plot.setYRange(0, 1.05)
        xs = [p.rate_rps for _, pts in result.curves for p in pts]
        if xs and all(math.isfinite(x) for x in xs):
            self.slo_plot.setXRange(0, max(xs) * 1.02)


__all__ = ["EpdPlanResult", "PhaseDisaggregationPlanView", "PoolsDiagram", "RequestTimeline", "plan_epd"]

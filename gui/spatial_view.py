"""Spatial partitioning's plan view: every layer's width coloured by device, halos hatched.

The spatial technique's face on the Plan screen (gui.plan_views). A problem comes from a
file or from the paper-shaped scenario (nodes, bandwidth, network); a strategy gives the
plan (Auto-solve: the fused planner; Compare: every partitioner side by side). The tile
canvas draws one row per spatial layer: the solid part is the columns each device owns, the
hatched band under it the input columns the device reads (its strip plus the halo), so a
halo shows as hatching reaching into the neighbour's colour; a line marks each tile (group)
where the gateway scatters and gathers.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QBrush, QColor, QPainter, QPen
from PySide6.QtWidgets import (
    QComboBox, QDoubleSpinBox, QFileDialog, QFrame, QHBoxLayout, QLabel, QPushButton, QScrollArea, QSpinBox,
    QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget,
)

from agents.spatial import CnnSpec, Layer, group_input_ranges, strip_bounds
from core.errors import EdgeShardError
from core.formats import load
from core.techniques.spatial.cost import evaluate, single_device_seconds
from core.techniques.spatial.problem import SpatialPlan, SpatialProblem, check
from core.techniques.spatial.scenarios import paper_shaped
from core.techniques.spatial.strategies import ORDER, compare, run_strategy
from gui.app import stage_color
from gui.studio_state import StudioState
from gui.widgets import InlineMessage, panel_header


def owned_ranges(layers: tuple[Layer, ...], widths: tuple[int, ...], at: int) -> list[tuple[int, int]]:
    """Each device's own columns of layer ``at`` of a group: the last layer's strips, doubled back
    through every pool after ``at`` (pure: the canvas draws it, tests check it)."""
    bounds = [lo for lo, _ in strip_bounds(widths)] + [sum(widths)]
    for layer in reversed(layers[at + 1:]):
        if layer.kind == "pool":
            bounds = [2 * b for b in bounds]
    w = layers[at].w_out
    bounds[-1] = w
    bounds = [min(b, w) for b in bounds]
    return list(zip(bounds, bounds[1:]))


def read_ranges(layers: tuple[Layer, ...], widths: tuple[int, ...], at: int) -> list[tuple[int, int]]:
    """Each device's input columns of layer ``at`` (its strip and halo); (0, 0) for an idle device."""
    out = []
    for lo, hi in strip_bounds(widths):
        if hi <= lo:
            out.append((0, 0))
            continue
        out.append(group_input_ranges(layers, lo, hi)[at])
    return out


class TileCanvas(QWidget):
    """One row per spatial layer: owned columns solid, read columns (halos) hatched."""

    ROW = 22
    LABEL = 150

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.spec: CnnSpec | None = None
        self.plan: SpatialPlan | None = None
        self.setAccessibleName("Tile view")
        self.setMinimumWidth(400)

    def show_plan(self, spec: CnnSpec | None, plan: SpatialPlan | None) -> None:
        self.spec, self.plan = spec, plan
        rows = len(spec.layers) if spec else 0
        self.setMinimumHeight(40 + rows * self.ROW + 30)
        self.updateGeometry()
        self.update()

    def paintEvent(self, _event) -> None:  # noqa: N802 (Qt)
        p = QPainter(self)
        p.setRenderHint(QPainter.Antialiasing, False)
        pal = self.palette()
        text = pal.color(self.foregroundRole())
        if self.spec is None or self.plan is None:
            p.setPen(text)
            p.drawText(self.rect(), Qt.AlignCenter, "No plan yet: pick a strategy or press Auto-solve")
            return
        x0, bar = self.LABEL, max(100, self.width() - self.LABEL - 16)
        y = 8
        for d, name in enumerate(self.plan.devices):  # legend
            p.fillRect(QRectF(x0 + d * 110, y, 12, 12), stage_color(d))
            p.setPen(text)
            p.drawText(QRectF(x0 + d * 110 + 16, y - 2, 92, 16), Qt.AlignLeft | Qt.AlignVCenter,
                       name + (" (gateway)" if d == 0 else ""))
        p.drawText(QRectF(x0 + len(self.plan.devices) * 110, y - 2, 360, 16), Qt.AlignLeft | Qt.AlignVCenter,
                   "▨ hatched: columns read (strip + halo)")
        y = 32
        for (start, end), widths in zip(self.plan.groups, self.plan.widths):
            layers = self.spec.layers[start:end]
            p.setPen(QPen(text, 1))
            p.drawLine(4, y, x0 + bar, y)
            for j, layer in enumerate(layers):
                top = y + j * self.ROW + 2
                label = f"{start + j:2d} {layer.kind}{'' if layer.kind == 'pool' else layer.k} " \
                        f"{layer.c_out}ch {layer.w_out}²"
                p.setPen(text)
                p.drawText(QRectF(4, top, self.LABEL - 8, self.ROW - 4), Qt.AlignLeft | Qt.AlignVCenter, label)
                scale_out = bar / layer.w_out
                for d, (lo, hi) in enumerate(owned_ranges(layers, widths, j)):
                    if hi > lo:
                        p.fillRect(QRectF(x0 + lo * scale_out, top, (hi - lo) * scale_out, self.ROW * 0.55),
                                   stage_color(d))
                scale_in = bar / layer.w_in
                for d, (lo, hi) in enumerate(read_ranges(layers, widths, j)):
                    if hi > lo:
                        colour = QColor(stage_color(d))
                        band = QRectF(x0 + lo * scale_in, top + self.ROW * 0.58 + d * 2, (hi - lo) * scale_in,
                                      self.ROW * 0.3)
                        p.fillRect(band, QBrush(colour, Qt.BDiagPattern))
                        p.setPen(QPen(colour, 1))
                        p.drawRect(band)
            y += len(layers) * self.ROW
        p.setPen(QPen(text, 1))
        p.drawLine(4, y, x0 + bar, y)
        p.drawText(QRectF(4, y + 2, x0 + bar, 18), Qt.AlignLeft | Qt.AlignVCenter,
                   f"{len(self.plan.groups)} tiles (a line = the gateway scatters strips with halos, then gathers); "
                   f"then the FC head on {self.plan.devices[0]}")


class SpatialPlanView(QWidget):
    """The spatial technique's plan view (registered with gui.plan_views)."""

    def __init__(self, state: StudioState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.problem: SpatialProblem | None = None
        self.plan: SpatialPlan | None = None
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 12, 16, 12)
        lay.addWidget(panel_header("Spatial CNN partitioning (EdgeMI)",
                                   "Each convolution map is cut into vertical strips, one per device; the gateway "
                                   "scatters strips with halo columns and gathers the results."))
        controls = QHBoxLayout()
        self.network = QComboBox()
        self.network.addItems(["vgg16", "resnet-style"])
        self.network.setAccessibleName("Network")
        self.nodes = QSpinBox()
        self.nodes.setRange(1, 16)
        self.nodes.setValue(4)
        self.nodes.setAccessibleName("Nodes")
        self.bandwidth = QDoubleSpinBox()
        self.bandwidth.setRange(0.1, 100000.0)
        self.bandwidth.setValue(1000.0)
        self.bandwidth.setSuffix(" Mbit/s")
        self.bandwidth.setAccessibleName("Bandwidth")
        scenario = QPushButton("Use scenario")
        scenario.setToolTip("Devices shaped like EdgeMI's testbed (Raspberry-Pi-class, switched LAN)")
        scenario.clicked.connect(self.use_scenario)
        load_btn = QPushButton("Load problem…")
        load_btn.clicked.connect(self._load_clicked)
        self.strategy = QComboBox()
        self.strategy.addItems(list(ORDER))
        self.strategy.setAccessibleName("Strategy")
        self.strategy.currentTextChanged.connect(lambda _s: self.show_strategy(self.strategy.currentText()))
        for label, w in (("Network", self.network), ("Nodes", self.nodes), ("Link", self.bandwidth)):
            controls.addWidget(QLabel(label))
            controls.addWidget(w)
        controls.addWidget(scenario)
        controls.addWidget(load_btn)
        controls.addSpacing(16)
        controls.addWidget(QLabel("Strategy"))
        controls.addWidget(self.strategy)
        controls.addStretch(1)
        lay.addLayout(controls)
        self.summary = QLabel("")
        self.summary.setAccessibleName("Plan summary")
        self.summary.setWordWrap(True)
        lay.addWidget(self.summary)
        self.message = InlineMessage()
        lay.addWidget(self.message)
        self.table = QTableWidget(0, 6)
        self.table.setHorizontalHeaderLabels(["strategy", "ms / image", "speedup", "devices", "tiles", "status"])
        self.table.verticalHeader().hide()
        self.table.setMaximumHeight(150)
        self.table.setAccessibleName("Comparison")
        self.table.hide()
        lay.addWidget(self.table)
        self.canvas = TileCanvas()
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.NoFrame)
        scroll.setWidget(self.canvas)
        lay.addWidget(scroll, 1)
        self.use_scenario()

    # problem ----------------------------------------------------------------------
    def use_scenario(self) -> None:
        self.set_problem(paper_shaped(self.nodes.value(), self.bandwidth.value(), network=self.network.currentText()))

    def _load_clicked(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Load spatial problem", "", "Spatial problem (*.json)")
        if path:
            self.load_problem(path)

    def load_problem(self, path: str) -> None:
        try:
            problem = load(path, SpatialProblem)
            check(problem)
        except EdgeShardError as err:
            self.message.show_lines([str(err)], "This problem cannot be planned:")
            return
        self.set_problem(problem)

    def set_problem(self, problem: SpatialProblem) -> None:
        self.problem = problem
        self.message.show_lines([])
        self.table.hide()
        self.show_strategy(self.strategy.currentText())

    # plans ------------------------------------------------------------------------
    def show_strategy(self, name: str) -> None:
        if self.problem is None:
            return
        out = run_strategy(self.problem, name)
        if out.plan is None:
            self.plan = None
            self.message.show_lines([out.error], f"{name} found no plan:")
            self.canvas.show_plan(None, None)
            return
        self.plan = out.plan
        one = single_device_seconds(self.problem)
        cost = evaluate(self.problem, out.plan)
        self.summary.setText(
            f"{self.problem.name}: {self.problem.model.spec().name}. {name}: {cost.latency_s * 1e3:.1f} ms/image, "
            f"{one / cost.latency_s:.2f}× one device ({one * 1e3:.0f} ms), {len(out.plan.devices)} devices, "
            f"{len(out.plan.groups)} tiles, {cost.moved_bytes / 1e6:.1f} MB moved per image"
            + ("" if cost.fits else " — does NOT fit in memory"))
        self.canvas.show_plan(self.problem.model.spec(), out.plan)

    def auto_solve(self) -> None:
        self.strategy.setCurrentText("fused")
        self.show_strategy("fused")

    def compare(self) -> None:
        if self.problem is None:
            return
        one = single_device_seconds(self.problem)
        outs = compare(self.problem)
        self.table.setRowCount(len(outs))
        for r, o in enumerate(outs):
            cells = [o.strategy, f"{o.latency_s * 1e3:.1f}" if o.latency_s else "—",
                     f"{one / o.latency_s:.2f}×" if o.latency_s else "—",
                     str(len(o.plan.devices)) if o.plan else "—", str(len(o.plan.groups)) if o.plan else "—",
                     o.status if not o.error else f"{o.status}: {o.error}"]
            for c, text in enumerate(cells):
                self.table.setItem(r, c, QTableWidgetItem(text))
        self.table.resizeColumnsToContents()
        self.table.show()

"""Spatial partitioning's tile canvas: every layer's width coloured by device, halos hatched.

One row per spatial layer: the solid part is the columns each device owns, the hatched band
under it the input columns the device reads (its strip plus the halo), so a halo shows as
hatching reaching into the neighbour's colour; a line marks each tile (group) where the
gateway scatters and gathers.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QBrush, QColor, QPainter, QPen
from PySide6.QtWidgets import QWidget

from agents.techniques.spatial.network import CnnSpec, Layer, group_input_ranges, strip_bounds
from core.techniques.spatial.problem import SpatialPlan
from gui.app import stage_color
from gui.widgets import counted


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
        x = x0
        for d, name in enumerate(self.plan.devices):  # legend, each entry as wide as its name
            label = name + (" (gateway)" if d == 0 else "")
            room = max(92, p.fontMetrics().horizontalAdvance(label) + 4)
            p.fillRect(QRectF(x, y, 12, 12), stage_color(d))
            p.setPen(text)
            p.drawText(QRectF(x + 16, y - 2, room, 16), Qt.AlignLeft | Qt.AlignVCenter, label)
            x += 16 + room + 2
        p.drawText(QRectF(x, y - 2, 360, 16), Qt.AlignLeft | Qt.AlignVCenter, "▨ hatched: columns read (strip + halo)")
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
                   f"{counted(len(self.plan.groups), 'tile')} "
                   "(a line = the gateway scatters strips with halos, then gathers); "
                   f"then the FC head on {self.plan.devices[0]}")

"""What the timeline draws over its boxes: the selection, its highlight, flow arrows and a
selected range (``TimelineOverlayItem``), and the view box whose Shift+drag selects a range."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from pyqtgraph.Qt.internals import PrimitiveArray
from PySide6.QtCore import QLineF, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QPainter, QPen

from gui.timeline.items import BANDS, BOX_DTYPE, KINDS


class TimelineOverlayItem(pg.GraphicsObject):
    """Selection, highlight, flow arrows and the selected range: one item, one pass per kind.

    Fed whole arrays (never one item per box), like ``TimelineBoxesItem``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.highlight = np.zeros(0, dtype=BOX_DTYPE)
        self.selected = np.zeros(0, dtype=BOX_DTYPE)
        self.flows = np.zeros((0, 4))
        self.range: tuple[float, float] | None = None
        self._colour = QColor("#111111")
        self._bounds = QRectF(0, 0, 1, 1)
        self._rects = PrimitiveArray(QRectF, 4)
        self.setZValue(10)

    def set_colour(self, colour: QColor) -> None:
        self._colour = QColor(colour)
        self.update()

    def set_data(self, highlight: np.ndarray, selected: np.ndarray, flows: np.ndarray,
                 range_: tuple[float, float] | None, bounds: QRectF) -> None:
        self.prepareGeometryChange()
        self.highlight, self.selected, self.flows, self.range = highlight, selected, flows, range_
        self._bounds = QRectF(bounds)
        self.update()

    def boundingRect(self) -> QRectF:
        return QRectF(self._bounds)

    def _device_rects(self, rows: np.ndarray, sx, dx, sy, dy) -> None:
        b0 = np.array([BANDS[k][0] for k in range(len(KINDS))])[rows["kind"]]
        b1 = np.array([BANDS[k][1] for k in range(len(KINDS))])[rows["kind"]]
        X0 = np.floor(rows["start_s"] * sx + dx)
        X1 = np.maximum(np.ceil(rows["end_s"] * sx + dx), X0 + 1)
        ya, yb = (rows["lane"] + b0) * sy + dy, (rows["lane"] + b1) * sy + dy
        self._rects.resize(len(rows))
        arr = self._rects.ndarray()
        arr[:, 0], arr[:, 1] = X0, np.round(np.minimum(ya, yb))
        arr[:, 2], arr[:, 3] = X1 - X0, np.round(np.abs(yb - ya))

    def paint(self, painter, option, widget=None) -> None:
        tr = painter.transform()
        sx, dx, sy, dy = tr.m11(), tr.dx(), tr.m22(), tr.dy()
        if sx <= 0:
            return
        painter.save()
        painter.resetTransform()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing, True)
        if self.range is not None:
            shade = QColor(self._colour)
            shade.setAlpha(40)
            x0, x1 = (v * sx + dx for v in self.range)
            painter.fillRect(QRectF(x0, -1e5, x1 - x0, 2e5), shade)
        for rows, width in ((self.highlight, 1.5), (self.selected, 3.0)):
            if not len(rows):
                continue
            self._device_rects(rows, sx, dx, sy, dy)
            pen = QPen(self._colour, width)
            pen.setCosmetic(True)
            painter.setPen(pen)
            painter.setBrush(Qt.BrushStyle.NoBrush)
            painter.drawRects(*self._rects.drawargs())
        if len(self.flows):
            x0 = self.flows[:, 0] * sx + dx
            y0 = self.flows[:, 1] * sy + dy
            x1 = self.flows[:, 2] * sx + dx
            y1 = self.flows[:, 3] * sy + dy
            ang = np.arctan2(y1 - y0, x1 - x0)
            head = 7.0
            lines = np.column_stack([
                np.concatenate([x0, x1, x1]), np.concatenate([y0, y1, y1]),
                np.concatenate([x1, x1 - head * np.cos(ang - 0.45), x1 - head * np.cos(ang + 0.45)]),
                np.concatenate([y1, y1 - head * np.sin(ang - 0.45), y1 - head * np.sin(ang + 0.45)])])
            arr = PrimitiveArray(QLineF, 4)
            arr.resize(len(lines))
            arr.ndarray()[:] = lines
            pen = QPen(self._colour, 1.6)
            pen.setCosmetic(True)
            painter.setPen(pen)
            painter.drawLines(*arr.drawargs())
        painter.restore()


class RangeSelectViewBox(pg.ViewBox):
    """Shift + drag selects a time range (its summed figures); plain drag pans as before.

    The range goes out as a signal, not through a callback kept on the item: an item of the scene
    holding a bound method of the view that owns the scene made a cycle whose collection deleted the
    view (and so the scene) from inside the item's own destructor, a segfault in
    ``QGraphicsScene::clear`` (tests/gui/timeline/test_view_lifetime.py)."""

    range_dragged = Signal(float, float, bool)  # start, current end (seconds), drag finished

    def __init__(self) -> None:
        super().__init__()
        self._range_start: float | None = None

    def mouseDragEvent(self, ev, axis=None) -> None:
        if ev.button() == Qt.MouseButton.LeftButton and ev.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            ev.accept()
            x = self.mapSceneToView(ev.scenePos()).x()
            if ev.isStart() or self._range_start is None:
                self._range_start = self.mapSceneToView(ev.buttonDownScenePos()).x()
            self.range_dragged.emit(self._range_start, x, ev.isFinish())
            if ev.isFinish():
                self._range_start = None
            return
        super().mouseDragEvent(ev, axis)


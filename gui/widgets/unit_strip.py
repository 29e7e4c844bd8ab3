"""The model's units as a horizontal strip coloured by stage, with draggable boundaries.

Dragging the handle between two stages previews the move and emits
``boundary_moved(stage, new_start)`` on release; the editor turns that into an
undoable plan edit. A boundary can never make a stage empty.
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, QPointF, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFont, QMouseEvent, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from core.models.units import ModelSpec
from core.planning.plan import ShardPlan
from gui.app import stage_color, theme_colors

MARGIN = 8
LABEL_H = 22
HANDLE_PICK_PX = 6


class UnitStripView(QWidget):
    boundary_moved = Signal(int, int)
    """(stage index ≥ 1, its new first unit)"""
    stage_clicked = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._model: ModelSpec | None = None
        self._plan: ShardPlan | None = None
        self._bad_stages: set[int] = set()
        self._drag_stage: int | None = None
        self._drag_unit: int | None = None
        self.setMouseTracking(True)
        self.setMinimumHeight(88)
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)
        self.setAccessibleName("Unit strip")
        self.setAccessibleDescription("Model units coloured by stage; drag a boundary to move units between stages")
        self.setToolTip("Drag the boundary between two stages to move units.\n"
                        "Keyboard: Tab to the strip, Up/Down picks a boundary, Left/Right moves it by one unit")
        self.setFocusPolicy(Qt.StrongFocus)
        self._kb_stage = 1
        """The boundary (left edge of this stage) that the arrow keys move."""

    def sizeHint(self) -> QSize:
        return QSize(800, 88)

    def set_plan(self, model: ModelSpec | None, plan: ShardPlan | None, bad_stages: set[int] = frozenset()) -> None:
        self._model, self._plan, self._bad_stages = model, plan, set(bad_stages)
        self._drag_stage = self._drag_unit = None
        n = len(plan.stages) if plan else 0
        self._kb_stage = min(max(1, self._kb_stage), max(1, n - 1))
        self.update()

    def keyPressEvent(self, ev) -> None:
        plan = self._plan
        if plan is None or len(plan.stages) < 2:
            return super().keyPressEvent(ev)
        j = self._kb_stage
        if ev.key() in (Qt.Key_Up, Qt.Key_Down):
            step = 1 if ev.key() == Qt.Key_Down else -1
            self._kb_stage = (j - 1 + step) % (len(plan.stages) - 1) + 1
            self.update()
        elif ev.key() in (Qt.Key_Left, Qt.Key_Right):
            new = plan.stages[j].start + (1 if ev.key() == Qt.Key_Right else -1)
            if plan.stages[j - 1].start < new < plan.stages[j].end:
                self.boundary_moved.emit(j, new)
        else:
            super().keyPressEvent(ev)

    # geometry -------------------------------------------------------------
    def _n(self) -> int:
        return self._plan.num_units if self._plan else 0

    def _strip_rect(self) -> QRectF:
        return QRectF(MARGIN, MARGIN + LABEL_H, max(1, self.width() - 2 * MARGIN), self.height() - 2 * MARGIN - 2 * LABEL_H)

    def unit_x(self, unit: int) -> float:
        """x of the left edge of ``unit`` (unit == N gives the right end)."""
        r = self._strip_rect()
        return r.left() + r.width() * unit / max(1, self._n())

    def unit_at(self, x: float) -> int:
        r = self._strip_rect()
        return int(max(0, min(self._n() - 1, (x - r.left()) * self._n() // max(1.0, r.width()))))

    def _nearest_boundary(self, x: float) -> int | None:
        if not self._plan:
            return None
        best, best_d = None, HANDLE_PICK_PX + 1.0
        for j in range(1, len(self._plan.stages)):
            d = abs(self.unit_x(self._plan.stages[j].start) - x)
            if d < best_d:
                best, best_d = j, d
        return best

    def boundary_point(self, stage: int) -> QPointF:
        """Where the handle of ``stage``'s left boundary is (for tests and accessibility)."""
        r = self._strip_rect()
        return QPointF(self.unit_x(self._plan.stages[stage].start), r.center().y())

    def _starts(self) -> list[int]:
        starts = [s.start for s in self._plan.stages]
        if self._drag_stage is not None and self._drag_unit is not None:
            starts[self._drag_stage] = self._drag_unit
        return starts

    def stage_labels(self) -> list[tuple[QRectF, str, str]]:
        """Each stage's label above the strip: (where, text shown, full text). Left to right, a
        label takes the longest of its forms (``2: edge-c  (1)``, ``2: edge-c (1)``, ``2: edge-c``,
        ``edge-c``, ``2``) that fits between the previous label and the next stage's start, moved
        left over free space where its own stage is narrower (the last stage of 8 units at
        1024 px read "2: edge…"); only a label that fits in no form is elided (its full text is
        then the label's tooltip)."""
        if not self._plan or not self._model:
            return []
        fm = self.fontMetrics()
        n, gap = self._n(), 8.0
        starts = self._starts()
        ends = starts[1:] + [n]
        out: list[tuple[QRectF, str, str]] = []
        prev_end = float(MARGIN)
        for j, (a, b) in enumerate(zip(starts, ends)):
            dev = self._plan.stages[j].device
            forms = [f"{j}: {dev}  ({b - a})", f"{j}: {dev} ({b - a})", f"{j}: {dev}", dev, str(j)]
            x0 = self.unit_x(a) + 2
            lane_left = prev_end + gap if j else float(MARGIN)
            lane_right = self.unit_x(b) - 2 if j + 1 < len(starts) else self.width() - float(MARGIN)
            text, width = "", 0.0
            for form in forms:
                w = float(fm.horizontalAdvance(form))
                if w <= lane_right - lane_left:
                    text, width = form, w
                    break
            if not text:  # no form fits: elide the shortest one that names the device
                width = max(0.0, lane_right - lane_left)
                text = fm.elidedText(forms[3], Qt.ElideRight, int(width))
                width = float(fm.horizontalAdvance(text))
            left = max(lane_left, min(x0, lane_right - width))
            out.append((QRectF(left, MARGIN, width + 1, LABEL_H), text, forms[0]))
            prev_end = left + width
        return out

    def event(self, ev) -> bool:
        """Over a shortened stage label, the tooltip is its full text."""
        if ev.type() == QEvent.ToolTip:
            for rect, text, full in self.stage_labels():
                if text != full and rect.contains(QPointF(ev.pos())):
                    QToolTip.showText(ev.globalPos(), full, self)
                    return True
        return super().event(ev)

    # painting ---------------------------------------------------------------
    def paintEvent(self, _event) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.Antialiasing)
        c = theme_colors()
        r = self._strip_rect()
        if not self._plan or not self._model:
            p.setPen(QColor(c["muted"]))
            p.drawText(self.rect(), Qt.AlignCenter, "No plan yet: load a profile, then Auto-solve or add stages")
            return
        n = self._n()
        starts = self._starts()
        ends = starts[1:] + [n]
        small = QFont(self.font())
        small.setPointSizeF(max(7.0, small.pointSizeF() - 1.5))
        for j, (a, b) in enumerate(zip(starts, ends)):
            col = stage_color(j)
            x0, x1 = self.unit_x(a), self.unit_x(b)
            for u in range(a, b):
                ux0, ux1 = self.unit_x(u), self.unit_x(u + 1)
                shade = col.lighter(112) if u % 2 else col
                p.fillRect(QRectF(ux0, r.top(), ux1 - ux0, r.height()), shade)
            if j in self._bad_stages:
                p.setPen(QPen(QColor(c["error"]), 3))
                p.setBrush(Qt.NoBrush)
                p.drawRect(QRectF(x0 + 1.5, r.top() + 1.5, x1 - x0 - 3, r.height() - 3))
        # stage labels above
        p.setFont(self.font())
        for j, (rect, text, _full) in enumerate(self.stage_labels()):
            p.setPen(QColor(c["error"] if j in self._bad_stages else c["text"]))
            p.drawText(rect, Qt.AlignVCenter | Qt.AlignLeft, text)
        # unit index ticks below
        p.setFont(small)
        p.setPen(QColor(c["muted"]))
        step = max(1, int(n / max(1, r.width() / 36)))
        for u in range(0, n, step):
            p.drawText(QRectF(self.unit_x(u), r.bottom() + 2, 36, LABEL_H), Qt.AlignLeft | Qt.AlignTop, str(u))
        # handles
        for j in range(1, len(starts)):
            x = self.unit_x(starts[j])
            active = j == self._drag_stage or (self.hasFocus() and j == self._kb_stage and self._drag_stage is None)
            p.setPen(QPen(QColor(c["text"]), 3 if active else 2))
            p.drawLine(QPointF(x, r.top() - 4), QPointF(x, r.bottom() + 4))
            p.setBrush(QColor(c["accent"] if active else c["base"]))
            p.drawRoundedRect(QRectF(x - 4, r.center().y() - 10, 8, 20), 3, 3)
        p.end()

    # interaction --------------------------------------------------------------
    def mousePressEvent(self, ev: QMouseEvent) -> None:
        if ev.button() != Qt.LeftButton or not self._plan:
            return
        j = self._nearest_boundary(ev.position().x())
        if j is not None:
            self._drag_stage = j
            self._drag_unit = self._plan.stages[j].start
            self.update()
        else:
            self.stage_clicked.emit(self._plan.stage_of_unit(self.unit_at(ev.position().x())))

    def mouseMoveEvent(self, ev: QMouseEvent) -> None:
        if not self._plan:
            return
        x = ev.position().x()
        if self._drag_stage is None:
            on_handle = self._nearest_boundary(x) is not None
            self.setCursor(Qt.SplitHCursor if on_handle else Qt.ArrowCursor)
            u = self.unit_at(x)
            unit = self._model.units[u] if self._model and u < len(self._model.units) else None
            if unit is not None:
                j = self._plan.stage_of_unit(u)
                QToolTip.showText(
                    ev.globalPosition().toPoint(),
                    f"unit {u}: {unit.name}\nstage {j} on {self._plan.stages[j].device}\n"
                    f"weights {unit.param_bytes / 2**20:.1f} MiB",
                    self,
                )
            return
        j = self._drag_stage
        lo = self._plan.stages[j - 1].start + 1
        hi = self._plan.stages[j].end - 1
        r = self._strip_rect()
        unit = round((x - r.left()) * self._n() / max(1.0, r.width()))
        self._drag_unit = max(lo, min(hi, unit))
        self.update()

    def mouseReleaseEvent(self, ev: QMouseEvent) -> None:
        if ev.button() != Qt.LeftButton or self._drag_stage is None:
            return
        j, u = self._drag_stage, self._drag_unit
        self._drag_stage = self._drag_unit = None
        self.update()
        if u is not None and u != self._plan.stages[j].start:
            self.boundary_moved.emit(j, u)

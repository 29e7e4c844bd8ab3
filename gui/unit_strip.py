"""The model's units as a horizontal strip coloured by stage, with draggable boundaries.

Dragging the handle between two stages previews the move and emits
``boundary_moved(stage, new_start)`` on release; the editor turns that into an
undoable plan edit. A boundary can never make a stage empty.
"""

from __future__ import annotations

from PySide6.QtCore import QPointF, QRectF, QSize, Qt, Signal
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
            # stage label above
            dev = self._plan.stages[j].device
            p.setPen(QColor(c["error"] if j in self._bad_stages else c["text"]))
            p.setFont(self.font())
            label = f"{j}: {dev}  ({b - a})"
            fm = p.fontMetrics()
            if fm.horizontalAdvance(label) > x1 - x0 - 4:
                label = fm.elidedText(label, Qt.ElideRight, int(x1 - x0 - 4))
            p.drawText(QRectF(x0 + 2, MARGIN, x1 - x0 - 4, LABEL_H), Qt.AlignVCenter | Qt.AlignLeft, label)
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

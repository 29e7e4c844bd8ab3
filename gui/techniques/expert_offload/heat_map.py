"""The expert heat map (EdgeMoE): blocks × experts, coloured by what the expert buffer did.

Rows are MoE blocks, columns experts; a cell's colour is the chosen measure (activations,
hit rate, hits, misses, preloads, evictions, resident) from ``ExpertActivity`` over a run's
``io`` events, so it fills in live during a run and the same way in a replay. Whatever the
measure, the experts resident in the buffer (after the latest event) are outlined. Hovering a
cell shows all its counts. The Run monitor shows it as soon as a run carries expert activity.
"""

from __future__ import annotations

from typing import Sequence

from PySide6.QtCore import QPoint, QRect, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPalette, QPen
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QSizePolicy, QToolTip, QVBoxLayout, QWidget

from agents.protocol import TimelineEvent
from core.techniques.expert_offload.activity import MEASURES, ExpertActivity

LOW, HIGH = QColor("#e8eef6"), QColor("#1f4e8c")
RESIDENT = QColor("#e07b00")
"""The outline of a resident expert's cell (orange: apart from the blue scale)."""
"""A sequential scale: pale for 0, deep blue for the largest value (hit rate: 0 → 1)."""


def cell_colour(fraction: float | None) -> QColor:
    """The scale's colour at ``fraction`` in [0, 1]; grey for no value (never picked)."""
    if fraction is None:
        return QColor(150, 150, 150, 60)
    f = min(1.0, max(0.0, fraction))
    return QColor(*(round(a + (b - a) * f) for a, b in ((LOW.red(), HIGH.red()), (LOW.green(), HIGH.green()),
                                                         (LOW.blue(), HIGH.blue()))))


class _Grid(QWidget):
    """The painted cells (one per block and expert) with hover details."""

    LABEL_W, LABEL_H = 34, 16

    def __init__(self, owner: "ExpertHeatMap") -> None:
        super().__init__(owner)
        self.owner = owner
        self.setMouseTracking(True)
        self.setMinimumSize(120, 40)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)

    def sizeHint(self) -> QSize:
        return QSize(320, 140)

    def cell_rect(self, row: int, col: int) -> QRect:
        rows, cols = max(1, len(self.owner.blocks())), max(1, self.owner.activity.experts)
        w = (self.width() - self.LABEL_W) / cols
        h = (self.height() - self.LABEL_H) / rows
        return QRect(int(self.LABEL_W + col * w), int(self.LABEL_H + row * h), max(1, int(w) - 1), max(1, int(h) - 1))

    def cell_at(self, pos: QPoint) -> tuple[int, int] | None:
        """(block, expert) under ``pos``, None outside the cells."""
        blocks = self.owner.blocks()
        for r, block in enumerate(blocks):
            for c in range(self.owner.activity.experts):
                if self.cell_rect(r, c).contains(pos):
                    return block, c
        return None

    def paintEvent(self, event) -> None:
        p = QPainter(self)
        text = self.palette().color(QPalette.ColorRole.WindowText)
        blocks = self.owner.blocks()
        grid = self.owner.grid()
        top = max((v for row in grid for v in row if v is not None), default=0.0)
        scale = 1.0 if self.owner.measure == "hit rate" else (top or 1.0)
        p.setPen(text)
        font = p.font()
        font.setPointSizeF(max(6.0, font.pointSizeF() * 0.8))
        p.setFont(font)
        cols = self.owner.activity.experts
        step = max(1, cols // 16)  # label every column while they fit
        for c in range(0, cols, step):
            r = self.cell_rect(0, c)
            p.drawText(QRect(r.left(), 0, max(r.width(), 16), self.LABEL_H), Qt.AlignmentFlag.AlignCenter, str(c))
        for row, (block, values) in enumerate(zip(blocks, grid)):
            r = self.cell_rect(row, 0)
            p.setPen(text)
            p.drawText(QRect(0, r.top(), self.LABEL_W - 4, r.height()),
                       Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, f"L{block}")
            for c, v in enumerate(values):
                cell = self.cell_rect(row, c)
                p.fillRect(cell, cell_colour(None if v is None else v / scale))
                if self.owner.activity.is_resident(block, c):
                    pen = QPen(RESIDENT)
                    pen.setWidth(2)
                    p.setPen(pen)
                    p.drawRect(cell.adjusted(1, 1, -1, -1))
        p.end()

    def mouseMoveEvent(self, event) -> None:
        cell = self.cell_at(event.position().toPoint())
        if cell is None:
            QToolTip.hideText()
            return
        QToolTip.showText(event.globalPosition().toPoint(), self.owner.describe(*cell), self)


class ExpertHeatMap(QWidget):
    """Blocks × experts of one run's expert activity, with a measure to colour by."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Expert heat map")
        self.activity = ExpertActivity()
        self.measure = MEASURES[0]
        self.measure_box = QComboBox()
        self.measure_box.addItems(MEASURES)
        self.measure_box.setAccessibleName("Heat map measure")
        self.measure_box.setToolTip("Colour each block × expert cell by: activations (router picks), hit rate of the "
                                    "expert buffer, hits, misses (reads on demand), preloads, evictions, or resident "
                                    "(in the buffer now). Resident experts are outlined in orange.")
        self.measure_box.currentTextChanged.connect(self._on_measure_box_changed)
        self.summary = QLabel("No expert activity yet.")
        self.summary.setWordWrap(True)
        self.grid_widget = _Grid(self)
        self.grid_widget.setToolTip("Rows: MoE blocks; columns: experts; orange outline: resident in the "
                                    "expert buffer now. Hover a cell for its counts.")
        top = QHBoxLayout()
        top.setContentsMargins(0, 0, 0, 0)
        top.addWidget(QLabel("Colour by"))
        top.addWidget(self.measure_box, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(top)
        layout.addWidget(self.grid_widget, 1)
        layout.addWidget(self.summary)

    # -- feeding -------------------------------------------------------------------------
    def reset(self) -> None:
        self.activity = ExpertActivity()
        self._refresh()

    def add_events(self, events: Sequence[TimelineEvent]) -> bool:
        """Count the expert events among ``events``; True when any was one (the caller shows the map)."""
        seen = self.activity.add(events)
        if seen:
            self._refresh()
        return seen

    def set_measure(self, measure: str) -> None:
        self.measure_box.setCurrentText(measure)

    # -- reading -------------------------------------------------------------------------
    def blocks(self) -> list[int]:
        return sorted(self.activity.blocks)

    def grid(self) -> list[list[float | None]]:
        return self.activity.grid(self.measure)

    def describe(self, block: int, expert: int) -> str:
        """Hover text of a cell: every count of that expert."""
        a = self.activity
        rate = a.value("hit rate", block, expert)
        where = "resident in the buffer" if a.is_resident(block, expert) else "not in the buffer"
        lines = [f"block {block}, expert {expert} ({where})",
                 f"activations {a.value('activations', block, expert):.0f} · hit rate "
                 + ("—" if rate is None else f"{rate * 100:.0f} %"),
                 f"hits {a.value('hits', block, expert):.0f} · misses {a.value('misses', block, expert):.0f} · "
                 f"preloads {a.value('preloads', block, expert):.0f} · evictions {a.value('evictions', block, expert):.0f}"]
        return "\n".join(lines)

    # -- internals -----------------------------------------------------------------------
    def _on_measure_box_changed(self, measure: str) -> None:
        self.measure = measure
        self._refresh()

    def _refresh(self) -> None:
        t = self.activity.totals()
        rate = self.activity.hit_rate()
        if self.activity.is_empty():
            self.summary.setText("No expert activity yet.")
        else:
            full = (f"hit rate {'—' if rate is None else f'{rate * 100:.0f} %'} · hits {t['hits']} · misses "
                    f"{t['misses']} · preloads {t['preloads']} · evictions {t['evictions']} · read "
                    f"{t['bytes_read'] / 1e6:.1f} MB · resident now {t['resident']} (outlined)")
            # two short lines at most, so a small window's monitor does not squeeze it over the grid
            self.summary.setText(f"hit rate {'—' if rate is None else f'{rate * 100:.0f} %'} · {t['misses']} misses"
                                 f" · {t['bytes_read'] / 1e6:.1f} MB read · {t['resident']} resident")
            self.summary.setToolTip(full)
        self.grid_widget.update()

"""Small building blocks the screens share: headed panels, metric cards, inline errors, tables."""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QMessageBox, QScrollArea, QTableWidget,
                               QTableWidgetItem, QToolButton, QVBoxLayout, QWidget)

from core.errors import EdgeShardError


def counted(n: int, noun: str) -> str:
    """``n noun`` with the plural only where n is not one: a one-device plan read "1 devices"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def panel_header(title: str, subtitle: str) -> QWidget:
    w = QWidget()
    lay = QVBoxLayout(w)
    lay.setContentsMargins(0, 0, 0, 4)
    lay.setSpacing(0)
    t = QLabel(title)
    t.setProperty("role", "title")
    s = QLabel(subtitle)
    s.setProperty("role", "subtitle")
    s.setWordWrap(True)
    lay.addWidget(t)
    lay.addWidget(s)
    return w


class MetricCard(QFrame):
    """A labelled figure (e.g. "Latency / token  41.2 ms"); red when marked bad."""

    def __init__(self, label: str, tooltip: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setProperty("role", "card")
        self.setToolTip(tooltip)
        self.setAccessibleName(label)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(12, 8, 12, 8)
        lay.setSpacing(2)
        self._label = QLabel(label)
        self._label.setProperty("role", "metricLabel")
        self.value_label = QLabel("—")
        self.value_label.setProperty("role", "metric")
        self.value_label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        lay.addWidget(self._label)
        lay.addWidget(self.value_label)

    def set_label(self, label: str, tooltip: str) -> None:
        """Name the figure anew (a CNN run's replay counts images, not tokens)."""
        self._label.setText(label)
        self.setToolTip(tooltip)
        self.setAccessibleName(label)

    def set_value(self, text: str, bad: bool = False) -> None:
        self.value_label.setText(text)
        self.value_label.setProperty("role", "metric")
        self.value_label.setStyleSheet("color: palette(text);" if not bad else "color: #d32f2f;")
        self.setAccessibleDescription(text)

    def text(self) -> str:
        return self.value_label.text()


class InlineMessage(QLabel):
    """An inline error with what to do, hidden when empty."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setProperty("role", "error")
        self.setWordWrap(True)
        self.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.setAccessibleName("Problems")
        self.hide()

    def show_lines(self, lines: list[str], heading: str = "") -> None:
        if not lines:
            self.clear()
            self.hide()
            return
        body = "\n".join(f"• {x}" for x in lines)
        self.setText(f"{heading}\n{body}" if heading else body)
        self.show()


def row(*widgets: QWidget, stretch_last: bool = False) -> QWidget:
    w = QWidget()
    lay = QHBoxLayout(w)
    lay.setContentsMargins(0, 0, 0, 0)
    for x in widgets:
        lay.addWidget(x)
    if not stretch_last:
        lay.addStretch(1)
    return w


def show_error(parent: QWidget | None, title: str, err: BaseException | str, what_to_do: str = "") -> None:
    """A dialog with the operator-facing message (never a traceback)."""
    text = str(err) if isinstance(err, (EdgeShardError, str)) else f"{type(err).__name__}: {err}"
    box = QMessageBox(QMessageBox.Warning, title, text, QMessageBox.Ok, parent)
    if what_to_do:
        box.setInformativeText(what_to_do)
    box.setObjectName("errorDialog")
    box.open()


UNAVAILABLE = "\nUnavailable: "


class _DisabledReason(QObject):
    """Keeps ``UNAVAILABLE + why`` at the end of a widget's tooltip while it is disabled,
    whoever disables it or rewrites its tooltip."""

    def __init__(self, widget: QWidget, why: str) -> None:
        super().__init__(widget)
        self.why = why
        widget.installEventFilter(self)
        self._apply(widget)

    def eventFilter(self, obj, event) -> bool:
        if event.type() in (QEvent.EnabledChange, QEvent.ToolTipChange):
            self._apply(obj)
        return False

    def _apply(self, w: QWidget) -> None:
        base = w.toolTip().split(UNAVAILABLE)[0]
        tip = base if w.isEnabled() else base + UNAVAILABLE + self.why
        if tip != w.toolTip():
            w.setToolTip(tip)


def say_why_disabled(reasons: dict[QWidget, str]) -> None:
    """Disabled controls say why in their tooltip (and what to do), not only what they would do.
    Saying it again for a widget replaces its reason (a reason that changes with the state)."""
    for widget, why in reasons.items():
        known = widget.findChild(_DisabledReason, options=Qt.FindDirectChildrenOnly)
        if known is None:
            _DisabledReason(widget, why)
        else:
            known.why = why
            known._apply(widget)


def comparison_table(headers: list[str]) -> QTableWidget:
    """A plan view's Compare table: one row per strategy, short, hidden until Compare fills it."""
    table = QTableWidget(0, len(headers))
    table.setHorizontalHeaderLabels(headers)
    table.verticalHeader().hide()
    table.setMaximumHeight(150)
    table.setAccessibleName("Comparison")
    table.hide()
    return table


def fill_table(table: QTableWidget, rows, tooltips=None) -> None:
    """Replace ``table``'s rows with ``rows`` of text cells (``tooltips``: one per row, on every
    cell of it) and size the columns to what they hold."""
    table.setRowCount(len(rows))
    for r, cells in enumerate(rows):
        for c, text in enumerate(cells):
            item = QTableWidgetItem(text)
            if tooltips is not None:
                item.setToolTip(tooltips[r])
            table.setItem(r, c, item)
    table.resizeColumnsToContents()


def browse_button(accessible_name: str, tooltip: str) -> QToolButton:
    """A narrow "…" button beside a path field: "Browse…" left the field too little room at
    1024x700. A tool button: a push button's style may floor its width at 80 px (Fusion without
    the studio's style sheet) or at 38 (with it), a tool button's minimum is its text."""
    button = QToolButton()
    button.setText("…")
    button.setAccessibleName(accessible_name)
    button.setToolTip(tooltip)
    button.setFixedWidth(max(button.minimumSizeHint().width(), button.fontMetrics().horizontalAdvance(" … ") + 16))
    return button


def borderless_scroll(widget: QWidget) -> QScrollArea:
    """``widget`` in a frameless scroll area that resizes it (a canvas larger than its room)."""
    scroll = QScrollArea()
    scroll.setWidgetResizable(True)
    scroll.setFrameShape(QFrame.NoFrame)
    scroll.setWidget(widget)
    return scroll

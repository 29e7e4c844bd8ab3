"""Check boxes (and checkable list items) stay visible in the dark theme (issue item 7: dark theme checkbox contrast)."""

from __future__ import annotations

from PySide6.QtGui import QColor
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QCheckBox, QListWidget, QListWidgetItem

from gui import app as studio_app


def _luminance(c: QColor) -> float:
    def lin(v: float) -> float:
        return v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4
    return 0.2126 * lin(c.redF()) + 0.7152 * lin(c.greenF()) + 0.0722 * lin(c.blueF())


def _contrast(a: QColor, b: QColor) -> float:
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def test_an_unchecked_box_stands_out_from_the_dark_window(qtbot):
    app = QApplication.instance()
    studio_app.apply_theme(app, "dark")
    try:
        box = QCheckBox("Show predicted")
        qtbot.addWidget(box)
        box.show()
        qtbot.waitExposed(box)
        image = box.grab().toImage()
        window = QColor(studio_app.theme_colors()["window"])
        best = max(_contrast(image.pixelColor(x, y), window)
                   for x in range(0, 18) for y in range(image.height()))
        assert best >= 3.0  # WCAG's minimum for the parts of a control
    finally:
        studio_app.apply_theme(app, "light")


def test_an_unchecked_list_item_box_stands_out_from_the_dark_list(qtbot):
    """The Plan screen's Exclude list: its items' boxes were dark on dark."""
    app = QApplication.instance()
    studio_app.apply_theme(app, "dark")
    try:
        view = QListWidget()
        item = QListWidgetItem("edge-a")
        item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
        item.setCheckState(Qt.CheckState.Unchecked)
        view.addItem(item)
        qtbot.addWidget(view)
        view.resize(200, 60)
        view.show()
        qtbot.waitExposed(view)
        image = view.grab().toImage()
        base = QColor(studio_app.theme_colors()["base"])
        rect = view.visualItemRect(item)
        best = max(_contrast(image.pixelColor(x, y), base)
                   for x in range(rect.left() + 2, rect.left() + 22) for y in range(rect.top() + 2, rect.bottom()))
        assert best >= 3.0
    finally:
        studio_app.apply_theme(app, "light")

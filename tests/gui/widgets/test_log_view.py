"""The log dock keeps its newest line in sight (a 1024x700 window hid every line after the first few)."""

from __future__ import annotations

from PySide6.QtWidgets import QAbstractSlider

from gui import app as studio_app
from gui.main_window import MainWindow
from gui.widgets.log_view import LogView


def at_bottom(view: LogView) -> bool:
    bar = view.verticalScrollBar()
    return bar.maximum() > 0 and bar.value() == bar.maximum()


def test_the_log_shows_new_lines_after_the_window_shrinks_to_a_small_screen(qtbot, isolated_settings):
    studio_app.create_app()
    window = MainWindow()
    qtbot.addWidget(window)
    window.resize(1440, 900)
    window.show()
    qtbot.waitExposed(window)
    for i in range(30):
        window.state.log(f"line {i}")
    qtbot.waitUntil(lambda: at_bottom(window.log_view))
    window.resize(1024, 700)  # the dock goes to 80 px, which left the view a few lines above its end
    qtbot.waitUntil(lambda: window.log_dock.height() < 110)
    window.state.log("the newest line")
    qtbot.waitUntil(lambda: at_bottom(window.log_view))
    window.close()


def test_the_log_stays_where_the_operator_scrolled_back_to_and_follows_again_at_the_bottom(qtbot):
    view = LogView()
    qtbot.addWidget(view)
    view.resize(300, 80)
    view.show()
    qtbot.waitExposed(view)
    for i in range(40):
        view.append_line(f"line {i}")
    bar = view.verticalScrollBar()
    assert at_bottom(view)
    bar.triggerAction(QAbstractSlider.SliderAction.SliderToMinimum)  # as the wheel or a drag does
    assert not view.following
    view.append_line("one more")
    assert bar.value() == 0
    bar.triggerAction(QAbstractSlider.SliderAction.SliderToMaximum)
    assert view.following
    view.append_line("and another")
    assert at_bottom(view)

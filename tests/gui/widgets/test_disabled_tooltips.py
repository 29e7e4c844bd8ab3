"""Disabled controls say why in their tooltip (issue item 7)."""

from __future__ import annotations

from PySide6.QtWidgets import QAbstractButton

from gui.widgets import UNAVAILABLE

EXPLAINED_ALREADY = {"Start agent", "Profile cluster", "Compare"}
"""Buttons whose whole tooltip is already the reason (set by their screen as the state changes)."""


def test_every_disabled_button_of_a_fresh_window_says_why(window):
    silent = []
    for name, screen in window.screens.titled():
        if name == "Experiments":
            continue
        for b in screen.findChildren(QAbstractButton):
            text = b.text()
            if not b.isEnabled() and text and text not in EXPLAINED_ALREADY and UNAVAILABLE not in b.toolTip():
                silent.append(f"{name}: {text}")
    assert silent == []


def test_the_reason_goes_when_the_button_is_enabled_and_returns_when_disabled(window):
    stop = window.screens.run.stop_button
    assert stop.toolTip().endswith(UNAVAILABLE + "no run in progress")
    stop.setEnabled(True)
    assert UNAVAILABLE not in stop.toolTip() and stop.toolTip().startswith("Stop the run")
    stop.setEnabled(False)
    assert stop.toolTip().count(UNAVAILABLE) == 1


def test_saying_why_again_replaces_the_reason_instead_of_adding_one(qtbot):
    from PySide6.QtWidgets import QPushButton

    from gui.widgets import say_why_disabled

    b = QPushButton("Go")
    qtbot.addWidget(b)
    b.setToolTip("Does it")
    b.setEnabled(False)
    say_why_disabled({b: "first reason"})
    say_why_disabled({b: "second reason"})
    assert b.toolTip() == "Does it" + UNAVAILABLE + "second reason"

"""Fixtures of the GUI tests: each test's closed windows deleted when it ends, isolated settings, a window."""

from __future__ import annotations

import pytest
import shiboken6
from PySide6.QtCore import QEvent, QObject, QSettings
from PySide6.QtWidgets import QApplication

from gui import app as studio_app
from gui.main_window import MainWindow
from gui.widgets.gui_thread_collector import install_gui_thread_collector
from tests.gui.widget_lifetimes import (LEFT_OVER_WIDGETS, OWNED_BY_THE_TEST, collect_garbage, recording_init,
                                        release_connections)


@pytest.fixture(scope="package", autouse=True)
def _garbage_collected_on_the_gui_thread(qapp):
    """The studio's collector (``create_app`` installs it) from the first GUI test on, whether or not
    the test makes a window: a background ``import torch`` left running by one test collected on its
    worker thread and deleted Qt objects under the next test's set-up (a segfault). Given back when
    tests/gui ends, so the other packages' tests collect as any interpreter does."""
    collector = install_gui_thread_collector(qapp)
    yield
    collector.uninstall()


@pytest.fixture(autouse=True)
def _closed_widgets_deleted(monkeypatch):
    """Delete each test's closed widgets when it ends. ``create_app()`` (called by every window's
    test) restyles every widget alive, and nothing a test closed was deleted: pytest-qt's
    ``deleteLater`` waits for an event loop that never runs at the top level, and the objects of
    OWNED_BY_THE_TEST kept theirs reachable. Every later test re-polished them all (seconds a test
    by the end of tests/gui, growing with the number of tests before it)."""
    made: list[QObject] = []
    for cls in OWNED_BY_THE_TEST:
        monkeypatch.setattr(cls, "__init__", recording_init(cls.__init__, made))
    yield
    app = QApplication.instance()
    if app is None:
        return
    for obj in made:
        if shiboken6.isValid(obj) and obj.parent() is None:
            release_connections(obj)
    made.clear()
    QApplication.sendPostedEvents(None, QEvent.DeferredDelete)
    if len(app.allWidgets()) > LEFT_OVER_WIDGETS:
        collect_garbage()


@pytest.fixture
def isolated_settings(tmp_path, monkeypatch):
    """QSettings in a temporary folder, so tests never touch the user's own settings."""
    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(tmp_path))
    monkeypatch.setenv("EDGESHARD_HOME", str(tmp_path / "deploy-workspace"))  # no remembered deployments
    yield tmp_path


@pytest.fixture
def window(qtbot, isolated_settings):
    """A fresh main window, not shown (a test shows it at the size it needs)."""
    studio_app.create_app()
    w = MainWindow()
    qtbot.addWidget(w)
    yield w
    w.close()


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """QSettings and the studio folder in a temporary folder (what a reopened studio restores);
    returns the studio folder."""
    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(tmp_path / "settings"))
    monkeypatch.setenv("EDGESHARD_HOME", str(tmp_path / "deploy-workspace"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    studio_app.create_app()
    studio_app.settings().clear()
    return tmp_path / "data" / "edgeshard" / "studio"

"""Fixtures shared by the main-window tests."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QSettings

from gui import app as studio_app
from gui.main_window import MainWindow


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

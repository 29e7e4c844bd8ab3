"""Builds the Run and Sessions screens (owned by gui/run_panel.py and gui/sessions_panel.py)
and connects them to the shared StudioState."""

from __future__ import annotations

from PySide6.QtWidgets import QWidget

from gui.studio_state import StudioState


def make_run_screen(state: StudioState) -> QWidget:
    from gui.run_panel import RunPanel

    return RunPanel(state)


def make_sessions_screen(state: StudioState) -> QWidget:
    from gui.sessions_panel import SessionsPanel

    return SessionsPanel(state)

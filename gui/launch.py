"""Starts the studio: the QApplication, the main window, and optionally the demo cluster."""

from __future__ import annotations

from gui.app import create_app
from gui.main_window import MainWindow


def open_demo_window(workspace: str | None = None, **demo_options):
    """The main window and a started ``DemoSession``. The demo's agents are started before the
    window is built, so their start-up (each agent process imports torch) overlaps building
    the window instead of following it; the demo's results reach the window through queued
    signals, delivered once the event loop runs."""
    from gui.demo import DemoSession
    from gui.studio_state import StudioState

    state = StudioState()
    demo_session = DemoSession(state, workspace=workspace, **demo_options)
    demo_session.start()
    window = MainWindow(state)
    state.setParent(window)
    demo_session.window = window
    return window, demo_session


def launch(workspace: str | None = None, profile: str | None = None, demo: bool = False) -> int:
    app = create_app()
    demo_session = None
    if demo:
        window, demo_session = open_demo_window(workspace)
    else:
        window = MainWindow()
        window.restore_last_workspace()  # the demo keeps its own workspace, and does not replace this one
        if workspace:
            window.open_workspace(workspace)
    if profile:
        window.load_profile_file(profile)
    window.show()
    try:
        code = app.exec()
    finally:
        if demo_session is not None:
            demo_session.stop()  # agents stopped in parallel; the training process killed
    exit_without_teardown(code)
    return code


def exit_without_teardown(code: int) -> None:
    """End the studio once everything is closed, skipping the interpreter's teardown of
    torch and transformers modules (seconds here), so quitting takes well under a second.
    Settings are synced first; the workspace is SQLite in WAL mode, durable at each commit."""
    import os
    import sys

    from PySide6.QtCore import QSettings

    QSettings().sync()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

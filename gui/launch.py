"""Starts the studio: the QApplication, the main window, and optionally the demo cluster."""

from __future__ import annotations

from gui.app import create_app
from gui.main_window import MainWindow


def launch(workspace: str | None = None, profile: str | None = None, demo: bool = False) -> int:
    app = create_app()
    window = MainWindow()
    demo_session = None
    if demo:
        from gui.demo import DemoSession

        demo_session = DemoSession(window.state, window=window, workspace=workspace)
        demo_session.start()
    elif workspace:
        window.open_workspace(workspace)
    if profile:
        window.load_profile_file(profile)
    window.show()
    try:
        return app.exec()
    finally:
        if demo_session is not None:
            demo_session.stop()

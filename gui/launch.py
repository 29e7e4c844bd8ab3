"""Starts the studio: the QApplication, the main window, and optionally the demo cluster.

The heavy GUI modules (pyqtgraph, the screens) are imported only once the demo's agents are
being started: the agents' zygote spends seconds importing torch and transformers, and that
should overlap the window's own start-up, not follow it.
"""

from __future__ import annotations


def open_demo_window(workspace: str | None = None, workdir: str | None = None, **demo_options):
    """The main window and a started ``DemoSession``. The agents' zygote is started first,
    before any Qt or studio module is imported (its imports of torch and transformers are the
    longest part of the demo's start), then the demo's setup, then the QApplication and the
    window, so the agents' start-up overlaps building the window instead of following it; the
    demo's results reach the window through queued signals, delivered once the event loop runs
    (signals posted before the QApplication exists are delivered then too)."""
    import os
    import tempfile

    from agents.zygote import start_early_zygote

    own_workdir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="edgeshard-demo-")
    zygote = start_early_zygote(os.path.join(workdir, "cluster"))
    from gui.demo import DemoSession
    from gui.studio_state import StudioState

    state = StudioState()
    demo_session = DemoSession(state, workspace=workspace, workdir=workdir, own_workdir=own_workdir, zygote=zygote,
                               **demo_options)
    demo_session.start()
    from PySide6.QtWidgets import QApplication

    from gui.app import create_app
    from gui.main_window import MainWindow

    if QApplication.instance() is None:
        create_app()
    window = MainWindow(state)
    state.setParent(window)
    demo_session.show_starting(window)
    return window, demo_session


def launch(workspace: str | None = None, profile: str | None = None, demo: bool = False) -> int:
    demo_session = None
    if demo:
        window, demo_session = open_demo_window(workspace)
        from PySide6.QtWidgets import QApplication

        app = QApplication.instance()
    else:
        from gui.app import create_app
        from gui.main_window import MainWindow

        app = create_app()
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

"""A Sessions screen on a workspace with one of its runs opened (shared by replay tests)."""

from __future__ import annotations

from gui.screens.sessions import SessionsPanel
from gui.studio_state import StudioState


def sessions_with_run_open(qtbot, workspace: str, run_id: int) -> SessionsPanel:
    """A real SessionsPanel on ``workspace``, its list read and ``run_id`` loaded (paused at its start)."""
    state = StudioState()
    state.set_workspace(workspace)
    panel = SessionsPanel(state)
    qtbot.addWidget(panel)
    qtbot.waitUntil(lambda: panel.tree.topLevelItemCount() > 0, timeout=30_000)
    with qtbot.waitSignal(panel.run_opened, timeout=30_000):
        panel.open_run(run_id)
    return panel

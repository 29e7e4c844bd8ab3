"""The studio's screens, built once and reached by typed attribute (``screens.run``), never
by a string key or ``hasattr``: a renamed method or a missing screen is an error where the
wiring is written, not a menu that silently disappears."""

from __future__ import annotations

from dataclasses import dataclass, fields

from PySide6.QtWidgets import QWidget

from gui.cluster_panel import ClusterPanel
from gui.devices_panel import DevicesPanel
from gui.experiments_panel import ExperimentsPanel
from gui.plan_editor import PlanEditorPanel
from gui.plan_views import PlanScreen
from gui.profile_panel import ProfilePanel
from gui.run_panel import RunPanel
from gui.sessions_panel import SessionsPanel
from gui.studio_state import StudioState


@dataclass(frozen=True)
class Screens:
    """In sidebar order; a field's name, capitalised, is the screen's title."""

    devices: DevicesPanel
    cluster: ClusterPanel
    profile: ProfilePanel
    plan: PlanScreen
    """The chosen technique's plan view (``plan.view``); Auto-solve and Compare go there."""
    run: RunPanel
    sessions: SessionsPanel
    experiments: ExperimentsPanel

    @classmethod
    def build(cls, state: StudioState) -> Screens:
        return cls(devices=DevicesPanel(state), cluster=ClusterPanel(state), profile=ProfilePanel(state),
                   plan=PlanScreen(state), run=RunPanel(state), sessions=SessionsPanel(state),
                   experiments=ExperimentsPanel(state))

    @property
    def plan_editor(self) -> PlanEditorPanel:
        """Layer sharding's plan editor (built with the Plan screen): plan files, undo and redo."""
        view = self.plan.view_for("layer-sharding")
        assert isinstance(view, PlanEditorPanel)
        return view

    def titled(self) -> list[tuple[str, QWidget]]:
        """(title, screen) in sidebar order."""
        return [(f.name.capitalize(), getattr(self, f.name)) for f in fields(self)]


SCREEN_TITLES = tuple(f.name.capitalize() for f in fields(Screens))

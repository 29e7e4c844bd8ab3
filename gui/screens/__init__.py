"""The studio's screens, built once and reached by typed attribute (``screens.run``), never
by a string key or ``hasattr``: a renamed method or a missing screen is an error where the
wiring is written, not a menu that silently disappears."""

from __future__ import annotations

from dataclasses import dataclass, fields

from PySide6.QtWidgets import QWidget

from gui.screens.cluster import ClusterPanel
from gui.screens.devices import DevicesPanel
from gui.screens.experiments import ExperimentsPanel
from gui.techniques.layer_sharding.editor import PlanEditorPanel
from gui.screens.plan import PlanScreen
from gui.screens.profile import ProfilePanel
from gui.screens.run import RunPanel
from gui.screens.sessions import SessionsPanel
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
